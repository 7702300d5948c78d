//! Issue #30 (see main.rs for the items of this module).
