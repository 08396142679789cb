//! Large payloads through S3, as the Amazon SQS Extended Client Libraries
//! (Java and Python) send them.
//!
//! An extended client stores a body too large for SQS (or every body, with
//! "always through S3") as an S3 object and sends a pointer instead:
//!
//! ```text
//! body:       ["software.amazon.payloadoffloading.PayloadS3Pointer", {"s3BucketName": "b", "s3Key": "k"}]
//! attribute:  ExtendedPayloadSize (Number) = the payload's size in bytes
//! ```
//!
//! (`SQSLargePayloadSize` and the class `com.amazon.sqs.javamessaging.MessageS3Pointer`
//! are the names of the Java client's 1.x releases, which the Python client
//! still writes with `use_legacy_attribute`.) With [`LargePayloads`] on the
//! [`Processor`](crate::Processor), a message carrying either size attribute
//! has its body replaced by the object's content, and the attribute removed,
//! before its dedup key is read and its handler runs, exactly as an extended
//! client's receive would hand it over. The runtimes keep the message as
//! received: a parked copy carries the pointer, not the payload.
//!
//! What cannot be read is an [`Outcome`]: a missing object (`NoSuchKey`), a
//! body that is not a pointer, or a payload that is not UTF-8 text is parked
//! with its reason; an S3 failure that may pass (no answer, throttling, 5xx) is
//! tried again in place (tries starting up to 30 seconds after the first,
//! the message kept invisible by the runtimes meanwhile), and then, like a
//! refusal (access denied: a permission that may yet be granted), retried
//! after the backoff. A missing object whose message is already completed (its
//! object was deleted after an earlier copy finished; dedup keys that do not
//! come from the body only) is a duplicate, not a failure.
//!
//! With deletion on ([`LargePayloads::deleting`]), the object of a message
//! that is finished with (completed now or a duplicate, never a parked one)
//! is deleted after the message itself is: see the project's `docs/DESIGN.md`
//! ("Large payloads").

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tracing::{info, warn};

use crate::protocol::clock::Clock;
use crate::protocol::config::ProcessorConfig;
use crate::protocol::store::{DedupStore, Status};
use crate::{Message, Outcome};

mod budget;
pub use budget::{
    FittedBudget, KEPT_FOR_THE_REST, MemoryLimits, PayloadBudget, PayloadGrant, fit as fit_budget,
};

use crate::protocol::pointer::size_attribute;
pub use crate::protocol::pointer::{
    LEGACY_POINTER_CLASS, LEGACY_SIZE_ATTRIBUTE, POINTER_CLASS, PointerError, S3Pointer,
    SIZE_ATTRIBUTE,
};

/// How an S3 call failed, which decides what becomes of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PayloadErrorKind {
    /// No such key or bucket: it will not appear later (parked).
    NotFound,
    /// No answer, throttling, a 5xx: may pass when tried again (tried again
    /// in place for a while, then retried after the backoff).
    Transient,
    /// Access denied: may pass once the permission is granted (retried).
    Denied,
    /// Any other refusal (a wrong region, an archived object, a disabled
    /// KMS key): an operator can fix it, so it is retried, and ends in the
    /// DLQ by the redrive policy if it lasts.
    Refused,
    /// Larger than the configured maximum: never read past it (parked).
    TooLarge,
}

/// A failed S3 call, with the SDK's error as its source.
#[derive(Debug, thiserror::Error)]
#[error("{operation} {pointer} failed: {detail}")]
pub struct PayloadError {
    /// `GetObject` or `DeleteObject`.
    pub operation: &'static str,
    /// The object.
    pub pointer: S3Pointer,
    /// What S3 or the transport said.
    pub detail: String,
    /// What kind of failure.
    pub kind: PayloadErrorKind,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    /// The object's size, when a [`PayloadErrorKind::TooLarge`] read knew it.
    object_size: Option<usize>,
}

impl PayloadError {
    /// A failure of `operation` on `pointer`.
    pub fn new(
        operation: &'static str,
        pointer: S3Pointer,
        kind: PayloadErrorKind,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            operation,
            pointer,
            detail: detail.into(),
            kind,
            source: None,
            object_size: None,
        }
    }

    /// Notes the object's size (a [`PayloadErrorKind::TooLarge`] read that
    /// knew it: a payload under the maximum is then read again under a
    /// grant of the payload budget that covers it).
    #[must_use]
    pub fn with_object_size(mut self, bytes: usize) -> Self {
        self.object_size = Some(bytes);
        self
    }

    /// The object's size, when known.
    pub fn object_size(&self) -> Option<usize> {
        self.object_size
    }

    /// Keeps the underlying error as the source.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }
}

/// The object store payloads are read from and deleted in: S3
/// ([`aws_sdk_s3::Client`]), or the test kit's `MemoryPayloads` in tests.
pub trait PayloadStore: Send + Sync + 'static {
    /// `GetObject`: the object's bytes, read as a stream and given up with
    /// [`PayloadErrorKind::TooLarge`] as soon as they pass `max_bytes` (so a
    /// poison object costs at most that much memory).
    fn get<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, PayloadError>>;

    /// `DeleteObject` (deleting an absent object succeeds).
    fn delete<'a>(&'a self, pointer: &'a S3Pointer) -> BoxFuture<'a, Result<(), PayloadError>>;

    /// `PutObject`: stores `bytes` under `pointer` (the body of an outgoing
    /// message too large for SQS, see [`LargePayloads::sending_large_to`]).
    fn put<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), PayloadError>>;
}

/// Large payload support for a [`Processor`](crate::Processor)
/// (`SQS_ONCE_LARGE_PAYLOADS=on`), and whether the runtimes delete the
/// objects of finished messages (`SQS_ONCE_DELETE_PAYLOADS=on`).
#[derive(Clone)]
pub struct LargePayloads {
    store: Arc<dyn PayloadStore>,
    delete: bool,
    /// The largest payload read (`SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES`).
    max_bytes: usize,
    /// Where payloads may be (`SQS_ONCE_LARGE_PAYLOAD_BUCKETS`); `None`: anywhere.
    allowed: Option<Vec<PayloadLocation>>,
    /// Where the bodies of outgoing messages too large for SQS are stored
    /// (`SQS_ONCE_OUTBOX_PAYLOAD_BUCKET`); `None`: such a message is refused.
    outgoing: Option<PayloadLocation>,
    /// Whether incoming pointers are read (off: outgoing bodies only).
    read: bool,
    /// The payload bytes held at once (`SQS_ONCE_PAYLOAD_BUDGET_BYTES`);
    /// `None`: no bound but concurrency x `max_bytes`.
    budget: Option<Arc<PayloadBudget>>,
}

/// A place payloads may be read from (and deleted in): a bucket, and
/// optionally a key prefix within it. Parsed from `bucket` or
/// `bucket/prefix` (the prefix as it is, e.g. `payloads/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadLocation {
    /// The bucket's name.
    pub bucket: String,
    /// What each key must start with (empty: any key).
    pub prefix: String,
}

impl PayloadLocation {
    /// Whether `pointer` is in this place.
    pub fn holds(&self, pointer: &S3Pointer) -> bool {
        pointer.bucket == self.bucket && pointer.key.starts_with(&self.prefix)
    }

    /// A comma-separated list of `bucket` or `bucket/prefix`.
    #[cfg(any(feature = "poller", feature = "lambda"))]
    pub(crate) fn parse_list(text: &str) -> Result<Vec<Self>, String> {
        let list: Vec<Self> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|item| {
                let (bucket, prefix) = item.split_once('/').unwrap_or((item, ""));
                let valid = (3..=63).contains(&bucket.len())
                    && bucket
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
                if valid {
                    Ok(Self {
                        bucket: bucket.to_owned(),
                        prefix: prefix.to_owned(),
                    })
                } else {
                    Err(format!(
                        "{item:?} is not `bucket` or `bucket/prefix` (a bucket name is 3 to 63 lower-case letters, digits, dots and hyphens)"
                    ))
                }
            })
            .collect::<Result<_, _>>()?;
        if list.is_empty() {
            return Err("names no bucket".to_owned());
        }
        Ok(list)
    }
}

/// The largest payload read by default: 64 MiB (the extended clients allow
/// up to 2 GB; a handler holding that much per message is rarely intended).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 * 1024 * 1024;

impl std::fmt::Debug for LargePayloads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LargePayloads")
            .field("delete", &self.delete)
            .field("max_bytes", &self.max_bytes)
            .field("budget", &self.budget.as_ref().map(|b| b.bytes()))
            .finish_non_exhaustive()
    }
}

impl LargePayloads {
    /// Reads payloads from `store`; deletes none.
    pub fn new(store: impl PayloadStore) -> Self {
        Self {
            store: Arc::new(store),
            delete: false,
            max_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            allowed: None,
            outgoing: None,
            read: true,
            budget: None,
        }
    }

    /// Reads no incoming pointer (`false`): messages are handed over as
    /// received, and only outgoing bodies go through S3
    /// ([`Self::sending_large_to`]).
    #[must_use]
    pub fn reading(mut self, read: bool) -> Self {
        self.read = read;
        self
    }

    /// Stores the body of each outgoing message ([`crate::Context::send`])
    /// that is too large for SQS as an object in `location` (the key is the
    /// location's prefix and a fresh UUID), and records and sends an
    /// extended client's pointer to it instead, with the size attribute
    /// [`SIZE_ATTRIBUTE`], as the SQS Extended Client Libraries send: a
    /// consumer reading large payloads (sqs-once with large payloads on, or
    /// an extended client) receives the body. The object is stored before
    /// the effect commits; a run that does not commit leaves its objects
    /// behind for the bucket's lifecycle rule. Bodies up to
    /// [`Self::max_bytes`].
    #[must_use]
    pub fn sending_large_to(mut self, location: PayloadLocation) -> Self {
        self.outgoing = Some(location);
        self
    }

    /// The largest outgoing body stored in S3, when outgoing messages too
    /// large for SQS are (see [`Self::sending_large_to`]).
    pub fn outgoing_max_bytes(&self) -> Option<usize> {
        self.outgoing.as_ref().map(|_| self.max_bytes)
    }

    /// Stores `body` as a new object in the outgoing location: its pointer.
    pub(crate) async fn store_outgoing(&self, body: &str) -> Result<S3Pointer, PayloadError> {
        let location = self.outgoing.as_ref().ok_or_else(|| {
            PayloadError::new(
                "PutObject",
                S3Pointer {
                    bucket: String::new(),
                    key: String::new(),
                },
                PayloadErrorKind::Refused,
                "no bucket for outgoing payloads (LargePayloads::sending_large_to)",
            )
        })?;
        let pointer = S3Pointer {
            bucket: location.bucket.clone(),
            key: format!("{}{}", location.prefix, uuid::Uuid::new_v4()),
        };
        // (The `pointer-before-object` mutant, for the simulator only,
        // stores the body in the background without waiting for the put: the
        // pointer may be sent, and read, before its object exists, or
        // without it when the put fails.)
        if crate::protocol::mutants::active("pointer-before-object") {
            let (store, object) = (self.store.clone(), pointer.clone());
            let bytes = body.as_bytes().to_vec();
            tokio::spawn(async move {
                let _ = store.put(&object, bytes).await;
            });
            return Ok(pointer);
        }
        self.store.put(&pointer, body.as_bytes().to_vec()).await?;
        info!(object = %pointer, bytes = body.len(), "outgoing payload stored");
        Ok(pointer)
    }

    /// Reads (and deletes) payloads only in these places: a pointer to any
    /// other bucket or key is parked without calling S3. Without it a
    /// pointer may name any object the role can read (or delete): a
    /// producer's message could make the consumer read another's objects
    /// into its handler, or delete them.
    #[must_use]
    pub fn only_from(mut self, allowed: Vec<PayloadLocation>) -> Self {
        self.allowed = Some(allowed);
        self
    }

    fn allows(&self, pointer: &S3Pointer) -> bool {
        self.allowed
            .as_ref()
            .is_none_or(|places| places.iter().any(|p| p.holds(pointer)))
    }

    /// Reads no payload larger than `max_bytes`: one whose pointer declares
    /// more is parked without calling S3, and a read is cut off as soon as
    /// it passes the bound (memory per message stays within it; across
    /// messages, [`Self::within`] bounds what is held at once, else up to
    /// concurrency x `max_bytes`).
    #[must_use]
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Holds at most `budget`'s bytes of payloads at once, across every
    /// message of every processor sharing it ([`PayloadBudget`]): a payload
    /// waits for room before it is read, and one that could never fit is
    /// parked.
    #[must_use]
    pub fn within(mut self, budget: Arc<PayloadBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// The payload budget, if any.
    pub fn budget(&self) -> Option<&Arc<PayloadBudget>> {
        self.budget.as_ref()
    }

    /// Deletes the object of each finished message after the message is deleted.
    pub fn deleting(mut self, delete: bool) -> Self {
        self.delete = delete;
        self
    }

    /// Whether objects of finished messages are deleted.
    pub fn deletes(&self) -> bool {
        self.delete
    }

    /// The object to delete once `message` (as received) is deleted: its
    /// pointer, when deletion is on and it has one.
    pub fn to_delete(&self, message: &Message) -> Option<S3Pointer> {
        if !self.delete || !self.read {
            return None;
        }
        S3Pointer::of(message)?.ok().filter(|p| self.allows(p))
    }

    /// Deletes these objects (their messages are deleted). A failure is
    /// logged: the object is left behind (a lifecycle rule on the bucket
    /// removes such leftovers), the message is not affected.
    #[cfg(any(feature = "poller", feature = "lambda"))]
    pub(crate) async fn delete_objects(&self, pointers: Vec<S3Pointer>) {
        let deletes = pointers.iter().map(|p| async move {
            match self.store.delete(p).await {
                Ok(()) => info!(object = %p, "large payload deleted"),
                Err(e) => warn!(error = %e, "could not delete a large payload; it is left behind"),
            }
        });
        futures::future::join_all(deletes).await;
    }

    /// The message with its pointer body replaced by the payload (and
    /// without the size attribute); `None` for an ordinary message. What
    /// cannot be read is the outcome. A read failing for a cause that may
    /// pass is tried again until `until` at the latest (see [`Self::read`]).
    pub(crate) async fn resolve<S: DedupStore>(
        &self,
        message: &Message,
        config: &ProcessorConfig,
        records: &S,
        clock: &dyn Clock,
        until: Option<tokio::time::Instant>,
    ) -> Result<Option<(Message, Option<PayloadGrant>)>, Outcome> {
        let Some(pointer) = S3Pointer::of(message).filter(|_| self.read) else {
            return Ok(None);
        };
        let pointer = pointer.map_err(|e| Outcome::Park {
            reason: format!("large payload: {e}"),
        })?;
        if !self.allows(&pointer) {
            return Err(Outcome::Park {
                reason: format!(
                    "large payload: {pointer} is outside the payload buckets (SQS_ONCE_LARGE_PAYLOAD_BUCKETS); not read"
                ),
            });
        }
        let declared = size_attribute(message)
            .and_then(|name| message.attribute(name))
            .and_then(|v| v.trim().parse::<usize>().ok());
        if let Some(declared) = declared.filter(|d| *d > self.max_bytes) {
            return Err(Outcome::Park {
                reason: format!(
                    "large payload: {pointer} declares {declared} bytes, above the maximum of {} (SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES); not read",
                    self.max_bytes
                ),
            });
        }
        let (bytes, grant) = match self
            .read_granted(&pointer, declared, message, config, until)
            .await
        {
            Ok(read) => read,
            Err(Granted::Outcome(outcome)) => return Err(outcome),
            Err(Granted::Failed(e)) => {
                return Err(failure(e, message, config, records, clock).await);
            }
        };
        let Ok(payload) = String::from_utf8(bytes) else {
            return Err(Outcome::Park {
                reason: format!("large payload: {pointer} is not UTF-8 text"),
            });
        };
        check_size(message, payload.len());
        info!(object = %pointer, bytes = payload.len(), "large payload read");
        Ok(Some((
            with_body(message, payload, config.carry_secret.as_ref()),
            grant,
        )))
    }

    /// The object's bytes, read under a grant of the payload budget (when
    /// there is one) that covers them, and the grant, to be held while the
    /// bytes are. The grant is of the size the pointer `declared`; an
    /// object longer than that is cut off at the grant, which is given back
    /// before the object is read again under a grant of its size (no grant
    /// waits while holding another: two messages each waiting for more
    /// cannot hold each other up).
    async fn read_granted(
        &self,
        pointer: &S3Pointer,
        declared: Option<usize>,
        message: &Message,
        config: &ProcessorConfig,
        until: Option<tokio::time::Instant>,
    ) -> Result<(Vec<u8>, Option<PayloadGrant>), Granted> {
        let Some(budget) = &self.budget else {
            let bytes = self.read(pointer, until, self.max_bytes).await;
            return bytes.map(|b| (b, None)).map_err(Granted::Failed);
        };
        let ceiling = self.max_bytes.min(budget.bytes());
        let mut want = declared.unwrap_or(ceiling).min(self.max_bytes);
        loop {
            let grant = self
                .grant(budget, pointer, want, message, config, until)
                .await
                .map_err(Granted::Outcome)?;
            let limit = grant.bytes().min(self.max_bytes);
            let e = match self.read(pointer, until, limit).await {
                Ok(bytes) => {
                    // Held while the message runs: only what was read.
                    let mut grant = grant;
                    grant.shrink_to(bytes.len());
                    return Ok((bytes, Some(grant)));
                }
                Err(e) if e.kind == PayloadErrorKind::TooLarge && limit < self.max_bytes => e,
                Err(e) => return Err(Granted::Failed(e)),
            };
            drop(grant);
            let size = e.object_size();
            if let Some(size) = size.filter(|s| *s > self.max_bytes) {
                return Err(Granted::Outcome(Outcome::Park {
                    reason: format!(
                        "large payload: {pointer} is {size} bytes, above the maximum of {} (SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES); not read",
                        self.max_bytes
                    ),
                }));
            }
            let next = size.unwrap_or(ceiling);
            if next <= limit {
                return Err(Granted::Outcome(Outcome::Park {
                    reason: format!(
                        "large payload: {pointer} runs past the payload budget of {} bytes (SQS_ONCE_PAYLOAD_BUDGET_BYTES): it could never be held; not read",
                        budget.bytes()
                    ),
                }));
            }
            info!(object = %pointer, declared, size, "large payload longer than its grant of the payload budget; read again under a larger one");
            want = next;
        }
    }

    /// A grant of `bytes` of the payload budget: at once when free, else
    /// once enough are given back (the message kept invisible meanwhile by
    /// the caller), until `until` at the latest (Lambda: the invocation's
    /// margin, past which the message is retried). A payload that can never
    /// fit the budget is parked.
    async fn grant(
        &self,
        budget: &Arc<PayloadBudget>,
        pointer: &S3Pointer,
        bytes: usize,
        message: &Message,
        config: &ProcessorConfig,
        until: Option<tokio::time::Instant>,
    ) -> Result<PayloadGrant, Outcome> {
        if let Some(grant) = budget.try_grant(bytes) {
            return Ok(grant);
        }
        if !budget.fits(bytes) {
            return Err(Outcome::Park {
                reason: format!(
                    "large payload: {pointer} needs {bytes} bytes, more than the payload budget of {} bytes (SQS_ONCE_PAYLOAD_BUDGET_BYTES): it could never be held; not read",
                    budget.bytes()
                ),
            });
        }
        info!(
            object = %pointer,
            bytes,
            held = budget.held(),
            budget = budget.bytes(),
            "waiting for the payload budget, the message kept invisible"
        );
        let deadline = async {
            match until {
                Some(until) => tokio::time::sleep_until(until).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            grant = budget.grant(bytes) => Ok(grant.expect("a payload that fits is granted")),
            () = deadline => {
                warn!(object = %pointer, bytes, budget = budget.bytes(), "no room in the payload budget before the invocation's deadline; the message is retried");
                Err(Outcome::Retry {
                    after: config.backoff(message.receive_count()),
                    reason: format!(
                        "large payload: {pointer} waited for {bytes} bytes of the payload budget ({} bytes, SQS_ONCE_PAYLOAD_BUDGET_BYTES) until the invocation's deadline",
                        budget.bytes()
                    ),
                })
            }
        }
    }

    /// The object's bytes. A failure that may pass (no answer, throttling,
    /// a 5xx) is tried again after [`READ_RETRY_PAUSE`], doubling up to
    /// [`READ_RETRY_PAUSE_MAX`], while the next try would start within
    /// [`READ_RETRY_WINDOW`] of the first one and before `until` (Lambda:
    /// the time by which the invocation stops waiting, so that the last
    /// failure is answered with its backoff rather than cut off by the
    /// deadline): the caller keeps the message invisible meanwhile, so a
    /// blip costs time, not one of the message's receives. Before, every
    /// such failure gave the receive back at once, and a message whose key
    /// is inside its payload cannot be recognised as done without it:
    /// simulator seed 724910 (completed on a superseded receipt, its later
    /// receives' reads failed one after another until SQS moved it, effect
    /// recorded, to the DLQ). Any other failure is answered at once.
    async fn read(
        &self,
        pointer: &S3Pointer,
        until: Option<tokio::time::Instant>,
        max_bytes: usize,
    ) -> Result<Vec<u8>, PayloadError> {
        let started = tokio::time::Instant::now();
        let last_start = until.map_or(started + READ_RETRY_WINDOW, |u| {
            u.min(started + READ_RETRY_WINDOW)
        });
        let mut pause = READ_RETRY_PAUSE;
        loop {
            match self.store.get(pointer, max_bytes).await {
                Err(e)
                    if e.kind == PayloadErrorKind::Transient
                        && tokio::time::Instant::now() + pause <= last_start =>
                {
                    tracing::debug!(object = %pointer, error = %e, retry_in = ?pause, "large payload read failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(READ_RETRY_PAUSE_MAX);
                }
                read => return read,
            }
        }
    }
}

/// Why a read under the payload budget did not give the bytes.
enum Granted {
    /// The message's outcome (parked, or retried when the wait for the
    /// budget passed the deadline).
    Outcome(Outcome),
    /// The read failed.
    Failed(PayloadError),
}

/// The first pause before a large payload's failed read is tried again.
pub(crate) const READ_RETRY_PAUSE: Duration = Duration::from_millis(200);
/// The longest pause between tries of a large payload's read.
pub(crate) const READ_RETRY_PAUSE_MAX: Duration = Duration::from_secs(5);
/// How long after a large payload's first read a try may still start;
/// a failure after that is the message's outcome (retried after the
/// backoff).
pub(crate) const READ_RETRY_WINDOW: Duration = Duration::from_secs(30);

/// Warns when the payload's size is not the one the sender declared.
fn check_size(message: &Message, actual: usize) {
    let declared = size_attribute(message)
        .and_then(|name| message.attribute(name))
        .and_then(|v| v.trim().parse::<usize>().ok());
    if declared.is_some_and(|d| d != actual) {
        warn!(
            declared,
            actual, "large payload size differs from the size attribute"
        );
    }
}

/// What becomes of a message whose payload could not be read.
async fn failure<S: DedupStore>(
    e: PayloadError,
    message: &Message,
    config: &ProcessorConfig,
    records: &S,
    clock: &dyn Clock,
) -> Outcome {
    match e.kind {
        PayloadErrorKind::NotFound => missing(e, message, config, records, clock).await,
        // An object never shrinks under its key: parked with the reason.
        PayloadErrorKind::TooLarge => Outcome::Park {
            reason: format!("large payload: {e}"),
        },
        // Nothing is claimed yet, so no park here could be recognised on a
        // redelivery: only what can never change (a missing object) parks.
        PayloadErrorKind::Transient | PayloadErrorKind::Denied | PayloadErrorKind::Refused => {
            Outcome::Retry {
                after: config.backoff(message.receive_count()),
                reason: format!("large payload: {e}"),
            }
        }
    }
}

/// A missing object: a duplicate when the message's key (taken without the
/// body) is already completed and unexpired by the processor's clock (its
/// object was deleted after that), else parked.
async fn missing<S: DedupStore>(
    e: PayloadError,
    message: &Message,
    config: &ProcessorConfig,
    records: &S,
    clock: &dyn Clock,
) -> Outcome {
    let reason = format!(
        "large payload {} is missing ({}): deleted, expired by a lifecycle rule, or never stored",
        e.pointer, e.detail
    );
    let body_free = config.key_source.is_body_free();
    let key = body_free.then(|| config.dedup_key(message).ok()).flatten();
    let Some(key) = key else {
        return Outcome::Park { reason };
    };
    let now_s = clock.now_ms().div_euclid(1000);
    match records.get(&config.record_key(&key)).await {
        Ok(Some(r)) if r.status == Status::Completed && r.expires_at_s >= now_s => {
            info!(object = %e.pointer, "large payload gone, but the message is already completed: a duplicate");
            Outcome::Duplicate {
                result: r.result,
                payload_matches: true,
            }
        }
        Ok(_) => Outcome::Park { reason },
        Err(store) => Outcome::Retry {
            after: config.backoff(message.receive_count()),
            reason: format!("{reason}; its dedup record could not be read: {store}"),
        },
    }
}

/// The message as an extended client's receive hands it over: the payload as
/// its body, without the size attribute.
fn with_body(
    received: &Message,
    payload: String,
    secret: Option<&crate::protocol::key::CarrySecret>,
) -> Message {
    use crate::protocol::key::carried;
    // A copy brought back from the DLQ carries its key and first id sealed
    // for the body it was parked with, the pointer: sealed again for the
    // payload when they verify, so that they hold for the body the key is
    // read from (and those that do not verify stay as they are: unverified).
    let reseal = |name: &str| {
        let value = carried(received, name, secret)?;
        let secret = secret?;
        Some(secret.seal(name, &payload, value))
    };
    let resealed: Vec<(&str, String)> = crate::protocol::key::SEALED_ATTRIBUTES
        .into_iter()
        .filter_map(|name| Some((name, reseal(name)?)))
        .collect();
    let mut m = Message::new(received.id(), payload).with_receive_count(received.receive_count());
    if let Some(r) = received.receipt_handle() {
        m = m.with_receipt_handle(r);
    }
    if let Some(g) = received.group_id() {
        m = m.with_group_id(g);
    }
    if let Some(d) = received.deduplication_id() {
        m = m.with_deduplication_id(d);
    }
    if let Some(s) = received.sender_id() {
        m = m.with_sender_id(s);
    }
    // The queue tells a FIFO queue from a fair one (`Message::from_fifo_queue`).
    if let Some(q) = received.queue() {
        m = m.with_queue(q);
    }
    if let Some(t) = received.aws_trace_header() {
        m = m.with_aws_trace_header(t);
    }
    for (name, attribute) in received.attributes() {
        let resealed = resealed.iter().find(|(n, _)| n == name);
        match (name.as_str(), resealed) {
            (SIZE_ATTRIBUTE | LEGACY_SIZE_ATTRIBUTE, _) => {}
            (_, Some((_, value))) => m = m.with_attribute(name, value.clone()),
            _ => m = m.with_typed_attribute(name, attribute.clone()),
        }
    }
    m
}

#[cfg(test)]
mod tests;
