//! The trace envelope of a list item: how a Redis list, whose items are bare bytes with no room
//! for a field, carries the producer's W3C trace context (issue #34).
//!
//! An enveloped item is `\0trace\0` + `traceparent` + `\0` + `tracestate` (may be empty) + `\0` +
//! the item as it would be without the envelope. A trace context is printable ASCII, so it never
//! holds the NUL that ends it. [`ReliableList`](super::ReliableList) and
//! [`ListRetrofit`](super::ListRetrofit) unwrap it before [`ItemKey`](super::ItemKey) decodes the
//! item, with or without the feature `otel`, so a content hash and a split key see the item only
//! (the same item with two contexts is one job) and a worker built without `otel` still reads an
//! enveloped item. Producers wrap items with [`traced_item`](crate::redis::traced_item) (feature
//! `otel`); only producers whose consumers run this version should, since an older consumer
//! reads the envelope as part of the item. An item that starts with the marker but has no end of
//! the context within its first 1,024 bytes is read as a bare item.

/// What starts an enveloped item.
pub(crate) const MARKER: &[u8] = b"\0trace\0";

/// The most bytes of the context part (`traceparent` + `\0` + `tracestate` + `\0`) that are
/// searched for its end: the longest `traceparent` read (256) and `tracestate` (512), with room.
pub(crate) const MAX_ENVELOPE: usize = 1024;

/// An item without its envelope: the item, and the context's `traceparent` and `tracestate`
/// (text as found: validated where it is read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Opened<'a> {
    pub(crate) item: &'a [u8],
    pub(crate) traceparent: Option<&'a [u8]>,
    pub(crate) tracestate: Option<&'a [u8]>,
}

/// Opens `raw`: the enveloped item's parts, or `raw` itself as a bare item.
pub(crate) fn open(raw: &[u8]) -> Opened<'_> {
    let bare = Opened { item: raw, traceparent: None, tracestate: None };
    let Some(rest) = raw.strip_prefix(MARKER) else { return bare };
    let window = &rest[..rest.len().min(MAX_ENVELOPE)];
    let Some(first) = window.iter().position(|b| *b == 0) else { return bare };
    let Some(second) = window[first + 1..].iter().position(|b| *b == 0).map(|p| first + 1 + p) else {
        return bare;
    };
    let state = &rest[first + 1..second];
    Opened {
        item: &rest[second + 1..],
        traceparent: Some(&rest[..first]),
        tracestate: (!state.is_empty()).then_some(state),
    }
}

/// The item inside `raw`'s envelope, or `raw` itself.
#[cfg(feature = "otel")]
pub(crate) fn unwrap(raw: &[u8]) -> &[u8] {
    open(raw).item
}

/// `item` in an envelope carrying `traceparent` and `tracestate` (both already valid).
#[cfg(feature = "otel")]
pub(crate) fn wrap(item: &[u8], traceparent: &str, tracestate: Option<&str>) -> Vec<u8> {
    let state = tracestate.unwrap_or("");
    let mut out = Vec::with_capacity(MARKER.len() + traceparent.len() + state.len() + 2 + item.len());
    out.extend_from_slice(MARKER);
    out.extend_from_slice(traceparent.as_bytes());
    out.push(0);
    out.extend_from_slice(state.as_bytes());
    out.push(0);
    out.extend_from_slice(item);
    out
}

/// The producer's context of a delivered item (feature `otel`): a malformed one is ignored
/// with a warning naming the list item.
#[cfg(feature = "otel")]
pub(crate) fn origin(raw: &[u8]) -> fence::otel::Origin {
    let opened = open(raw);
    let tp = opened.traceparent.map(String::from_utf8_lossy);
    let ts = opened.tracestate.map(String::from_utf8_lossy);
    fence::otel::Origin::new(fence::otel::TraceContext::read(tp.as_deref(), ts.as_deref(), "list item"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn otel_list_envelope_opens_what_it_wraps_and_leaves_bare_items_alone() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut raw = MARKER.to_vec();
        raw.extend_from_slice(tp.as_bytes());
        raw.extend_from_slice(b"\0a=1\0order-7|{\"qty\":2}");
        let o = open(&raw);
        assert_eq!(o.item, b"order-7|{\"qty\":2}");
        assert_eq!(o.traceparent, Some(tp.as_bytes()));
        assert_eq!(o.tracestate, Some(&b"a=1"[..]));
        // No tracestate; an empty item.
        let mut raw = MARKER.to_vec();
        raw.extend_from_slice(b"tp\0\0");
        assert_eq!(open(&raw), Opened { item: b"", traceparent: Some(b"tp"), tracestate: None });
        // Bare items, and a marker without the end of its context, are the item itself.
        for bare in [&b"hello"[..], b"", b"\0trace", b"\0trace\0no end", b"\0trace\0one\0only"] {
            assert_eq!(open(bare), Opened { item: bare, traceparent: None, tracestate: None }, "{bare:?}");
        }
        let mut long = MARKER.to_vec();
        long.extend(std::iter::repeat_n(b'x', MAX_ENVELOPE));
        long.extend_from_slice(b"\0\0item");
        assert_eq!(open(&long).item, &long[..], "the end of the context is looked for within MAX_ENVELOPE bytes");
    }

    #[cfg(feature = "otel")]
    #[test]
    fn otel_list_envelope_round_trips() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let raw = wrap(b"item", tp, Some("a=1"));
        assert_eq!(open(&raw), Opened { item: b"item", traceparent: Some(tp.as_bytes()), tracestate: Some(b"a=1") });
        let origin = origin(&raw);
        assert_eq!(origin.get_trace().map(|t| t.traceparent()), Some(tp));
        assert_eq!(open(&wrap(b"", tp, None)).tracestate, None);
    }
}
