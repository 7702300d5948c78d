//! What a new user meets first: the demo's build.
//!
//! | module | what |
//! |---|---|
//! | [`demo`] | `cargo run --example zombie` compiles at most 150 crates |

mod demo;
