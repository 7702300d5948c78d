//! Parsing of raw replies. Stream entries are read field by field as bytes, so an entry with a
//! binary field name or value never fails the parse of a whole batch: it is one undecodable entry,
//! dead-lettered on its own.

use ::redis::Value;

/// One stream entry as Redis returned it. `fields` is `None` when the entry's data is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawEntry {
    pub id: String,
    pub fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

impl RawEntry {
    /// The first value of field `name`.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields.as_ref()?.iter().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| v.as_slice())
    }
}

pub(crate) fn bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        Value::VerbatimString { text, .. } => Some(text.into_bytes()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        Value::Okay => Some(b"OK".to_vec()),
        _ => None,
    }
}

fn string(v: Value) -> Option<String> {
    bytes(v).and_then(|b| String::from_utf8(b).ok())
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn items(v: Value) -> Option<Vec<Value>> {
    match v {
        Value::Array(a) | Value::Set(a) => Some(a),
        Value::Nil => Some(Vec::new()),
        _ => None,
    }
}

fn fields(v: Value) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    match v {
        Value::Array(flat) => {
            let mut out = Vec::with_capacity(flat.len() / 2);
            let mut it = flat.into_iter();
            while let (Some(k), Some(val)) = (it.next(), it.next()) {
                out.push((bytes(k)?, bytes(val)?));
            }
            Some(out)
        }
        Value::Map(pairs) => pairs.into_iter().map(|(k, val)| Some((bytes(k)?, bytes(val)?))).collect(),
        _ => None,
    }
}

fn entry(v: Value) -> Result<RawEntry, String> {
    let mut parts = items(v).ok_or("entry is not an array")?.into_iter();
    let id = parts.next().and_then(string).ok_or("entry without an id")?;
    let fields = parts.next().and_then(fields);
    Ok(RawEntry { id, fields })
}

fn entries(v: Value) -> Result<Vec<RawEntry>, String> {
    items(v).ok_or("entries are not an array")?.into_iter().map(entry).collect()
}

/// `XREADGROUP` (RESP2 array or RESP3 map of streams); nil on timeout.
pub(crate) fn read_group(v: Value) -> Result<Vec<RawEntry>, String> {
    let mut out = Vec::new();
    match v {
        Value::Nil => {}
        Value::Map(streams) => {
            for (_, e) in streams {
                out.extend(entries(e)?);
            }
        }
        other => {
            for stream in items(other).ok_or("reply is not an array")? {
                let mut parts = items(stream).ok_or("stream is not an array")?.into_iter();
                let _name = parts.next();
                if let Some(e) = parts.next() {
                    out.extend(entries(e)?);
                }
            }
        }
    }
    Ok(out)
}

/// `XAUTOCLAIM`: (next cursor, claimed entries, ids deleted from the stream).
pub(crate) fn autoclaim(v: Value) -> Result<(String, Vec<RawEntry>, Vec<String>), String> {
    let mut parts = items(v).ok_or("reply is not an array")?.into_iter();
    let next = parts.next().and_then(string).ok_or("no cursor")?;
    let claimed = match parts.next() {
        Some(e) => items(e)
            .ok_or("claimed entries are not an array")?
            .into_iter()
            .filter(|e| !matches!(e, Value::Nil))
            .map(entry)
            .collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let deleted = match parts.next() {
        Some(d) => items(d).unwrap_or_default().into_iter().filter_map(string).collect(),
        None => Vec::new(),
    };
    Ok((next, claimed, deleted))
}

/// Extended `XPENDING`: (id, consumer, delivery count) per row.
pub(crate) fn pending(v: Value) -> Result<Vec<(String, String, i64)>, String> {
    items(v)
        .ok_or("reply is not an array")?
        .into_iter()
        .map(|row| {
            let row = items(row).ok_or("row is not an array")?;
            let count = row.get(3).and_then(int).ok_or("row without a delivery count")?;
            let mut it = row.into_iter();
            let id = it.next().and_then(string).ok_or("row without an id")?;
            let consumer = it.next().and_then(string).unwrap_or_default();
            Ok((id, consumer, count))
        })
        .collect()
}

/// An array of integers (script results).
pub(crate) fn ints(v: Value) -> Result<Vec<i64>, String> {
    items(v)
        .ok_or("reply is not an array")?
        .iter()
        .map(|x| int(x).ok_or_else(|| format!("{x:?} is not an integer")))
        .collect()
}

/// An array of bulk strings (list items).
pub(crate) fn bulks(v: Value) -> Result<Vec<Vec<u8>>, String> {
    items(v)
        .ok_or("reply is not an array")?
        .into_iter()
        .map(|x| bytes(x).ok_or("not a bulk string".to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    #[test]
    fn binary_fields_do_not_fail_the_batch() {
        let reply = Value::Array(vec![Value::Array(vec![
            b(b"s"),
            Value::Array(vec![
                Value::Array(vec![b(b"1-0"), Value::Array(vec![b(b"body"), b(b"x")])]),
                Value::Array(vec![b(b"2-0"), Value::Array(vec![b(b"\xff\xfe"), b(b"\x00")])]),
                Value::Array(vec![b(b"3-0"), Value::Nil]),
            ]),
        ])]);
        let e = read_group(reply).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(e[0].field("body"), Some(&b"x"[..]));
        assert_eq!(e[1].fields.as_ref().unwrap()[0].0, b"\xff\xfe");
        assert_eq!(e[2].fields, None);
        assert!(read_group(Value::Nil).unwrap().is_empty());
    }

    #[test]
    fn autoclaim_reply() {
        let reply = Value::Array(vec![
            b(b"0-0"),
            Value::Array(vec![Value::Array(vec![b(b"5-0"), Value::Array(vec![b(b"body"), b(b"y")])])]),
            Value::Array(vec![b(b"4-0")]),
        ]);
        let (next, claimed, deleted) = autoclaim(reply).unwrap();
        assert_eq!(next, "0-0");
        assert_eq!(claimed[0].id, "5-0");
        assert_eq!(deleted, vec!["4-0".to_owned()]);
    }

    #[test]
    fn pending_rows() {
        let reply = Value::Array(vec![Value::Array(vec![b(b"5-0"), b(b"c1"), Value::Int(10), Value::Int(3)])]);
        assert_eq!(pending(reply).unwrap(), vec![("5-0".to_owned(), "c1".to_owned(), 3)]);
    }
}
