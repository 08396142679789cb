//! The external-effect example: charging a card through an HTTP payment API.
//! The `payments` binary (`src/main.rs`) runs [`PaymentHandler`] as a
//! long-polling consumer or as a Lambda function.
//!
//! Body: `{"id": "<payment id>", "customer": "<customer>", "amount_cents": <i64>}`.
//! Effect: `POST {base}/charges` with `{"customer", "amount_cents"}` and the
//! header `Idempotency-Key: <ctx.idempotency_key()>` (and `traceparent:
//! <ctx.traceparent()>`, so the API's spans join the message's trace). The call is outside
//! DynamoDB, so the handler keeps the default
//! [`Effects::External`](sqs_once::Effects::External): the key is claimed before the
//! call, so at most one attempt runs at a time, and completed after it with the
//! charge id as the result.
//!
//! A crash after the API charged and before the completion leaves the claim to
//! expire; the redelivery calls again **with the same idempotency key**, and an
//! API that honours the key (Stripe and most payment APIs do) answers with the
//! first charge instead of making a second one. Errors map to the protocol:
//! 2xx is done, 409 (the same key is being processed) / 429 / 5xx / no answer
//! are retried, any other 4xx (card declined, invalid request) is permanent.
//!
//! [`PaymentHandler::with_pause_after_call`] is fault injection for the tests.

#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use sqs_once::{Context, Handler, HandlerError, HandlerResult, Message};

/// One payment request.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PaymentEvent {
    /// The business id (the dedup key).
    pub id: String,
    /// Who pays.
    pub customer: String,
    /// How much, in cents (positive).
    pub amount_cents: i64,
}

/// The payment handler.
#[derive(Debug, Clone)]
pub struct PaymentHandler {
    charges_url: String,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    pause_after_call: Duration,
}

impl PaymentHandler {
    /// A handler calling `{base_url}/charges` (plain HTTP; put a TLS-terminating
    /// proxy or a TLS connector in front for a real API).
    pub fn new(base_url: &str) -> Self {
        Self {
            charges_url: format!("{}/charges", base_url.trim_end_matches('/')),
            client: Client::builder(TokioExecutor::new()).build_http(),
            timeout: Duration::from_secs(10),
            pause_after_call: Duration::ZERO,
        }
    }

    /// Waits this long after the API answered and before returning: a window in
    /// which to crash the consumer between the charge and its completion.
    pub fn with_pause_after_call(mut self, pause: Duration) -> Self {
        self.pause_after_call = pause;
        self
    }
}

impl Handler for PaymentHandler {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        let event: PaymentEvent = message
            .json()
            .map_err(|e| HandlerError::permanent(format!("not a payment: {e}")))?;
        if event.amount_cents <= 0 {
            return Err(HandlerError::permanent(
                "not a payment: amount must be positive",
            ));
        }
        let key = ctx
            .idempotency_key()
            .ok_or_else(|| HandlerError::permanent("payments need a dedup key"))?;
        let body =
            serde_json::json!({"customer": event.customer, "amount_cents": event.amount_cents});
        let mut request = hyper::Request::post(&self.charges_url)
            .header("content-type", "application/json")
            .header("idempotency-key", key);
        // The message's trace goes on with the call (when spans are exported).
        if let Some(traceparent) = ctx.traceparent() {
            request = request.header("traceparent", traceparent);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(HandlerError::permanent)?;
        let response = tokio::time::timeout(self.timeout, self.client.request(request))
            .await
            .map_err(|_| {
                HandlerError::retry(
                    "payment API timed out; outcome unknown, retried with the same key",
                )
            })?
            .map_err(|e| HandlerError::retry(format!("payment API unreachable: {e}")))?;
        let status = response.status();
        let body =
            tokio::time::timeout(self.timeout, read_bounded(response.into_body(), MAX_ANSWER))
                .await
                .map_err(|_| {
                    HandlerError::retry(
                        "payment API answer timed out; outcome unknown, retried with the same key",
                    )
                })?
                .map_err(|e| HandlerError::retry(format!("payment API answer cut off: {e}")))?;
        let charge = outcome(status, &body)?;
        if !self.pause_after_call.is_zero() {
            tokio::time::sleep(self.pause_after_call).await;
        }
        Ok(Some(charge))
    }
}

/// The most of the API's answer that is read: a charge is small; anything
/// longer is cut here, so it cannot fill the logs, the record or the DLQ.
pub const MAX_ANSWER: usize = 64 * 1024;
/// The most of the answer quoted in an error (a log line, the record, the DLQ reason).
pub const MAX_QUOTED: usize = 512;

/// An answer read up to a bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The first bytes (at most the bound).
    pub bytes: Bytes,
    /// More followed and was not read.
    pub cut: bool,
}

/// Reads `body` up to `limit` bytes; the rest is not read.
pub async fn read_bounded<B>(mut body: B, limit: usize) -> Result<Answer, B::Error>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        let room = limit - out.len();
        if data.len() > room {
            out.extend_from_slice(&data[..room]);
            return Ok(Answer {
                bytes: Bytes::from(out),
                cut: true,
            });
        }
        out.extend_from_slice(&data);
    }
    Ok(Answer {
        bytes: Bytes::from(out),
        cut: false,
    })
}

/// At most [`MAX_QUOTED`] bytes of the answer as text, saying when it is cut.
fn quoted(answer: &Answer) -> String {
    let text = String::from_utf8_lossy(&answer.bytes);
    let mut end = text.len().min(MAX_QUOTED);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end < text.len() || answer.cut {
        let size = if answer.cut {
            format!("over {} bytes", answer.bytes.len())
        } else {
            format!("{} bytes", answer.bytes.len())
        };
        format!("{}... (cut; {size})", &text[..end])
    } else {
        text.into_owned()
    }
}

/// The protocol's answer to the API's: the charge (2xx with JSON), a retry
/// (409, 429, 5xx, an unreadable 2xx) or a permanent failure (any other 4xx, a
/// 2xx too long to be a charge).
pub fn outcome(
    status: hyper::StatusCode,
    answer: &Answer,
) -> Result<serde_json::Value, HandlerError> {
    if status.is_success() {
        if answer.cut {
            return Err(HandlerError::permanent(format!(
                "payment API answered {status} with more than {MAX_ANSWER} bytes, not a charge: {}; check the payment by its idempotency key before sending it again",
                quoted(answer)
            )));
        }
        return serde_json::from_slice(&answer.bytes).map_err(|e| {
            HandlerError::retry(format!(
                "payment API answered {status} with {}: {e}",
                quoted(answer)
            ))
        });
    }
    let why = format!("payment API answered {status}: {}", quoted(answer));
    if status.as_u16() == 409 || status.as_u16() == 429 || status.is_server_error() {
        Err(HandlerError::retry(why))
    } else {
        Err(HandlerError::permanent(why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn read_bounded_stops_at_the_limit() {
        let long = read_bounded(Full::new(Bytes::from(vec![b'x'; 100])), 10)
            .await
            .unwrap();
        assert_eq!((long.bytes.len(), long.cut), (10, true));
        let short = read_bounded(Full::new(Bytes::from_static(b"{}")), 10)
            .await
            .unwrap();
        assert_eq!((short.bytes.as_ref(), short.cut), (&b"{}"[..], false));
    }

    #[test]
    fn an_error_answer_is_quoted_at_most_max_quoted_bytes() {
        let answer = Answer {
            bytes: Bytes::from(format!("{{\"error\": \"{}\"}}", "é".repeat(MAX_ANSWER))),
            cut: true,
        };
        let e = outcome(hyper::StatusCode::BAD_REQUEST, &answer).unwrap_err();
        let text = e.to_string();
        assert!(text.len() < MAX_QUOTED + 200, "{} bytes", text.len());
        assert!(text.contains("(cut; over"), "{text}");
    }

    #[test]
    fn a_success_answer_too_long_for_a_charge_is_permanent() {
        let answer = Answer {
            bytes: Bytes::from(vec![b'x'; MAX_ANSWER]),
            cut: true,
        };
        let e = outcome(hyper::StatusCode::OK, &answer).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        let charge = Answer {
            bytes: Bytes::from_static(b"{\"charge_id\":\"ch_1\"}"),
            cut: false,
        };
        assert_eq!(
            outcome(hyper::StatusCode::OK, &charge).unwrap(),
            serde_json::json!({"charge_id": "ch_1"})
        );
    }
}
