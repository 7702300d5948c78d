//! What a new user meets first: the public API, the errors, the demo's build.
//!
//! | module | what |
//! |---|---|
//! | [`api`] | the public API of `brokerfence`, checked against a listing (one path per item) |
//! | [`demo`] | `cargo run --example zombie` compiles at most 150 crates |
//! | [`results`] | errors keep the broker's typed cause; the three retrofits answer one `Processed` |

mod api;
mod demo;
mod results;
