//! SQS behind its AWS JSON 1.0 protocol (`X-Amz-Target: AmazonSQS.<Op>`),
//! backed by the simulator's [`MemoryQueue`], for the operations the project
//! sends (`ReceiveMessage`, `DeleteMessage`, `DeleteMessageBatch`,
//! `ChangeMessageVisibility`, `ChangeMessageVisibilityBatch`, `SendMessage`,
//! `GetQueueAttributes`, `GetQueueUrl`) and `CreateQueue` for test set-up.
//! Errors carry the JSON protocol's `__type` and the legacy query code in
//! `x-amzn-query-error`, as SQS answers (the SDK reports the legacy code,
//! e.g. `AWS.SimpleQueueService.NonExistentQueue`); a batch entry's failure
//! is a `Failed` entry of a successful answer.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use sqs_once::queue::{OutgoingMessage, QueueClient, QueueError, ReceiveRequest};
use sqs_once::testkit::queue::{QueueSettings, RedrivePolicy, SendOptions};
use sqs_once::{Attribute, AttributeValue, MemoryQueue};

use crate::deliveries::Deliveries;

/// An answer: HTTP status, JSON body, and the legacy error code if an error.
#[derive(Debug, Clone, PartialEq)]
pub struct SqsAnswer {
    /// The HTTP status.
    pub status: u16,
    /// The JSON body.
    pub body: Value,
    /// `x-amzn-query-error`: the legacy code and fault (`Code;Sender`).
    pub query_error: Option<String>,
}

/// The account the model's queues live in.
const ACCOUNT: &str = "000000000000";

/// An SQS error answer from a code (legacy or JSON) and its message.
pub fn error(code: &str, message: &str) -> SqsAnswer {
    let short = code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(code);
    let short = match short {
        "NonExistentQueue" => "QueueDoesNotExist",
        other => other,
    };
    let server = matches!(
        short,
        "InternalError" | "InternalFailure" | "ServiceUnavailable"
    );
    SqsAnswer {
        status: if server { 500 } else { 400 },
        body: json!({ "__type": format!("com.amazonaws.sqs#{short}"), "message": message }),
        query_error: Some(format!(
            "{code};{}",
            if server { "Receiver" } else { "Sender" }
        )),
    }
}

fn from_queue_error(e: &QueueError) -> SqsAnswer {
    let (code, message) = e.detail.split_once(": ").unwrap_or((&e.detail, ""));
    error(code, message)
}

fn ok(body: Value) -> SqsAnswer {
    SqsAnswer {
        status: 200,
        body,
        query_error: None,
    }
}

/// SQS's `InternalFailure` (HTTP 500).
pub fn internal_failure() -> SqsAnswer {
    error(
        "InternalFailure",
        "The request processing has failed because of an unknown error, exception or failure.",
    )
}

/// Throttling as the JSON protocol answers it (HTTP 400): `code` is
/// `ThrottlingException` (the common error) or `RequestThrottled` (SQS's own).
pub fn throttled(code: &str) -> SqsAnswer {
    error(code, "Rate exceeded")
}

/// How many entries a batch request holds (0 for a call of one).
pub fn entries_of(op: &str, request: &Value) -> usize {
    if !op.ends_with("Batch") {
        return 0;
    }
    request
        .get("Entries")
        .and_then(Value::as_array)
        .map_or(0, Vec::len)
}

/// The SQS model. Clones share the queues.
#[derive(Debug, Clone)]
pub struct SqsModel(MemoryQueue, Option<Deliveries>);

fn text<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str)
}

fn secs(v: &Value, k: &str) -> Option<Duration> {
    v.get(k).and_then(Value::as_u64).map(Duration::from_secs)
}

fn missing(what: &str) -> SqsAnswer {
    error(
        "MissingParameter",
        &format!("The request must contain the parameter {what}."),
    )
}

/// The message attributes of a request or a message, in their wire form.
fn attributes_json(attrs: &BTreeMap<String, Attribute>) -> Value {
    let mut out = serde_json::Map::new();
    for (name, a) in attrs {
        let v = match &a.value {
            AttributeValue::Text(t) => json!({ "DataType": a.data_type, "StringValue": t }),
            AttributeValue::Binary(b) => json!({
                "DataType": a.data_type,
                "BinaryValue": aws_smithy_types::base64::encode(b),
            }),
        };
        out.insert(name.clone(), v);
    }
    Value::Object(out)
}

fn attributes_of(v: Option<&Value>) -> Result<BTreeMap<String, Attribute>, SqsAnswer> {
    let Some(m) = v.and_then(Value::as_object) else {
        return Ok(BTreeMap::new());
    };
    let mut out = BTreeMap::new();
    for (name, a) in m {
        let data_type = text(a, "DataType")
            .ok_or_else(|| missing("DataType"))?
            .to_owned();
        let value = match (text(a, "StringValue"), text(a, "BinaryValue")) {
            (Some(s), _) => AttributeValue::Text(s.to_owned()),
            (None, Some(b)) => AttributeValue::Binary(
                aws_smithy_types::base64::decode(b)
                    .map_err(|_| error("InvalidParameterValue", "BinaryValue is not base64"))?,
            ),
            (None, None) => {
                return Err(error(
                    "InvalidParameterValue",
                    "an attribute without a value",
                ));
            }
        };
        out.insert(name.clone(), Attribute { data_type, value });
    }
    Ok(out)
}

fn message_json(m: &sqs_once::Message) -> Value {
    let mut system = json!({
        "ApproximateReceiveCount": m.receive_count().to_string(),
        "SentTimestamp": "0",
        "SenderId": ACCOUNT,
        "ApproximateFirstReceiveTimestamp": "0",
    });
    if let Some(g) = m.group_id() {
        system["MessageGroupId"] = g.into();
    }
    if let Some(d) = m.deduplication_id() {
        system["MessageDeduplicationId"] = d.into();
    }
    if let Some(t) = m.aws_trace_header() {
        system["AWSTraceHeader"] = t.into();
    }
    let mut out = json!({
        "MessageId": m.id(),
        "ReceiptHandle": m.receipt_handle(),
        "Body": m.body(),
        "MD5OfBody": "",
        "Attributes": system,
    });
    if !m.attributes().is_empty() {
        out["MessageAttributes"] = attributes_json(m.attributes());
    }
    out
}

/// A batch's entries: (id, receipt handle, the entry).
fn entries(request: &Value) -> Result<Vec<(String, String, Value)>, SqsAnswer> {
    let Some(list) = request.get("Entries").and_then(Value::as_array) else {
        return Err(missing("Entries"));
    };
    let mut out = Vec::with_capacity(list.len());
    for e in list {
        let id = text(e, "Id").ok_or_else(|| missing("Id"))?.to_owned();
        if out.iter().any(|(seen, _, _)| *seen == id) {
            return Err(error(
                "AWS.SimpleQueueService.BatchEntryIdsNotDistinct",
                &format!("Id {id} repeated."),
            ));
        }
        let receipt = text(e, "ReceiptHandle")
            .ok_or_else(|| missing("ReceiptHandle"))?
            .to_owned();
        out.push((id, receipt, e.clone()));
    }
    Ok(out)
}

/// A batch answer: the entries that succeeded and those that failed alone.
fn batch_answer(ids: &[String], failed: &[sqs_once::queue::EntryFailure]) -> SqsAnswer {
    let mut ok_ids = Vec::new();
    let mut bad = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        match failed.iter().find(|f| f.index == i) {
            Some(f) => bad.push(json!({
                "Id": id,
                "Code": f.code,
                "Message": f.message.clone().unwrap_or_default(),
                "SenderFault": !f.code.contains("Internal"),
            })),
            None => ok_ids.push(json!({ "Id": id })),
        }
    }
    ok(json!({ "Successful": ok_ids, "Failed": bad }))
}

impl SqsModel {
    /// A model over `queue`.
    pub fn new(queue: MemoryQueue) -> Self {
        Self(queue, None)
    }

    /// Notes in `deliveries` what it applies, when it applies it: the
    /// receipt handles a receive issues, the deletes and visibility changes
    /// (their answers may still be lost, or come late).
    pub fn watched(mut self, deliveries: Deliveries) -> Self {
        self.1 = Some(deliveries);
        self
    }

    /// The queues.
    pub fn queue(&self) -> &MemoryQueue {
        &self.0
    }

    /// Answers one request (`op`: `ReceiveMessage`, ...); a receive waits
    /// as its long poll does.
    pub async fn handle(&self, op: &str, request: &Value) -> SqsAnswer {
        if op == "GetQueueUrl" {
            let name = text(request, "QueueName").unwrap_or_default();
            let account = text(request, "QueueOwnerAWSAccountId").unwrap_or(ACCOUNT);
            return match self.0.queue_url(name, account).await {
                Ok(url) => ok(json!({ "QueueUrl": url })),
                Err(e) => from_queue_error(&e),
            };
        }
        if op == "CreateQueue" {
            return self.create(request).await;
        }
        let Some(url) = text(request, "QueueUrl") else {
            return missing("QueueUrl");
        };
        let out = match op {
            "ReceiveMessage" => self.receive(url, request).await,
            "DeleteMessage" => self.delete(url, request).await,
            "ChangeMessageVisibility" => self.change_visibility(url, request).await,
            "DeleteMessageBatch" | "ChangeMessageVisibilityBatch" => {
                self.batch(op, url, request).await
            }
            "SendMessage" => self.send(url, request).await,
            "SendMessageBatch" => self.send_batch(url, request).await,
            "GetQueueAttributes" => self.attributes(url).await,
            other => Err(error(
                "InvalidAction",
                &format!("The action {other} is not valid for this endpoint."),
            )),
        };
        out.unwrap_or_else(|e| e)
    }

    /// Answers a batch request whose entries at `failing` fail alone
    /// (`InternalError`, not the sender's fault, not applied) while the
    /// call succeeds: the others are applied as [`SqsModel::handle`] does.
    pub async fn handle_failing(&self, op: &str, request: &Value, failing: &[usize]) -> SqsAnswer {
        let Some(list) = request.get("Entries").and_then(Value::as_array) else {
            return self.handle(op, request).await;
        };
        let (mut kept, mut failed) = (Vec::new(), Vec::new());
        for (i, e) in list.iter().enumerate() {
            if failing.contains(&i) {
                failed.push(json!({
                    "Id": e.get("Id").cloned().unwrap_or_default(),
                    "Code": "InternalError",
                    "Message": "The entry failed (try it again).",
                    "SenderFault": false,
                }));
            } else {
                kept.push(e.clone());
            }
        }
        let mut answer = if kept.is_empty() {
            ok(json!({ "Successful": [], "Failed": [] }))
        } else {
            let mut rest = request.clone();
            rest["Entries"] = Value::Array(kept);
            self.handle(op, &rest).await
        };
        if answer.status != 200 {
            return answer;
        }
        match answer.body.get_mut("Failed").and_then(Value::as_array_mut) {
            Some(all) => all.extend(failed),
            None => answer.body["Failed"] = Value::Array(failed),
        }
        answer
    }

    async fn receive(&self, url: &str, request: &Value) -> Result<SqsAnswer, SqsAnswer> {
        let max = request
            .get("MaxNumberOfMessages")
            .and_then(Value::as_u64)
            .unwrap_or(1);
        if !(1..=10).contains(&max) {
            return Err(error(
                "InvalidParameterValue",
                "MaxNumberOfMessages must be between 1 and 10.",
            ));
        }
        let visibility = match secs(request, "VisibilityTimeout") {
            Some(v) => v,
            None => self
                .0
                .attributes(url)
                .await
                .map_err(|e| from_queue_error(&e))?
                .visibility_timeout
                .unwrap_or(Duration::from_secs(30)),
        };
        let req = ReceiveRequest {
            max: usize::try_from(max).unwrap_or(10),
            wait: secs(request, "WaitTimeSeconds").unwrap_or(Duration::ZERO),
            visibility,
        };
        let got = self
            .0
            .receive(url, req)
            .await
            .map_err(|e| from_queue_error(&e))?;
        if let Some(watch) = &self.1 {
            let receipts: Vec<String> = got
                .iter()
                .filter_map(|m| m.receipt_handle().map(str::to_owned))
                .collect();
            watch.issued(&receipts);
            watch.taken(url, &got, visibility);
        }
        Ok(ok(
            json!({ "Messages": got.iter().map(message_json).collect::<Vec<_>>() }),
        ))
    }

    async fn delete(&self, url: &str, request: &Value) -> Result<SqsAnswer, SqsAnswer> {
        let receipt = text(request, "ReceiptHandle").ok_or_else(|| missing("ReceiptHandle"))?;
        self.0
            .delete(url, receipt)
            .await
            .map_err(|e| from_queue_error(&e))?;
        if let Some(watch) = &self.1 {
            watch.delete_reached(url, &[receipt.to_owned()]);
        }
        Ok(ok(json!({})))
    }

    async fn change_visibility(&self, url: &str, request: &Value) -> Result<SqsAnswer, SqsAnswer> {
        let receipt = text(request, "ReceiptHandle").ok_or_else(|| missing("ReceiptHandle"))?;
        let timeout =
            secs(request, "VisibilityTimeout").ok_or_else(|| missing("VisibilityTimeout"))?;
        self.0
            .change_visibility(url, receipt, timeout)
            .await
            .map_err(|e| from_queue_error(&e))?;
        if let Some(watch) = &self.1 {
            watch.visibility_set(&[receipt.to_owned()], timeout);
        }
        Ok(ok(json!({})))
    }

    async fn batch(&self, op: &str, url: &str, request: &Value) -> Result<SqsAnswer, SqsAnswer> {
        let entries = entries(request)?;
        let ids: Vec<String> = entries.iter().map(|(id, _, _)| id.clone()).collect();
        let receipts: Vec<String> = entries.iter().map(|(_, r, _)| r.clone()).collect();
        // One timeout for the batch, as the project sends it.
        let timeout = entries
            .first()
            .and_then(|(_, _, e)| secs(e, "VisibilityTimeout"))
            .unwrap_or(Duration::ZERO);
        let delete = op == "DeleteMessageBatch";
        let failed = if delete {
            self.0.delete_batch(url, &receipts).await
        } else {
            self.0
                .change_visibility_batch(url, &receipts, timeout)
                .await
        }
        .map_err(|e| from_queue_error(&e))?;
        if let Some(watch) = &self.1 {
            let applied: Vec<String> = receipts
                .iter()
                .enumerate()
                .filter(|(i, _)| !failed.iter().any(|f| f.index == *i))
                .map(|(_, r)| r.clone())
                .collect();
            if delete {
                watch.delete_reached(url, &applied);
            } else {
                watch.visibility_set(&applied, timeout);
            }
        }
        Ok(batch_answer(&ids, &failed))
    }

    async fn send(&self, url: &str, request: &Value) -> Result<SqsAnswer, SqsAnswer> {
        let body = text(request, "MessageBody").ok_or_else(|| missing("MessageBody"))?;
        let message = OutgoingMessage {
            body: body.to_owned(),
            attributes: attributes_of(request.get("MessageAttributes"))?,
            group_id: text(request, "MessageGroupId").map(str::to_owned),
            deduplication_id: text(request, "MessageDeduplicationId").map(str::to_owned),
            // The delay is a send option of the model; the trace header is
            // not modelled.
            ..OutgoingMessage::default()
        };
        let options = SendOptions {
            delay: secs(request, "DelaySeconds"),
        };
        let sent = self
            .0
            .send_with(url, message, options)
            .map_err(|e| from_queue_error(&e))?;
        Ok(ok(
            json!({ "MessageId": sent.message_id, "MD5OfMessageBody": "" }),
        ))
    }

    async fn send_batch(&self, url: &str, request: &Value) -> Result<SqsAnswer, SqsAnswer> {
        let Some(list) = request.get("Entries").and_then(Value::as_array) else {
            return Err(missing("Entries"));
        };
        let mut ids: Vec<String> = Vec::with_capacity(list.len());
        let mut messages = Vec::with_capacity(list.len());
        for e in list {
            let id = text(e, "Id").ok_or_else(|| missing("Id"))?.to_owned();
            if ids.contains(&id) {
                return Err(error(
                    "AWS.SimpleQueueService.BatchEntryIdsNotDistinct",
                    &format!("Id {id} repeated."),
                ));
            }
            let body = text(e, "MessageBody").ok_or_else(|| missing("MessageBody"))?;
            messages.push(OutgoingMessage {
                body: body.to_owned(),
                attributes: attributes_of(e.get("MessageAttributes"))?,
                group_id: text(e, "MessageGroupId").map(str::to_owned),
                deduplication_id: text(e, "MessageDeduplicationId").map(str::to_owned),
                delay: secs(e, "DelaySeconds"),
                ..OutgoingMessage::default()
            });
            ids.push(id);
        }
        let failed = self
            .0
            .send_batch(url, messages)
            .await
            .map_err(|e| from_queue_error(&e))?;
        // A sent entry's answer names its message (the SDK requires the
        // id and body digest; the adapter reads neither).
        let mut answer = batch_answer(&ids, &failed);
        if let Some(ok) = answer
            .body
            .get_mut("Successful")
            .and_then(Value::as_array_mut)
        {
            for entry in ok {
                entry["MessageId"] = format!("sent-{}", entry["Id"].as_str().unwrap_or("")).into();
                entry["MD5OfMessageBody"] = "".into();
            }
        }
        Ok(answer)
    }

    async fn attributes(&self, url: &str) -> Result<SqsAnswer, SqsAnswer> {
        let a = self
            .0
            .attributes(url)
            .await
            .map_err(|e| from_queue_error(&e))?;
        let name = url.rsplit('/').next().unwrap_or_default();
        let mut attrs = json!({ "QueueArn": format!("arn:aws:sqs:us-east-1:{ACCOUNT}:{name}") });
        if let Some(v) = a.visibility_timeout {
            attrs["VisibilityTimeout"] = v.as_secs().to_string().into();
        }
        if let Some(r) = a.retention {
            attrs["MessageRetentionPeriod"] = r.as_secs().to_string().into();
        }
        if let Some(m) = a.max_message_bytes {
            attrs["MaximumMessageSize"] = m.to_string().into();
        }
        if let Some(arn) = a.dead_letter_target_arn {
            let max = a.max_receive_count.unwrap_or_default();
            attrs["RedrivePolicy"] = json!({ "deadLetterTargetArn": arn, "maxReceiveCount": max })
                .to_string()
                .into();
        }
        Ok(ok(json!({ "Attributes": attrs })))
    }

    async fn create(&self, request: &Value) -> SqsAnswer {
        let Some(name) = text(request, "QueueName") else {
            return missing("QueueName");
        };
        let attr = |k: &str| request.get("Attributes").and_then(|a| text(a, k));
        let mut settings = QueueSettings::new(name);
        let num = |k: &str| attr(k).and_then(|v| v.parse::<u64>().ok());
        if let Some(v) = num("VisibilityTimeout") {
            settings.visibility_timeout = Duration::from_secs(v);
        }
        if let Some(v) = num("MaximumMessageSize") {
            settings.max_message_bytes = usize::try_from(v).unwrap_or(usize::MAX);
        }
        settings.content_based_deduplication = attr("ContentBasedDeduplication") == Some("true");
        if let Some(policy) = attr("RedrivePolicy") {
            let policy: Value = serde_json::from_str(policy).unwrap_or_default();
            let arn = text(&policy, "deadLetterTargetArn").unwrap_or_default();
            let max = policy.get("maxReceiveCount").and_then(|m| {
                m.as_u64()
                    .or_else(|| m.as_str().and_then(|s| s.parse().ok()))
            });
            let dlq = arn.rsplit(':').next().unwrap_or_default();
            let (Some(max), Ok(dlq_url)) = (max, self.0.queue_url(dlq, ACCOUNT).await) else {
                return error(
                    "InvalidAttributeValue",
                    "Value for parameter RedrivePolicy is invalid.",
                );
            };
            settings.redrive = Some(RedrivePolicy {
                dlq_url,
                max_receive_count: u32::try_from(max).unwrap_or(u32::MAX),
            });
        }
        match self.0.create_queue(settings) {
            Ok(url) => ok(json!({ "QueueUrl": url })),
            Err(e) => from_queue_error(&e),
        }
    }
}
