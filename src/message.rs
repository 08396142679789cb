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
    attributes: BTreeMap<String, String>,
    group_id: Option<String>,
    deduplication_id: Option<String>,
    receive_count: u32,
    receipt_handle: Option<String>,
    dedup_key: Option<String>,
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
            receive_count: 1,
            receipt_handle: None,
            dedup_key: None,
        }
    }

    /// Adds a string message attribute (SQS `MessageAttributes`).
    pub fn with_attribute(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.attributes.insert(name.into(), value.into());
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

    pub(crate) fn set_dedup_key(&mut self, key: String) {
        self.dedup_key = Some(key);
    }

    /// The SQS message id (stable across redeliveries of one send).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The raw body.
    pub fn body(&self) -> &str {
        &self.body
    }

    /// Parses the body as JSON into `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(&self.body)
    }

    /// String message attributes by name.
    pub fn attributes(&self) -> &BTreeMap<String, String> {
        &self.attributes
    }

    /// One string message attribute.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }

    /// The FIFO message group id, `None` on a standard queue.
    pub fn group_id(&self) -> Option<&str> {
        self.group_id.as_deref()
    }

    /// The FIFO deduplication id, `None` on a standard queue.
    pub fn deduplication_id(&self) -> Option<&str> {
        self.deduplication_id.as_deref()
    }

    /// How many times SQS has delivered this message, 1 on the first delivery.
    pub fn receive_count(&self) -> u32 {
        self.receive_count
    }

    /// The receipt handle of this delivery (needed to delete or extend it).
    pub fn receipt_handle(&self) -> Option<&str> {
        self.receipt_handle.as_deref()
    }

    /// The dedup key extracted for this message, once the processor has done so.
    pub fn dedup_key(&self) -> Option<&str> {
        self.dedup_key.as_deref()
    }
}
