//! The shared argument parser (filled in below).
