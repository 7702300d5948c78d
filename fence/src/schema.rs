//! Schema names and the embedded, versioned migrations.

use crate::error::{FenceError, Result};

/// Default schema (PostgreSQL) or table prefix (SQLite).
pub const DEFAULT_SCHEMA: &str = "brokerfence";

/// A validated SQL identifier for the fence's schema: `[a-z_][a-z0-9_]{0,62}`.
///
/// It is the only piece of text ever spliced into a statement, which is why it is checked so
/// strictly; everything else is a bound parameter.
///
/// ```
/// use brokerfence::SchemaName;
/// assert!(SchemaName::new("brokerfence").is_ok());
/// assert!(SchemaName::new("x; DROP TABLE jobs").is_err());
/// assert!(SchemaName::new("Upper").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

impl SchemaName {
    /// Validates a schema name.
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let bad = |reason| Err(FenceError::InvalidSchema { name: name.clone(), reason });
        let Some(first) = name.chars().next() else { return bad("must not be empty") };
        if name.len() > 63 {
            return bad("longer than 63 bytes");
        }
        if !(first.is_ascii_lowercase() || first == '_') {
            return bad("must start with a lowercase ASCII letter or underscore");
        }
        if !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
            return bad("only lowercase ASCII letters, digits and underscores are allowed");
        }
        if name.starts_with("pg_") {
            return bad("the pg_ prefix is reserved by PostgreSQL");
        }
        Ok(Self(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for SchemaName {
    fn default() -> Self {
        Self(DEFAULT_SCHEMA.to_owned())
    }
}

/// One SQLite migration: its statements use `{s}` where the schema name goes (PostgreSQL's are
/// steps of their own, `postgres::migrations`).
#[cfg(feature = "sqlite")]
pub(crate) struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub statements: &'static [&'static str],
}

pub(crate) fn render(sql: &str, schema: &SchemaName) -> String {
    sql.replace("{s}", schema.as_str())
}
