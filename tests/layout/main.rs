//! The repository's layout: file sizes, one-way imports among sibling modules, test support in
//! `testkit/`.
//!
//! | module | what |
//! |---|---|
//! | [`files`] | no library file over 600 lines, examples readable in one sitting, harness programs in `bench/` |
//! | [`imports`] | no import cycle among the sibling modules of `fence/src` and `adapters/src` |
//! | [`testkit`] | the code the tests share lives in `testkit/` |

mod files;
mod imports;
mod testkit;

use std::path::Path;

/// The workspace root (the parent of this package's directory, `tests/`).
pub(crate) fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".."))
}
