//! What a new user meets first: the public API, the errors, the demo's build.
//!
//! | module | what |
//! |---|---|
//! | [`api`] | the public API of `brokerfence`, checked against a listing (one path per item) |
//! | [`docs`] | README ≤ 400 lines, ARCHITECTURE.md ≤ 200 with a glossary, every guide compiled as doctests |
//! | [`demo`] | `cargo run --example zombie` compiles at most 150 crates |
//! | [`results`] | errors keep the broker's typed cause; the three retrofits answer one `Processed` |

mod api;
mod demo;
mod docs;
mod results;
