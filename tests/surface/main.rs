//! The public API of `brokerfence`, checked against a listing.

mod api;
