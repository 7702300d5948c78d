//! What a new user meets first: the demo's build.
//!
//! | module | what |
//! |---|---|
//! | [`demo`] | `cargo run --example zombie` compiles at most 150 crates |
//! | [`results`] | errors keep the broker's typed cause; the three retrofits answer one `Processed` |

mod demo;
mod results;
