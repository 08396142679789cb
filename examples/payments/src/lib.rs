//! The external-effect example: charging a card through an HTTPS payment API.
//! Body: `{"id", "customer", "amount_cents"}`. Effect: `POST {base}/charges`
//! with the headers `Idempotency-Key: <ctx.idempotency_key()>` and
//! `Fencing-Token: <ctx.fence()>` (and `traceparent`, so the API's spans join
//! the message's trace). The call is
//! outside DynamoDB, so the handler keeps the default
//! [`Effects::External`](sqs_once::Effects::External): the key is claimed
//! before the call and completed after it with the charge as the result.
//!
//! A crash between the charge and the completion leaves the claim to expire;
//! the redelivery calls again **with the same idempotency key**, and an API
//! that honours it (Stripe and most payment APIs do) answers with the first
//! charge. An API that also keeps the highest `Fencing-Token` per key and
//! refuses a lower one (with 409) refuses the call of an older holder that
//! went on after its lease was lost (a request already sent, a task the
//! interrupt could not reach) once the next holder has called. Answers map
//! to the protocol: 2xx is done; 409, 429, 5xx, a timeout
//! or no answer are retried; any other status (declined, invalid, a
//! redirect) is permanent.

#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

use std::time::Duration;

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

/// The payment handler: an HTTPS-only client (rustls) with a 10 s bound on
/// each call, answer included, that follows no redirect.
#[derive(Debug, Clone)]
pub struct PaymentHandler {
    charges_url: String,
    client: reqwest::Client,
}

/// A set-up error (a URL that is not `https://`, a CA file with no
/// certificate in it).
pub type SetupError = Box<dyn std::error::Error + Send + Sync>;

impl PaymentHandler {
    /// A handler calling `{base_url}/charges`, trusting the system's roots
    /// and the PEM certificates in `extra_roots` (a private CA). On Linux,
    /// `SSL_CERT_FILE` or `SSL_CERT_DIR`, when set, replace the system's roots.
    pub fn new(base_url: &str, extra_roots: Option<&[u8]>) -> Result<Self, SetupError> {
        let url = reqwest::Url::parse(base_url).map_err(|e| format!("{base_url:?}: {e}"))?;
        if url.scheme() != "https" || url.host_str().is_none() {
            return Err(
                format!("{base_url:?}: the payment API is called over https:// only").into(),
            );
        }
        let roots = match extra_roots {
            Some(pem) => reqwest::Certificate::from_pem_bundle(pem)?,
            None => Vec::new(),
        };
        if extra_roots.is_some() && roots.is_empty() {
            return Err("the extra roots hold no PEM certificate".into());
        }
        let client = reqwest::Client::builder()
            .https_only(true)
            // A redirect is the API's answer, not a place to post a charge.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(Duration::from_secs(10))
            .tls_certs_merge(roots)
            .build()?;
        let charges_url = format!("{}/charges", base_url.trim_end_matches('/'));
        Ok(Self {
            charges_url,
            client,
        })
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
        let mut request = self
            .client
            .post(&self.charges_url)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .header(FENCING_TOKEN, ctx.fence())
            .body(body.to_string());
        if let Some(traceparent) = ctx.traceparent() {
            request = request.header("traceparent", traceparent);
        }
        let response = request.send().await.map_err(failed)?;
        let status = response.status().as_u16();
        let answer = read_bounded(response, MAX_ANSWER).await.map_err(failed)?;
        outcome(status, &answer).map(Some)
    }
}

/// The header that carries [`Context::fence`]: an API that keeps the highest
/// one it has seen per `Idempotency-Key` refuses a call with a lower one.
pub const FENCING_TOKEN: &str = "fencing-token";

/// A failed call's outcome: a request that cannot be made is permanent; no
/// connection means nothing was sent; any other failure (no answer, one cut
/// off, a timeout) may have charged. Both are retried with the same key.
fn failed(e: reqwest::Error) -> HandlerError {
    let e = e.without_url();
    let mut why = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        why = format!("{why}: {cause}");
        source = cause.source();
    }
    if e.is_builder() {
        HandlerError::permanent(format!("payment request cannot be made: {why}"))
    } else if e.is_connect() {
        HandlerError::retry(format!("payment API not reached, nothing sent: {why}"))
    } else {
        HandlerError::retry(format!(
            "payment API: {why}; outcome unknown, retried with the same key"
        ))
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
    pub bytes: Vec<u8>,
    /// More followed and was not read.
    pub cut: bool,
}

/// Reads `response`'s body up to `limit` bytes; the rest is not read.
async fn read_bounded(mut response: reqwest::Response, limit: usize) -> reqwest::Result<Answer> {
    let mut bytes = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = limit - bytes.len();
        bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if chunk.len() > room {
            return Ok(Answer { bytes, cut: true });
        }
    }
    Ok(Answer { bytes, cut: false })
}

/// At most [`MAX_QUOTED`] bytes of the answer as text, saying when it is cut.
fn quoted(answer: &Answer) -> String {
    let text = String::from_utf8_lossy(&answer.bytes);
    let mut end = text.len().min(MAX_QUOTED);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end == text.len() && !answer.cut {
        return text.into_owned();
    }
    let over = if answer.cut { "over " } else { "" };
    format!(
        "{}... (cut; {over}{} bytes)",
        &text[..end],
        answer.bytes.len()
    )
}

/// The protocol's answer to the API's `status` and answer: the charge (2xx
/// with JSON), a retry (409, 429, 5xx, an unreadable 2xx) or a permanent
/// failure (any other status: a refusal, a redirect; a 2xx too long to be a charge).
pub fn outcome(status: u16, answer: &Answer) -> Result<serde_json::Value, HandlerError> {
    if (200..300).contains(&status) {
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
    if (300..400).contains(&status) {
        return Err(HandlerError::permanent(format!(
            "payment API answered {status} (a redirect, not followed): {}; check the payment by its idempotency key before sending it again",
            quoted(answer)
        )));
    }
    let why = format!("payment API answered {status}: {}", quoted(answer));
    if status == 409 || status == 429 || status >= 500 {
        Err(HandlerError::retry(why))
    } else {
        Err(HandlerError::permanent(why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_answer_is_quoted_at_most_max_quoted_bytes() {
        let answer = Answer {
            bytes: format!("{{\"error\": \"{}\"}}", "é".repeat(MAX_ANSWER)).into_bytes(),
            cut: true,
        };
        let e = outcome(400, &answer).unwrap_err();
        let text = e.to_string();
        assert!(text.len() < MAX_QUOTED + 200, "{} bytes", text.len());
        assert!(text.contains("(cut; over"), "{text}");
        assert_eq!(e.kind(), sqs_once::FailureKind::Permanent);
    }

    #[test]
    fn a_success_answer_too_long_for_a_charge_is_permanent() {
        let long = Answer {
            bytes: vec![b'x'; MAX_ANSWER],
            cut: true,
        };
        let e = outcome(200, &long).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        let charge = Answer {
            bytes: b"{\"charge_id\":\"ch_1\"}".to_vec(),
            cut: false,
        };
        assert_eq!(
            outcome(200, &charge).unwrap(),
            serde_json::json!({"charge_id": "ch_1"})
        );
    }

    #[test]
    fn busy_and_server_errors_are_retried_other_refusals_are_not() {
        let empty = Answer {
            bytes: Vec::new(),
            cut: false,
        };
        for status in [409, 429, 500, 503] {
            assert_eq!(
                outcome(status, &empty).unwrap_err().kind(),
                sqs_once::FailureKind::Retry,
                "{status}"
            );
        }
        for status in [400, 402, 422] {
            assert_eq!(
                outcome(status, &empty).unwrap_err().kind(),
                sqs_once::FailureKind::Permanent,
                "{status}"
            );
        }
    }

    #[test]
    fn only_https_is_called() {
        let e = PaymentHandler::new("http://payments.example", None).unwrap_err();
        assert!(e.to_string().contains("https:// only"), "{e}");
        assert!(PaymentHandler::new("https://host:443x", None).is_err());
        let e = PaymentHandler::new("https://payments.example", Some(b"not PEM")).unwrap_err();
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
        assert!(PaymentHandler::new("https://payments.example/", None).is_ok());
    }
}
