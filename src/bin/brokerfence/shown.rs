//! A job's bytes (payload, progress, result) as `job` shows them: escaped, so that any bytes are
//! one line of plain text, and cut at [`SHOWN_BYTES`] unless `--full`.

use serde_json::Value;

/// The most bytes of one value `job` shows without `--full`.
pub(crate) const SHOWN_BYTES: usize = 200;

/// One value as shown: the escaped text (a UTF-8 value in quotes with Rust's escapes, `"a\nb"`;
/// other bytes as a byte string, `b"\xff\x00ok"`), its length in bytes, and whether it was cut.
pub(crate) struct Shown {
    pub(crate) text: String,
    pub(crate) bytes: usize,
    pub(crate) truncated: bool,
}

impl Shown {
    /// `bytes`, whole when `full`, else at most [`SHOWN_BYTES`] of it (at a character boundary).
    pub(crate) fn new(bytes: &[u8], full: bool) -> Self {
        let cut = if full { bytes.len() } else { bytes.len().min(SHOWN_BYTES) };
        let text = match std::str::from_utf8(bytes) {
            Ok(s) => {
                let mut end = cut;
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                // Debug: quotes, `\n`, `\"`, `\u{1b}` (a terminal control code is never sent raw).
                format!("{:?}", &s[..end])
            }
            Err(_) => format!("b\"{}\"", bytes[..cut].escape_ascii()),
        };
        Self { text, bytes: bytes.len(), truncated: cut < bytes.len() }
    }

    /// The text line: `14 bytes: "done"`, and ` … (--full shows all)` when cut.
    pub(crate) fn line(&self) -> String {
        let more = if self.truncated { " … (--full shows all)" } else { "" };
        format!("{} bytes: {}{more}", self.bytes, self.text)
    }

    /// The JSON value (the escaped text) of an optional value.
    pub(crate) fn json(shown: Option<&Shown>) -> Value {
        shown.map_or(Value::Null, |s| Value::String(s.text.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_cuts() {
        assert_eq!(Shown::new("done\n\"7\" é".as_bytes(), false).line(), r#"11 bytes: "done\n\"7\" é""#);
        assert_eq!(Shown::new(b"\xff\x00ok", false).line(), r#"4 bytes: b"\xff\x00ok""#);
        assert_eq!(Shown::new(b"\x1b[31m", false).text, r#""\u{1b}[31m""#);
        let long = "é".repeat(SHOWN_BYTES);
        let cut = Shown::new(long.as_bytes(), false);
        assert!(cut.truncated && cut.line().ends_with("… (--full shows all)"), "{}", cut.line());
        assert_eq!(cut.text.chars().filter(|c| *c == 'é').count(), SHOWN_BYTES / 2);
        assert!(!Shown::new(long.as_bytes(), true).truncated);
    }
}
