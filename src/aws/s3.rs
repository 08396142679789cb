//! [`PayloadStore`] for [`aws_sdk_s3::Client`]: payloads in S3.

use crate::aws::OnHeap;
use aws_sdk_s3::Client;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use futures::future::BoxFuture;

use crate::protocol::payloads::{PayloadError, PayloadErrorKind, PayloadStore, S3Pointer};

/// Sorts a failed S3 call: missing, may pass, denied, or refused.
fn kind<E: ProvideErrorMetadata>(e: &SdkError<E, HttpResponse>) -> PayloadErrorKind {
    let status = e.raw_response().map(|r| r.status().as_u16());
    let code = e.as_service_error().and_then(|se| se.code()).unwrap_or("");
    match (code, status) {
        ("NoSuchKey" | "NoSuchBucket" | "NotFound", _) | (_, Some(404)) => {
            PayloadErrorKind::NotFound
        }
        ("AccessDenied", _) | (_, Some(403)) => PayloadErrorKind::Denied,
        ("SlowDown" | "RequestTimeout" | "InternalError" | "ServiceUnavailable", _)
        | (_, Some(429 | 500..=599)) => PayloadErrorKind::Transient,
        _ if crate::aws::is_transient(e) => PayloadErrorKind::Transient,
        _ => PayloadErrorKind::Refused,
    }
}

/// A failed SDK call as a [`PayloadError`], keeping the SDK error as its source.
fn payload_error<E>(
    operation: &'static str,
    pointer: &S3Pointer,
    e: SdkError<E, HttpResponse>,
) -> PayloadError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let kind = kind(&e);
    let detail = crate::aws::error_detail(&e);
    PayloadError::new(operation, pointer.clone(), kind, detail).with_source(e)
}

/// The S3 payload store the front door uses: an [`aws_sdk_s3::Client`]
/// whose every call names the account that must own the bucket
/// (`ExpectedBucketOwner`), so that a bucket a pointer names, deleted and
/// made again under another account's name, is refused (403) rather than
/// read from, written to or deleted in.
#[derive(Debug, Clone)]
pub struct S3Payloads {
    client: Client,
    expected_owner: Option<String>,
}

impl S3Payloads {
    /// Calls through `client`, checking no bucket owner.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            expected_owner: None,
        }
    }

    /// Every call expects `account` (a 12-digit AWS account id) to own the bucket.
    #[must_use]
    pub fn expecting_owner(mut self, account: impl Into<String>) -> Self {
        self.expected_owner = Some(account.into());
        self
    }

    /// The account every call expects to own the bucket, if any.
    pub fn expected_owner(&self) -> Option<&str> {
        self.expected_owner.as_deref()
    }
}

impl PayloadStore for S3Payloads {
    fn get<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, PayloadError>> {
        get(
            &self.client,
            self.expected_owner.as_deref(),
            pointer,
            max_bytes,
        )
    }

    fn delete<'a>(&'a self, pointer: &'a S3Pointer) -> BoxFuture<'a, Result<(), PayloadError>> {
        delete(&self.client, self.expected_owner.as_deref(), pointer)
    }

    fn put<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), PayloadError>> {
        put(&self.client, self.expected_owner.as_deref(), pointer, bytes)
    }
}

/// A bare client checks no bucket owner (see [`S3Payloads`]).
impl PayloadStore for Client {
    fn get<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, PayloadError>> {
        get(self, None, pointer, max_bytes)
    }

    fn delete<'a>(&'a self, pointer: &'a S3Pointer) -> BoxFuture<'a, Result<(), PayloadError>> {
        delete(self, None, pointer)
    }

    fn put<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), PayloadError>> {
        put(self, None, pointer, bytes)
    }
}

fn get<'a>(
    client: &'a Client,
    owner: Option<&'a str>,
    pointer: &'a S3Pointer,
    max_bytes: usize,
) -> BoxFuture<'a, Result<Vec<u8>, PayloadError>> {
    Box::pin(async move {
        let out = client
            .get_object()
            .set_expected_bucket_owner(owner.map(str::to_owned))
            .bucket(&pointer.bucket)
            .key(&pointer.key)
            .send()
            .on_heap()
            .await
            .map_err(|e| payload_error("GetObject", pointer, e))?;
        let too_large = |what: String| {
            PayloadError::new(
                "GetObject",
                pointer.clone(),
                PayloadErrorKind::TooLarge,
                format!("{what}, above the maximum of {max_bytes} bytes"),
            )
        };
        let length = out.content_length().and_then(|n| usize::try_from(n).ok());
        if let Some(n) = length.filter(|n| *n > max_bytes) {
            return Err(too_large(format!("the object is {n} bytes")).with_object_size(n));
        }
        let mut body = out.body;
        let mut bytes = Vec::with_capacity(length.unwrap_or(0).min(max_bytes));
        loop {
            let chunk = body.try_next().await.map_err(|e| {
                PayloadError::new(
                    "GetObject",
                    pointer.clone(),
                    PayloadErrorKind::Transient,
                    format!("reading the object failed: {e}"),
                )
                .with_source(e)
            })?;
            let Some(chunk) = chunk else { break };
            if bytes.len() + chunk.len() > max_bytes {
                return Err(too_large("the object's body runs past it".to_owned()));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    })
}

fn delete<'a>(
    client: &'a Client,
    owner: Option<&'a str>,
    pointer: &'a S3Pointer,
) -> BoxFuture<'a, Result<(), PayloadError>> {
    Box::pin(async move {
        client
            .delete_object()
            .set_expected_bucket_owner(owner.map(str::to_owned))
            .bucket(&pointer.bucket)
            .key(&pointer.key)
            .send()
            .on_heap()
            .await
            .map_err(|e| payload_error("DeleteObject", pointer, e))?;
        Ok(())
    })
}

fn put<'a>(
    client: &'a Client,
    owner: Option<&'a str>,
    pointer: &'a S3Pointer,
    bytes: Vec<u8>,
) -> BoxFuture<'a, Result<(), PayloadError>> {
    Box::pin(async move {
        client
            .put_object()
            .set_expected_bucket_owner(owner.map(str::to_owned))
            .bucket(&pointer.bucket)
            .key(&pointer.key)
            .body(bytes.into())
            .send()
            .on_heap()
            .await
            .map_err(|e| payload_error("PutObject", pointer, e))?;
        Ok(())
    })
}
