//! Opening the envelopes that AWS services wrap a payload in before it
//! reaches a queue: SNS notifications (without raw message delivery),
//! EventBridge events and S3 event notifications.
//!
//! | envelope | the body | the payload |
//! |---|---|---|
//! | `sns` | `{"Type": "Notification", "MessageId", "TopicArn", "Message", "MessageAttributes": {NAME: {"Type", "Value"}}, ...}` | `Message` (text); each String, Number and String.Array attribute becomes a message attribute |
//! | `eventbridge` | `{"id", "source", "detail-type", "detail", ...}` | `detail` (its JSON text) |
//! | `s3` | `{"Records": [{"eventName", "s3": {...}, ...}]}` | the one record (its JSON text) |
//!
//! SNS with raw message delivery needs no envelope: the body is the
//! message and its attributes are SQS attributes. A body that is not the
//! configured envelope is a permanent failure naming it (parked). S3 sends
//! `{"Service": "Amazon S3", "Event": "s3:TestEvent", ...}` when a
//! notification is set up: it is deleted without a handler run and without
//! a record ([`Opened::S3TestEvent`]).
//!
//! The attributes sqs-once seals ([`crate::protocol::key::SEALED_ATTRIBUTES`])
//! are never taken from an SNS message: only the queue's own count.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::Message;
use crate::protocol::message::{Attribute, Envelope};

/// A message with its envelope opened.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(
    clippy::large_enum_variant,
    reason = "made once per message and taken apart at once"
)]
pub enum Opened {
    /// The message as the handler sees it: the payload as its body.
    Payload(Message),
    /// S3's test event: nothing to do.
    S3TestEvent,
}

/// A body that is not the envelope configured: a permanent failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the body is not an {envelope} envelope (SQS_ONCE_ENVELOPE={envelope}): {problem}")]
pub struct EnvelopeError {
    /// The envelope configured.
    pub envelope: Envelope,
    /// What is wrong with the body.
    pub problem: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SnsNotification {
    #[serde(rename = "Type")]
    kind: String,
    message_id: String,
    message: String,
    #[serde(default)]
    message_attributes: BTreeMap<String, SnsAttribute>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SnsAttribute {
    #[serde(rename = "Type")]
    kind: String,
    value: String,
}

#[derive(Deserialize)]
struct EventBridgeEvent<'a> {
    #[allow(dead_code)]
    id: String,
    #[allow(dead_code)]
    source: String,
    #[serde(rename = "detail-type")]
    #[allow(dead_code)]
    detail_type: String,
    #[serde(borrow)]
    detail: &'a RawValue,
}

#[derive(Deserialize)]
struct S3Notification<'a> {
    #[serde(rename = "Records", borrow)]
    records: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
struct S3Record {
    #[serde(rename = "eventName")]
    #[allow(dead_code)]
    event_name: String,
    #[allow(dead_code)]
    s3: serde_json::Map<String, serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct S3TestEvent {
    service: String,
    event: String,
}

impl Envelope {
    /// `message` with its payload taken out of this envelope. A message
    /// already opened, or no envelope, is returned as it is.
    pub fn open(self, message: Message) -> Result<Opened, EnvelopeError> {
        if message.envelope().is_some() {
            return Ok(Opened::Payload(message));
        }
        let bad = |problem: String| EnvelopeError {
            envelope: self,
            problem,
        };
        match self {
            Envelope::None => Ok(Opened::Payload(message)),
            Envelope::Sns => {
                let n: SnsNotification = serde_json::from_str(message.body()).map_err(|e| {
                    bad(format!(
                        "{e} (expected an SNS notification's JSON: Type, MessageId, Message)"
                    ))
                })?;
                if n.kind != "Notification" {
                    return Err(bad(format!(
                        "its Type is {:?}, not \"Notification\"",
                        n.kind
                    )));
                }
                if n.message_id.is_empty() {
                    return Err(bad("its MessageId is empty".to_owned()));
                }
                let attributes = sns_attributes(n.message_attributes);
                Ok(Opened::Payload(message.opened(self, n.message, attributes)))
            }
            Envelope::EventBridge => {
                let e: EventBridgeEvent<'_> = serde_json::from_str(message.body())
                    .map_err(|e| bad(format!("{e} (expected an EventBridge event's JSON: id, source, detail-type, detail)")))?;
                let detail = e.detail.get().to_owned();
                Ok(Opened::Payload(message.opened(self, detail, [])))
            }
            Envelope::S3 => open_s3(message).map_err(bad),
        }
    }
}

/// An S3 notification's one record, or its test event.
fn open_s3(message: Message) -> Result<Opened, String> {
    if let Ok(test) = serde_json::from_str::<S3TestEvent>(message.body())
        && test.service == "Amazon S3"
        && test.event == "s3:TestEvent"
    {
        tracing::info!(
            message_id = message.id(),
            "S3 test event (s3:TestEvent): deleted, no handler run"
        );
        return Ok(Opened::S3TestEvent);
    }
    let n: S3Notification<'_> = serde_json::from_str(message.body()).map_err(|e| {
        format!("{e} (expected an S3 event notification's JSON: {{\"Records\": [...]}})")
    })?;
    let [record] = n.records.as_slice() else {
        return Err(format!(
            "it holds {} records, expected exactly one",
            n.records.len()
        ));
    };
    serde_json::from_str::<S3Record>(record.get())
        .map_err(|e| format!("its record is not an S3 event record: {e}"))?;
    let record = record.get().to_owned();
    Ok(Opened::Payload(message.opened(Envelope::S3, record, [])))
}

/// An SNS message's attributes as message attributes: String, Number and
/// String.Array ones (Binary ones, base64 in the envelope, are left out),
/// never one of the names sqs-once seals.
fn sns_attributes(
    attributes: BTreeMap<String, SnsAttribute>,
) -> impl Iterator<Item = (String, Attribute)> {
    attributes.into_iter().filter_map(|(name, a)| {
        if crate::protocol::key::SEALED_ATTRIBUTES.contains(&name.as_str())
            || a.kind.starts_with("Binary")
        {
            return None;
        }
        let attribute = Attribute::typed(a.kind, Some(a.value), None)?;
        Some((name, attribute))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeySource;
    use crate::protocol::config::ProcessorConfig;

    fn fixture(name: &str) -> String {
        let path = format!(
            "{}/tests/fixtures/envelopes/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn payload(envelope: Envelope, body: &str) -> Message {
        match envelope.open(Message::new("m-1", body).with_attribute("outer", "q")) {
            Ok(Opened::Payload(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_sns_notification_gives_its_message_and_its_attributes() {
        let body = fixture("sns-notification.json");
        let m = payload(Envelope::Sns, &body);
        assert_eq!(m.body(), "Hello world!");
        assert_eq!(m.raw_body(), body);
        assert_eq!(m.envelope(), Some(Envelope::Sns));

        let body = fixture("sns-notification-order.json");
        let m = payload(Envelope::Sns, &body);
        assert_eq!(m.body(), r#"{"orderId":"o-1001","amount":42}"#);
        assert_eq!(m.attribute("tenant"), Some("acme"));
        assert_eq!(m.attribute("priority"), Some("3"));
        assert_eq!(m.attributes()["priority"].data_type, "Number");
        assert_eq!(m.attributes().get("blob"), None, "binary ones are left out");
        assert_eq!(m.attribute("outer"), Some("q"), "the queue's own are kept");
        let key: KeySource = "attribute:tenant,json:/orderId".parse().unwrap();
        assert_eq!(key.extract(&m).unwrap(), "4:acme|6:o-1001");
    }

    #[test]
    fn an_sns_message_cannot_set_the_attributes_sqs_once_seals() {
        let mut n: serde_json::Value =
            serde_json::from_str(&fixture("sns-notification-order.json")).unwrap();
        n["MessageAttributes"][crate::protocol::key::DEDUP_KEY_ATTRIBUTE] =
            serde_json::json!({"Type": "String", "Value": "forged"});
        let m = payload(Envelope::Sns, &n.to_string());
        assert_eq!(m.attribute(crate::protocol::key::DEDUP_KEY_ATTRIBUTE), None);
    }

    #[test]
    fn an_eventbridge_event_gives_its_detail() {
        let m = payload(Envelope::EventBridge, &fixture("eventbridge-event.json"));
        let detail: serde_json::Value = m.json().unwrap();
        assert_eq!(detail["state"], "terminated");
        let key: KeySource = "json:/instance-id".parse().unwrap();
        assert_eq!(key.extract(&m).unwrap(), "i-1234567890abcdef0");
    }

    #[test]
    fn an_s3_notification_gives_its_record_and_its_test_event_nothing() {
        let m = payload(Envelope::S3, &fixture("s3-event.json"));
        let key: KeySource = "json:/s3/object/key,json:/s3/object/sequencer"
            .parse()
            .unwrap();
        assert_eq!(
            key.extract(&m).unwrap(),
            "16:Happy%20Face.jpg|15:Happy Sequencer"
        );
        let test = Message::new("t", fixture("s3-test-event.json"));
        assert_eq!(Envelope::S3.open(test), Ok(Opened::S3TestEvent));
    }

    #[test]
    fn a_body_that_is_not_the_envelope_is_named_as_such() {
        let cases = [
            (Envelope::Sns, "not json", "expected an SNS notification"),
            (Envelope::Sns, r#"{"orderId":"o-1"}"#, "MessageId"),
            (
                Envelope::Sns,
                r#"{"Type":"SubscriptionConfirmation","MessageId":"x","Message":"m"}"#,
                "not \"Notification\"",
            ),
            (Envelope::EventBridge, r#"{"orderId":"o-1"}"#, "EventBridge"),
            (
                Envelope::S3,
                r#"{"orderId":"o-1"}"#,
                "S3 event notification",
            ),
            (Envelope::S3, r#"{"Records":[]}"#, "0 records"),
            (
                Envelope::S3,
                r#"{"Records":[{"x":1}]}"#,
                "not an S3 event record",
            ),
        ];
        for (envelope, body, says) in cases {
            let err = envelope.open(Message::new("m", body)).unwrap_err();
            assert_eq!(err.envelope, envelope);
            let text = err.to_string();
            assert!(
                text.contains(says) && text.contains(&format!("SQS_ONCE_ENVELOPE={envelope}")),
                "{text}"
            );
        }
    }

    #[test]
    fn the_config_reads_keys_and_payload_hashes_inside_the_envelope() {
        let mut c = ProcessorConfig::new("c");
        c.key_source = "json:/orderId".parse().unwrap();
        c.envelope = Envelope::Sns;
        let first = fixture("sns-notification-order.json");
        let second = first.replace("63a3f6b6-d533", "0000aaaa-1111");
        assert_ne!(first, second);
        let (a, b) = (Message::new("a", first), Message::new("b", second));
        assert_eq!(c.dedup_key(&a).unwrap(), "o-1001");
        assert_eq!(c.payload_sha256(&a), c.payload_sha256(&b));
        let bad = c.dedup_key(&Message::new("x", "{}")).unwrap_err();
        assert!(bad.to_string().contains("not an sns envelope"), "{bad}");
        assert_eq!(
            ["none", "sns", "eventbridge", "s3"]
                .map(|s| s.parse::<Envelope>().unwrap().to_string()),
            ["none", "sns", "eventbridge", "s3"]
        );
        assert!("sqs".parse::<Envelope>().is_err());
    }
}
