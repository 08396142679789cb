//! The pointer body the Amazon SQS Extended Client Libraries send in place
//! of a payload stored in S3, and the size attribute that marks it: read by
//! [`crate::protocol::payloads`], written by the outbox for outgoing bodies
//! too large for SQS.

use crate::Message;

/// The extended clients' size attribute: the payload's size in bytes (`Number`).
pub const SIZE_ATTRIBUTE: &str = "ExtendedPayloadSize";
/// Its name in the Java extended client's 1.x releases (still read by both).
pub const LEGACY_SIZE_ATTRIBUTE: &str = "SQSLargePayloadSize";
/// The class name that opens a pointer body.
pub const POINTER_CLASS: &str = "software.amazon.payloadoffloading.PayloadS3Pointer";
/// The class name of the Java extended client's 1.x pointers.
pub const LEGACY_POINTER_CLASS: &str = "com.amazon.sqs.javamessaging.MessageS3Pointer";

/// Where a payload is stored.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct S3Pointer {
    /// `s3BucketName`.
    pub bucket: String,
    /// `s3Key`.
    pub key: String,
}

impl std::fmt::Display for S3Pointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)
    }
}

/// Why a body marked as a pointer is not one. Permanent: the message is parked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PointerError {
    /// Not JSON at all.
    #[error("the body is not JSON ({0})")]
    NotJson(String),
    /// JSON, but not `[class, {"s3BucketName", "s3Key"}]`.
    #[error("the body is not an S3 pointer ([class, {{\"s3BucketName\": ..., \"s3Key\": ...}}])")]
    NotAPointer,
    /// A pointer of a class no extended client writes.
    #[error("unknown pointer class {0:?}")]
    UnknownClass(String),
    /// A field missing, empty or not a string.
    #[error("the pointer has no {0}")]
    Missing(&'static str),
}

impl S3Pointer {
    /// Parses an extended client's pointer body.
    pub fn parse(body: &str) -> Result<Self, PointerError> {
        let value: serde_json::Value =
            serde_json::from_str(body).map_err(|e| PointerError::NotJson(e.to_string()))?;
        let serde_json::Value::Array(parts) = value else {
            return Err(PointerError::NotAPointer);
        };
        let [
            serde_json::Value::String(class),
            serde_json::Value::Object(fields),
        ] = parts.as_slice()
        else {
            return Err(PointerError::NotAPointer);
        };
        if class != POINTER_CLASS && class != LEGACY_POINTER_CLASS {
            return Err(PointerError::UnknownClass(class.clone()));
        }
        let field = |name: &'static str| {
            fields
                .get(name)
                .and_then(|v| v.as_str())
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or(PointerError::Missing(name))
        };
        Ok(Self {
            bucket: field("s3BucketName")?,
            key: field("s3Key")?,
        })
    }

    /// The body an extended client sends for this object.
    pub(crate) fn to_body(&self) -> String {
        serde_json::json!([
            POINTER_CLASS,
            {"s3BucketName": self.bucket, "s3Key": self.key}
        ])
        .to_string()
    }

    /// The pointer of a message sent through an extended client's S3 path
    /// (one that carries [`SIZE_ATTRIBUTE`] or [`LEGACY_SIZE_ATTRIBUTE`]);
    /// `None` for an ordinary message.
    pub fn of(message: &Message) -> Option<Result<Self, PointerError>> {
        size_attribute(message)?;
        Some(Self::parse(message.body()))
    }
}

/// The size attribute a message carries, if any (the current name first).
pub(crate) fn size_attribute(message: &Message) -> Option<&'static str> {
    [SIZE_ATTRIBUTE, LEGACY_SIZE_ATTRIBUTE]
        .into_iter()
        .find(|name| message.attributes().contains_key(*name))
}
