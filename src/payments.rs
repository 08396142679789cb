//! The external-effect example: charging a card through an HTTP payment API.
//!
//! Body: `{"id": "<payment id>", "customer": "<customer>", "amount_cents": <i64>}`.
//! Effect: `POST {base}/charges` with `{"customer", "amount_cents"}` and the
//! header `Idempotency-Key: <ctx.idempotency_key()>`. The call is outside
//! DynamoDB, so the handler keeps the default
//! [`Effects::External`](crate::Effects::External): the key is claimed before the
//! call, so at most one attempt runs at a time, and completed after it with the
//! charge id as the result.
//!
//! A crash after the API charged and before the completion leaves the claim to
//! expire; the redelivery calls again **with the same idempotency key**, and an
//! API that honours the key (Stripe and most payment APIs do) answers with the
//! first charge instead of making a second one. Errors map to the protocol:
//! 2xx is done, 409 (the same key is being processed) / 429 / 5xx / no answer
//! are retried, any other 4xx (card declined, invalid request) is permanent.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use crate::{Context, Handler, HandlerError, HandlerResult, Message};

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
        let request = hyper::Request::post(&self.charges_url)
            .header("content-type", "application/json")
            .header("idempotency-key", key)
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
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| HandlerError::retry(format!("payment API response cut off: {e}")))?
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        if status.is_success() {
            let charge: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
                HandlerError::retry(format!("payment API answered {status} with {text}: {e}"))
            })?;
            if !self.pause_after_call.is_zero() {
                tokio::time::sleep(self.pause_after_call).await;
            }
            return Ok(Some(charge));
        }
        let why = format!("payment API answered {status}: {text}");
        if status.as_u16() == 409 || status.as_u16() == 429 || status.is_server_error() {
            Err(HandlerError::retry(why))
        } else {
            Err(HandlerError::permanent(why))
        }
    }
}
