//! An in-memory [`PayloadStore`] for tests: objects in a map, every call
//! counted, and failures to order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use crate::protocol::payloads::{PayloadError, PayloadErrorKind, PayloadStore, S3Pointer};

#[derive(Debug, Default)]
struct State {
    objects: HashMap<S3Pointer, Vec<u8>>,
    gets: u32,
    deletes: Vec<S3Pointer>,
    /// The next `GetObject` calls fail with these kinds, first to last.
    get_failures: Vec<PayloadErrorKind>,
    /// How long every `GetObject` takes.
    get_time: std::time::Duration,
    /// The next `PutObject` calls fail with these kinds, first to last.
    put_failures: Vec<PayloadErrorKind>,
    /// The objects `PutObject` stored, in order.
    puts: Vec<S3Pointer>,
}

/// Objects in memory. Cheap to clone: clones share the objects.
#[derive(Debug, Clone, Default)]
pub struct MemoryPayloads {
    state: Arc<Mutex<State>>,
}

impl MemoryPayloads {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("payload store lock")
    }

    /// Stores an object.
    pub fn put(&self, bucket: &str, key: &str, content: impl Into<Vec<u8>>) -> S3Pointer {
        let pointer = S3Pointer {
            bucket: bucket.to_owned(),
            key: key.to_owned(),
        };
        self.state().objects.insert(pointer.clone(), content.into());
        pointer
    }

    /// Whether the object exists.
    pub fn contains(&self, pointer: &S3Pointer) -> bool {
        self.state().objects.contains_key(pointer)
    }

    /// `GetObject` calls so far.
    pub fn gets(&self) -> u32 {
        self.state().gets
    }

    /// The objects `DeleteObject` was called for, in order.
    pub fn deletes(&self) -> Vec<S3Pointer> {
        self.state().deletes.clone()
    }

    /// Makes the next `GetObject` fail with `kind` (calls queue up).
    pub fn fail_next_get(&self, kind: PayloadErrorKind) {
        self.state().get_failures.push(kind);
    }

    /// Makes the next `PutObject` fail with `kind` (calls queue up).
    pub fn fail_next_put(&self, kind: PayloadErrorKind) {
        self.state().put_failures.push(kind);
    }

    /// The objects `PutObject` stored, in order.
    pub fn puts(&self) -> Vec<S3Pointer> {
        self.state().puts.clone()
    }

    /// An object's content.
    pub fn object(&self, pointer: &S3Pointer) -> Option<Vec<u8>> {
        self.state().objects.get(pointer).cloned()
    }

    /// Makes every `GetObject` take `time` (on tokio's clock) before it
    /// answers: a slow download.
    pub fn slow_gets(&self, time: std::time::Duration) {
        self.state().get_time = time;
    }
}

impl PayloadStore for MemoryPayloads {
    fn get<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, PayloadError>> {
        Box::pin(async move {
            let time = self.state().get_time;
            if !time.is_zero() {
                tokio::time::sleep(time).await;
            }
            let mut s = self.state();
            s.gets += 1;
            if !s.get_failures.is_empty() {
                let kind = s.get_failures.remove(0);
                return Err(PayloadError::new(
                    "GetObject",
                    pointer.clone(),
                    kind,
                    format!("injected {kind:?}"),
                ));
            }
            let bytes = s.objects.get(pointer).cloned().ok_or_else(|| {
                PayloadError::new(
                    "GetObject",
                    pointer.clone(),
                    PayloadErrorKind::NotFound,
                    "NoSuchKey: The specified key does not exist.",
                )
            })?;
            if bytes.len() > max_bytes {
                return Err(PayloadError::new(
                    "GetObject",
                    pointer.clone(),
                    PayloadErrorKind::TooLarge,
                    format!(
                        "the object is {} bytes, above the maximum of {max_bytes} bytes",
                        bytes.len()
                    ),
                )
                .with_object_size(bytes.len()));
            }
            Ok(bytes)
        })
    }

    fn delete<'a>(&'a self, pointer: &'a S3Pointer) -> BoxFuture<'a, Result<(), PayloadError>> {
        Box::pin(async move {
            let mut s = self.state();
            s.deletes.push(pointer.clone());
            s.objects.remove(pointer);
            Ok(())
        })
    }

    fn put<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), PayloadError>> {
        Box::pin(async move {
            let mut s = self.state();
            if !s.put_failures.is_empty() {
                let kind = s.put_failures.remove(0);
                return Err(PayloadError::new(
                    "PutObject",
                    pointer.clone(),
                    kind,
                    format!("injected {kind:?}"),
                ));
            }
            s.puts.push(pointer.clone());
            s.objects.insert(pointer.clone(), bytes);
            Ok(())
        })
    }
}
