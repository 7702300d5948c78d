//! HTML escaping: every text the dashboard shows that came from a database or a request (keys,
//! owners, errors, payloads, queue names) goes through [`html`] or [`Text`], in element content
//! and in quoted attribute values alike.

use std::fmt;

/// `s` with `& < > " '` replaced by entities, and control characters other than tab and line
/// breaks shown as `U+XXXX` (they are invisible, and some terminals copying a page act on them).
pub(crate) fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + s.len() / 8);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if c.is_control() => out.push_str(&format!("U+{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

/// At most `max` characters of `s`, and whether it was cut.
pub(crate) fn cut(s: &str, max: usize) -> (&str, bool) {
    match s.char_indices().nth(max) {
        Some((at, _)) => (&s[..at], true),
        None => (s, false),
    }
}

/// A text shown escaped, cut at `max` characters with an ellipsis (the whole text in the
/// element's `title`, escaped as well, up to 4,096 characters).
pub(crate) struct Text<'a> {
    pub(crate) text: &'a str,
    pub(crate) max: usize,
}

impl fmt::Display for Text<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (shown, was_cut) = cut(self.text, self.max);
        if was_cut {
            let (title, _) = cut(self.text, 4096);
            write!(f, "<span title=\"{}\">{}…</span>", html(title), html(shown))
        } else {
            f.write_str(&html(shown))
        }
    }
}

/// Percent-encodes `s` for a query string value (RFC 3986 unreserved characters stay).
pub(crate) fn query_value(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(char::from(b)),
            b => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dashboard_escape_html_covers_markup_quotes_and_controls() {
        assert_eq!(html(r#"<script>alert("x")</script>"#), "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;");
        assert_eq!(html("a'b&c"), "a&#39;b&amp;c");
        assert_eq!(html("\u{1b}[31m\u{0}x\ty"), "U+001B[31mU+0000x\ty");
        assert_eq!(html("é ✓"), "é ✓");
        // An attribute cannot be left: neither quote survives.
        assert!(!html(r#"" onmouseover='x'"#).contains(['"', '\'']));
    }

    #[test]
    fn dashboard_escape_cut_keeps_characters_whole() {
        assert_eq!(cut("ééé", 2), ("éé", true));
        assert_eq!(cut("ab", 2), ("ab", false));
        let long = "<".repeat(1024);
        let shown = Text { text: &long, max: 10 }.to_string();
        assert!(shown.starts_with("<span title=\"&lt;"), "{shown}");
        assert!(shown.ends_with(&format!("{}…</span>", "&lt;".repeat(10))), "{shown}");
        assert!(!shown.contains("<<"));
    }

    #[test]
    fn dashboard_escape_query_values() {
        assert_eq!(query_value("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
        assert_eq!(query_value("ok-1_2.3~"), "ok-1_2.3~");
    }
}
