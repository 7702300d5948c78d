//! Programs run as processes: the example workers driven the way an operator's script drives
//! them, the errors a new user sees, chaos runs that pause, kill and cut off workers, and the
//! PostgreSQL topologies of production (a promoted standby, an old primary, a pooler).
//!
//! | module | what |
//! |---|---|
//! | [`edge_cases`] | exit codes, usage, the schema check, `EVENT` lines of the example workers |
//! | [`onboarding`] | what a missing service or a wrong URL looks like |
//! | [`tower_worker`] | `examples/tower_worker.rs` over the table queue |
//! | [`fault_runs`] | the chaos runner, small: lost = 0, committed twice = 0 |
//! | [`failover`] | primary and standby, promotion, the old primary, pools that follow |

mod edge_cases;
mod failover;
mod fault_runs;
mod onboarding;
mod tower_worker;
