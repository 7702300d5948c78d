//! (issue #31: filled by this module's tests)
