//! Which job a message is: the key strategy, and the reasons a message has no usable key.

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use fence::JobKey;

/// How the job key of a message is chosen. Two messages with the same key are the same job: the
/// second delivery of a completed job is acknowledged as a duplicate.
///
/// ```
/// use brokerfence::sqs::KeyStrategy;
/// // default: MessageDeduplicationId on FIFO queues, MessageId on standard queues
/// assert_eq!(KeyStrategy::default(), KeyStrategy::Auto);
/// // a producer-chosen id, so a message re-sent by the producer dedupes:
/// let by_attr = KeyStrategy::attribute("order-id");
/// let by_body = KeyStrategy::body_field("/order/id"); // JSON pointer, or a top-level field name
/// # let _ = (by_attr, by_body);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyStrategy {
    /// `MessageDeduplicationId` on a FIFO queue, `MessageId` on a standard queue.
    #[default]
    Auto,
    /// The SQS `MessageId` (unique per send: a producer's re-send is a new job).
    MessageId,
    /// The FIFO `MessageDeduplicationId` (explicit or content-based).
    DeduplicationId,
    /// A message attribute of type `String` or `Number` (custom subtypes such as `String.uuid`
    /// included).
    Attribute(String),
    /// A message attribute of type `Binary` whose bytes are the key in UTF-8.
    BinaryAttribute(String),
    /// A field of a JSON body: a JSON pointer (`/order/id`) or a top-level field name (`id`). The
    /// value must be a string or a number.
    BodyField(String),
}

impl KeyStrategy {
    /// Key = the `String`/`Number` message attribute `name`.
    pub fn attribute(name: impl Into<String>) -> Self {
        KeyStrategy::Attribute(name.into())
    }

    /// Key = the `Binary` message attribute `name`, decoded as UTF-8.
    pub fn binary_attribute(name: impl Into<String>) -> Self {
        KeyStrategy::BinaryAttribute(name.into())
    }

    /// Key = a field of the JSON body (`/a/b` JSON pointer, or a top-level field name).
    pub fn body_field(field: impl Into<String>) -> Self {
        KeyStrategy::BodyField(field.into())
    }

    /// The job key of `message`, or why it has none (the message is then dead-lettered with that
    /// reason). `fifo` says whether the queue is a FIFO queue (for [`KeyStrategy::Auto`]).
    ///
    /// ```
    /// use brokerfence::sqs::KeyStrategy;
    /// use aws_sdk_sqs::types::{Message, MessageAttributeValue};
    /// let msg = Message::builder()
    ///     .message_id("m-1")
    ///     .body(r#"{"order":{"id":42}}"#)
    ///     .message_attributes("order-id", MessageAttributeValue::builder().data_type("String").string_value("o-42").build().unwrap())
    ///     .build();
    /// assert_eq!(KeyStrategy::Auto.key_of(&msg, false).unwrap().as_str(), "m-1");
    /// assert_eq!(KeyStrategy::attribute("order-id").key_of(&msg, false).unwrap().as_str(), "o-42");
    /// assert_eq!(KeyStrategy::body_field("/order/id").key_of(&msg, false).unwrap().as_str(), "42");
    /// assert!(KeyStrategy::attribute("missing").key_of(&msg, false).is_err());
    /// ```
    pub fn key_of(&self, message: &Message, fifo: bool) -> Result<JobKey, String> {
        // Borrowed from the message where it can be: the key copies it once.
        let raw: std::borrow::Cow<'_, str> = match self {
            KeyStrategy::Auto if fifo => dedup_id(message)?.into(),
            KeyStrategy::Auto | KeyStrategy::MessageId => {
                message.message_id().ok_or_else(|| "message has no MessageId".to_owned())?.into()
            }
            KeyStrategy::DeduplicationId => dedup_id(message)?.into(),
            KeyStrategy::Attribute(name) => string_attribute(message, name)?.into(),
            KeyStrategy::BinaryAttribute(name) => return binary_attribute(message, name),
            KeyStrategy::BodyField(field) => body_field(message, field)?.into(),
        };
        JobKey::try_from(raw.as_ref()).map_err(|e| format!("{} ({})", e, self.describe()))
    }

    fn describe(&self) -> String {
        match self {
            KeyStrategy::Auto => "key strategy: auto".into(),
            KeyStrategy::MessageId => "key strategy: MessageId".into(),
            KeyStrategy::DeduplicationId => "key strategy: MessageDeduplicationId".into(),
            KeyStrategy::Attribute(n) => format!("key strategy: attribute {n:?}"),
            KeyStrategy::BinaryAttribute(n) => format!("key strategy: binary attribute {n:?}"),
            KeyStrategy::BodyField(f) => format!("key strategy: body field {f:?}"),
        }
    }
}

fn dedup_id(message: &Message) -> Result<&str, String> {
    message
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::MessageDeduplicationId))
        .map(String::as_str)
        .ok_or_else(|| "message has no MessageDeduplicationId (not a FIFO queue?)".to_owned())
}

fn base_type(data_type: &str) -> &str {
    data_type.split('.').next().unwrap_or(data_type)
}

fn string_attribute<'m>(message: &'m Message, name: &str) -> Result<&'m str, String> {
    let attr = message
        .message_attributes()
        .and_then(|m| m.get(name))
        .ok_or_else(|| format!("message attribute {name:?} (the job key) is missing"))?;
    match base_type(attr.data_type()) {
        "String" | "Number" => {
            attr.string_value().ok_or_else(|| format!("message attribute {name:?} has no string value"))
        }
        other => Err(format!("message attribute {name:?} has type {other}; the job key must be a String or Number")),
    }
}

fn binary_attribute(message: &Message, name: &str) -> Result<JobKey, String> {
    let attr = message
        .message_attributes()
        .and_then(|m| m.get(name))
        .ok_or_else(|| format!("message attribute {name:?} (the job key) is missing"))?;
    if base_type(attr.data_type()) != "Binary" {
        return Err(format!("message attribute {name:?} has type {}; expected Binary", base_type(attr.data_type())));
    }
    let bytes = attr.binary_value().ok_or_else(|| format!("message attribute {name:?} has no binary value"))?;
    JobKey::from_bytes(bytes.as_ref()).map_err(|e| format!("message attribute {name:?}: {e}"))
}

fn body_field(message: &Message, field: &str) -> Result<String, String> {
    let body = message.body().ok_or_else(|| "message has no body".to_owned())?;
    let json: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("body is not JSON ({e}); cannot read key field {field:?}"))?;
    let pointer = if field.starts_with('/') { field.to_owned() } else { format!("/{}", escape_pointer(field)) };
    match json.pointer(&pointer) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
        Some(other) => Err(format!("body field {field:?} is {}, not a string or number", kind(other))),
        None => Err(format!("body has no field {field:?} (the job key)")),
    }
}

fn escape_pointer(field: &str) -> String {
    field.replace('~', "~0").replace('/', "~1")
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::primitives::Blob;
    use aws_sdk_sqs::types::MessageAttributeValue;

    use super::*;

    fn attr(data_type: &str, s: Option<&str>, b: Option<&[u8]>) -> MessageAttributeValue {
        let mut v = MessageAttributeValue::builder().data_type(data_type);
        if let Some(s) = s {
            v = v.string_value(s);
        }
        if let Some(b) = b {
            v = v.binary_value(Blob::new(b.to_vec()));
        }
        v.build().expect("attribute value")
    }

    fn msg(body: &str) -> aws_sdk_sqs::types::builders::MessageBuilder {
        Message::builder().message_id("mid-1").receipt_handle("rh").body(body)
    }

    #[test]
    fn defaults_and_fifo() {
        let m = msg("x").attributes(MessageSystemAttributeName::MessageDeduplicationId, "dd-1").build();
        assert_eq!(KeyStrategy::Auto.key_of(&m, false).unwrap().as_str(), "mid-1");
        assert_eq!(KeyStrategy::Auto.key_of(&m, true).unwrap().as_str(), "dd-1");
        assert_eq!(KeyStrategy::MessageId.key_of(&m, true).unwrap().as_str(), "mid-1");
        let plain = msg("x").build();
        assert!(KeyStrategy::Auto.key_of(&plain, true).unwrap_err().contains("MessageDeduplicationId"));
    }

    #[test]
    fn attribute_reasons() {
        let m = msg("x")
            .message_attributes("k", attr("String", Some("order-1"), None))
            .message_attributes("n", attr("Number.int", Some("17"), None))
            .message_attributes("b", attr("Binary", None, Some(b"bin-key")))
            .message_attributes("bad", attr("Binary", None, Some(&[0xff, 0xfe])))
            .message_attributes("long", attr("String", Some(&"x".repeat(fence::MAX_KEY_BYTES + 1)), None))
            .build();
        assert_eq!(KeyStrategy::attribute("k").key_of(&m, false).unwrap().as_str(), "order-1");
        assert_eq!(KeyStrategy::attribute("n").key_of(&m, false).unwrap().as_str(), "17");
        assert!(KeyStrategy::attribute("nope").key_of(&m, false).unwrap_err().contains("missing"));
        assert!(KeyStrategy::attribute("b").key_of(&m, false).unwrap_err().contains("type Binary"));
        assert_eq!(KeyStrategy::binary_attribute("b").key_of(&m, false).unwrap().as_str(), "bin-key");
        assert!(KeyStrategy::binary_attribute("k").key_of(&m, false).unwrap_err().contains("expected Binary"));
        assert!(KeyStrategy::binary_attribute("bad").key_of(&m, false).unwrap_err().contains("UTF-8"));
        assert!(KeyStrategy::attribute("long").key_of(&m, false).unwrap_err().contains("over the limit"));
    }

    #[test]
    fn body_reasons() {
        let ok = msg(r#"{"id":"a-1","n":7,"o":{"x/y":"deep"},"arr":[1],"nul":null}"#).build();
        assert_eq!(KeyStrategy::body_field("id").key_of(&ok, false).unwrap().as_str(), "a-1");
        assert_eq!(KeyStrategy::body_field("n").key_of(&ok, false).unwrap().as_str(), "7");
        assert_eq!(KeyStrategy::body_field("/o/x~1y").key_of(&ok, false).unwrap().as_str(), "deep");
        assert!(KeyStrategy::body_field("arr").key_of(&ok, false).unwrap_err().contains("an array"));
        assert!(KeyStrategy::body_field("nul").key_of(&ok, false).unwrap_err().contains("null"));
        assert!(KeyStrategy::body_field("zz").key_of(&ok, false).unwrap_err().contains("no field"));
        let bad = msg("not json {").build();
        assert!(KeyStrategy::body_field("id").key_of(&bad, false).unwrap_err().contains("not JSON"));
        let empty = msg(r#"{"id":""}"#).build();
        assert!(KeyStrategy::body_field("id").key_of(&empty, false).unwrap_err().contains("empty"));
        let nul = msg("{\"id\":\"a\\u0000b\"}").build();
        assert!(KeyStrategy::body_field("id").key_of(&nul, false).unwrap_err().contains("NUL"));
    }
}
