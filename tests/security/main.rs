//! Credentials and transport: secrets never logged nor shown, TLS to PostgreSQL and Redis, and the
//! fence under a database role that owns nothing. `secrets` captures every log line of this
//! process at TRACE level, so this binary holds only these few tests.
//!
//! | module | what |
//! |---|---|
//! | [`secrets`] | no credential in logs, `Debug` or `Display`; PostgreSQL's TLS modes |
//! | [`least_privilege`] | a role with only the grants the fence schema needs |
//! | [`redis_tls`] | `rediss://`, and a server without TLS refused |

mod least_privilege;
mod redis_tls;
mod secrets;
