//! The operator CLI (`brokerfence`, feature `cli`), run as a process against PostgreSQL and
//! SQLite (built for the test by `brokerfence_testkit::programs`).

mod commands;
mod dashboard;
mod dashboard_browser;
