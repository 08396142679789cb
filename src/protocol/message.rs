//! The message a handler sees: plain data, no SDK types.

use std::collections::BTreeMap;

/// One SQS message as the handler sees it, whichever runtime received it.
///
/// Built by the runtimes from an SQS `ReceiveMessage` result or a Lambda SQS
/// record; tests build it with [`Message::new`] and the `with_*` setters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    id: String,
    body: String,
    attributes: BTreeMap<String, Attribute>,
    group_id: Option<String>,
    deduplication_id: Option<String>,
    sender_id: Option<String>,
    receive_count: u32,
    receipt_handle: Option<String>,
    dedup_key: Option<String>,
    /// The dedup key a runtime read for the lane split, with the address of
    /// the `ProcessorConfig` it read it by: the processor with that config
    /// takes it as read; any other (a copy a handler hands on) reads its own.
    pre_read: Option<(String, usize)>,
    aws_trace_header: Option<String>,
    queue: Option<String>,
    raw_body: Option<String>,
    envelope: Option<Envelope>,
}

impl Message {
    /// A message with an SQS message id and a body; receive count 1.
    pub fn new(id: impl Into<String>, body: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            body: body.into(),
            attributes: BTreeMap::new(),
            group_id: None,
            deduplication_id: None,
            sender_id: None,
            receive_count: 1,
            receipt_handle: None,
            dedup_key: None,
            pre_read: None,
            aws_trace_header: None,
            queue: None,
            raw_body: None,
            envelope: None,
        }
    }

    /// Adds a string message attribute (SQS `MessageAttributes`, type `String`).
    pub fn with_attribute(self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.with_typed_attribute(name, Attribute::string(value))
    }

    /// Adds an attribute as a runtime received it (data type and raw values);
    /// one without a value of its type is logged and left out.
    pub(crate) fn with_received_attribute(
        self,
        name: String,
        data_type: String,
        text: Option<String>,
        binary: Option<Vec<u8>>,
    ) -> Self {
        match Attribute::typed(data_type, text, binary) {
            Some(a) => self.with_typed_attribute(name, a),
            None => {
                tracing::warn!(message_id = self.id(), attribute = %name, "message attribute without a value of its type; ignored");
                self
            }
        }
    }

    /// Adds a message attribute of any type (`Number`, `Binary`, `String.x`, ...).
    pub fn with_typed_attribute(mut self, name: impl Into<String>, attribute: Attribute) -> Self {
        self.attributes.insert(name.into(), attribute);
        self
    }

    /// Sets the FIFO message group id.
    pub fn with_group_id(mut self, group: impl Into<String>) -> Self {
        self.group_id = Some(group.into());
        self
    }

    /// Sets the FIFO deduplication id.
    pub fn with_deduplication_id(mut self, id: impl Into<String>) -> Self {
        self.deduplication_id = Some(id.into());
        self
    }

    /// Sets who sent the message (SQS's `SenderId`).
    pub fn with_sender_id(mut self, sender: impl Into<String>) -> Self {
        self.sender_id = Some(sender.into());
        self
    }

    /// Sets how many times SQS has delivered this message (`ApproximateReceiveCount`).
    pub fn with_receive_count(mut self, count: u32) -> Self {
        self.receive_count = count.max(1);
        self
    }

    /// Sets the receipt handle of this delivery.
    pub fn with_receipt_handle(mut self, handle: impl Into<String>) -> Self {
        self.receipt_handle = Some(handle.into());
        self
    }

    /// Sets the `AWSTraceHeader` system attribute (the producer's X-Ray trace
    /// header): see [`crate::protocol::trace`].
    pub fn with_aws_trace_header(mut self, header: impl Into<String>) -> Self {
        self.aws_trace_header = Some(header.into());
        self
    }

    /// Sets the name (or URL) of the queue the message was received from:
    /// the spans' destination, and what tells a FIFO queue (its name ends
    /// in `.fifo`) from a standard one (see [`Self::from_fifo_queue`]).
    pub fn with_queue(mut self, name: impl Into<String>) -> Self {
        self.queue = Some(name.into());
        self
    }

    /// The message with `payload` as its body, taken out of the `envelope`
    /// its body was: the body as received stays readable as
    /// [`Self::raw_body`]. `attributes` (the envelope's own) are added
    /// where the message has none of the same name: the queue's own
    /// attributes win (an SNS publisher cannot replace what the queue's
    /// sender set).
    pub(crate) fn opened(
        mut self,
        envelope: Envelope,
        payload: String,
        attributes: impl IntoIterator<Item = (String, Attribute)>,
    ) -> Self {
        self.raw_body = Some(std::mem::replace(&mut self.body, payload));
        self.envelope = Some(envelope);
        for (name, attribute) in attributes {
            self.attributes.entry(name).or_insert(attribute);
        }
        self
    }

    pub(crate) fn set_dedup_key(&mut self, key: String) {
        self.dedup_key = Some(key);
    }

    /// Keeps `key`, read by the config whose identity is `by` (its
    /// `ProcessorConfig::identity`), for the processor that holds it.
    #[cfg(any(test, feature = "poller"))]
    pub(crate) fn set_pre_read_key(&mut self, key: String, by: usize) {
        self.pre_read = Some((key, by));
    }

    /// The key [`set_pre_read_key`](Self::set_pre_read_key) kept, when it
    /// was read by the config whose identity is `by`.
    pub(crate) fn pre_read_key(&self, by: usize) -> Option<&str> {
        let (key, read_by) = self.pre_read.as_ref()?;
        (*read_by == by).then_some(key.as_str())
    }

    /// The SQS message id (stable across redeliveries of one send).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The body: the payload inside the envelope when one is configured
    /// (see [`Envelope`]), else the body as received.
    pub fn body(&self) -> &str {
        &self.body
    }

    /// The body as SQS delivered it: the whole envelope when one was opened,
    /// else the same as [`Self::body`].
    pub fn raw_body(&self) -> &str {
        self.raw_body.as_deref().unwrap_or(&self.body)
    }

    /// The message as it was received: itself, or, when its payload was taken
    /// out of an envelope, a copy with the body as received (and the
    /// envelope's attributes still on it).
    pub(crate) fn as_received(&self) -> std::borrow::Cow<'_, Message> {
        match &self.raw_body {
            None => std::borrow::Cow::Borrowed(self),
            Some(raw) => {
                let mut m = self.clone();
                m.body = raw.clone();
                m.raw_body = None;
                m.envelope = None;
                std::borrow::Cow::Owned(m)
            }
        }
    }

    /// The envelope the payload was taken out of, if one was.
    pub fn envelope(&self) -> Option<Envelope> {
        self.envelope
    }

    /// Parses the body as JSON into `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.body)
    }

    /// Every message attribute by name, with its data type, exactly as received.
    pub fn attributes(&self) -> &BTreeMap<String, Attribute> {
        &self.attributes
    }

    /// The text of one attribute of a `String` or `Number` type (custom types
    /// such as `String.id` included); `None` for an absent or binary one.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        match &self.attributes.get(name)?.value {
            AttributeValue::Text(t) => Some(t),
            AttributeValue::Binary(_) => None,
        }
    }

    /// The message group id: set on a FIFO queue, and on a standard queue
    /// where the sender set one (fair queues), `None` otherwise.
    pub fn group_id(&self) -> Option<&str> {
        self.group_id.as_deref()
    }

    /// Whether the message came from a FIFO queue: by the queue's name
    /// (`.fifo`) where the runtime said which queue it came from, else by
    /// its group id. A standard queue's message with a group id (a fair
    /// queue) is not FIFO: its group keeps no order.
    pub fn from_fifo_queue(&self) -> bool {
        match &self.queue {
            Some(queue) => is_fifo(queue),
            None => self.group_id.is_some(),
        }
    }

    /// The FIFO deduplication id, `None` on a standard queue.
    pub fn deduplication_id(&self) -> Option<&str> {
        self.deduplication_id.as_deref()
    }

    /// Who sent the message, as SQS's `SenderId` names them (an account id,
    /// an IAM user's unique id, or an assumed role's `ROLEID:SESSION`): set
    /// by SQS, not the producer.
    /// `None` where the runtime did not read it.
    pub fn sender_id(&self) -> Option<&str> {
        self.sender_id.as_deref()
    }

    /// How many times SQS has delivered this message, 1 on the first delivery.
    pub fn receive_count(&self) -> u32 {
        self.receive_count
    }

    /// The receipt handle of this delivery (needed to delete or extend it).
    pub fn receipt_handle(&self) -> Option<&str> {
        self.receipt_handle.as_deref()
    }

    /// The `AWSTraceHeader` system attribute: the producer's X-Ray trace
    /// header, as SQS delivered it.
    pub fn aws_trace_header(&self) -> Option<&str> {
        self.aws_trace_header.as_deref()
    }

    /// The name of the queue the message was received from, when the runtime
    /// knows it (the spans' destination).
    pub fn queue(&self) -> Option<&str> {
        self.queue.as_deref()
    }

    /// The dedup key extracted for this message, once the processor has done so.
    pub fn dedup_key(&self) -> Option<&str> {
        self.dedup_key.as_deref()
    }
}

/// Whether a queue URL (or name) is a FIFO queue's.
pub fn is_fifo(queue: &str) -> bool {
    queue.ends_with(".fifo")
}

/// What wraps the payload in the bodies of a queue's messages
/// (`SQS_ONCE_ENVELOPE`): opened before the dedup key is read and before the
/// handler runs, so `json:` keys, the payload hash and [`Message::body`] are
/// the payload's. See [`crate::protocol::envelope`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Envelope {
    /// The body is the payload (also SNS with raw message delivery).
    #[default]
    None,
    /// An SNS notification without raw message delivery: the payload is its
    /// `Message`, and its `MessageAttributes` become message attributes.
    Sns,
    /// An EventBridge event: the payload is its `detail`.
    EventBridge,
    /// An S3 event notification: the payload is its one record
    /// (`Records[0]`); S3's `s3:TestEvent` is deleted without a handler run.
    S3,
}

impl std::fmt::Display for Envelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Envelope::None => "none",
            Envelope::Sns => "sns",
            Envelope::EventBridge => "eventbridge",
            Envelope::S3 => "s3",
        })
    }
}

/// An unknown envelope name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown envelope `{0}`: expected none, sns, eventbridge or s3")]
pub struct EnvelopeParseError(String);

impl std::str::FromStr for Envelope {
    type Err = EnvelopeParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "" => Ok(Envelope::None),
            "sns" => Ok(Envelope::Sns),
            "eventbridge" => Ok(Envelope::EventBridge),
            "s3" => Ok(Envelope::S3),
            _ => Err(EnvelopeParseError(s.to_owned())),
        }
    }
}

/// One SQS message attribute: its data type and value, kept exactly so that a
/// parked copy carries it unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attribute {
    /// `String`, `Number`, `Binary`, or one of those with a custom suffix
    /// (`Number.float`, `String.id`, ...).
    pub data_type: String,
    /// The value.
    pub value: AttributeValue,
}

/// An attribute's value: text for `String` and `Number` types, bytes for `Binary`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttributeValue {
    /// `StringValue` (String and Number types).
    Text(String),
    /// `BinaryValue` (Binary types).
    Binary(Vec<u8>),
}

impl Attribute {
    /// A `String` attribute.
    pub fn string(value: impl Into<String>) -> Self {
        Self {
            data_type: "String".to_owned(),
            value: AttributeValue::Text(value.into()),
        }
    }

    /// An attribute of the given data type; its value is binary when the type
    /// is `Binary` or `Binary.*`, else text.
    pub fn typed(
        data_type: impl Into<String>,
        text: Option<String>,
        binary: Option<Vec<u8>>,
    ) -> Option<Self> {
        let data_type = data_type.into();
        let value = if data_type.starts_with("Binary") {
            AttributeValue::Binary(binary?)
        } else {
            AttributeValue::Text(text?)
        };
        Some(Self { data_type, value })
    }

    /// The bytes SQS counts toward the message size: name, data type and value.
    pub fn size(&self, name: &str) -> usize {
        name.len()
            + self.data_type.len()
            + match &self.value {
                AttributeValue::Text(t) => t.len(),
                AttributeValue::Binary(b) => b.len(),
            }
    }
}
