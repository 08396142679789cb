//! S3 behind its REST-XML protocol, for the calls the project's large-payload
//! reader makes: `GetObject` (the body, `Content-Length`, `ETag`) and
//! `DeleteObject` (204, whether or not the key exists). A missing key is
//! `NoSuchKey` (404), an unknown bucket `NoSuchBucket` (404); errors are the
//! XML `<Error><Code>..</Code><Message>..</Message></Error>` S3 answers.
//! Requests come path-style (`/bucket/key`) or virtual-hosted
//! (`bucket.<endpoint host>/key`, the SDK's default). Objects are put by the
//! simulator's producer directly ([`S3Model::put`]), as an extended client's
//! `PutObject` would leave them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

/// What the model calls when an object is deleted: its bucket and key.
pub type OnDelete = Arc<dyn Fn(&str, &str) + Send + Sync>;

#[derive(Default)]
struct State {
    buckets: BTreeSet<String>,
    objects: BTreeMap<(String, String), Vec<u8>>,
    gets: u64,
    deletes: Vec<(String, String)>,
    on_delete: Option<OnDelete>,
}

/// The S3 model. Clones share it.
#[derive(Clone, Default)]
pub struct S3Model(Arc<Mutex<State>>);

impl std::fmt::Debug for S3Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state();
        f.debug_struct("S3Model")
            .field("objects", &s.objects.len())
            .field("deletes", &s.deletes.len())
            .finish_non_exhaustive()
    }
}

/// An answer: HTTP status, headers, body.
#[derive(Debug, Clone, PartialEq)]
pub struct S3Answer {
    /// The HTTP status.
    pub status: u16,
    /// Headers besides the request id.
    pub headers: Vec<(&'static str, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// An S3 error answer.
pub fn error(status: u16, code: &str, message: &str) -> S3Answer {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message><RequestId>sim</RequestId><HostId>sim</HostId></Error>"
    );
    S3Answer {
        status,
        headers: vec![("content-type", "application/xml".to_owned())],
        body: body.into_bytes(),
    }
}

/// `InternalError` (500).
pub fn internal_error() -> S3Answer {
    error(
        500,
        "InternalError",
        "We encountered an internal error. Please try again.",
    )
}

/// `SlowDown` (503): S3's throttling.
pub fn slow_down() -> S3Answer {
    error(503, "SlowDown", "Please reduce your request rate.")
}

/// The bucket and key a request names: virtual-hosted (`bucket.host`) when
/// the host has more labels than the endpoint's, else path-style.
pub fn bucket_and_key(host: &str, path: &str, endpoint_host: &str) -> Option<(String, String)> {
    let path = path.split('?').next().unwrap_or("");
    let path = path.strip_prefix('/').unwrap_or(path);
    let decoded = percent_decode(path);
    match host
        .strip_suffix(endpoint_host)
        .and_then(|b| b.strip_suffix('.'))
    {
        Some(bucket) if !bucket.is_empty() => Some((bucket.to_owned(), decoded)),
        _ => {
            let (bucket, key) = decoded.split_once('/')?;
            Some((bucket.to_owned(), key.to_owned()))
        }
    }
}

/// `%XX` escapes decoded (the SDK escapes a key's reserved characters).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        if bytes[i] == b'%'
            && let Some(b) = hex
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl S3Model {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A model with `bucket` in it.
    pub fn with_bucket(bucket: &str) -> Self {
        let model = Self::default();
        model.state().buckets.insert(bucket.to_owned());
        model
    }

    /// `f` is called with each object's bucket and key as it is deleted
    /// (the checker's watch).
    pub fn on_delete(&self, f: OnDelete) {
        self.state().on_delete = Some(f);
    }

    /// Stores an object (the producer's `PutObject`).
    pub fn put(&self, bucket: &str, key: &str, body: impl Into<Vec<u8>>) {
        let mut s = self.state();
        s.buckets.insert(bucket.to_owned());
        s.objects
            .insert((bucket.to_owned(), key.to_owned()), body.into());
    }

    /// Whether the object exists.
    pub fn contains(&self, bucket: &str, key: &str) -> bool {
        self.state()
            .objects
            .contains_key(&(bucket.to_owned(), key.to_owned()))
    }

    /// The objects deleted, in order (bucket, key).
    pub fn deletes(&self) -> Vec<(String, String)> {
        self.state().deletes.clone()
    }

    /// `GetObject` calls that reached the model.
    pub fn gets(&self) -> u64 {
        self.state().gets
    }

    /// Answers one request: `method` on `bucket`/`key`.
    pub fn handle(&self, method: &str, bucket: &str, key: &str) -> S3Answer {
        let on_delete = {
            let mut s = self.state();
            if !s.buckets.contains(bucket) {
                return error(404, "NoSuchBucket", "The specified bucket does not exist");
            }
            let id = (bucket.to_owned(), key.to_owned());
            match method {
                "GET" => {
                    s.gets += 1;
                    return match s.objects.get(&id) {
                        Some(body) => S3Answer {
                            status: 200,
                            headers: vec![
                                ("content-length", body.len().to_string()),
                                ("content-type", "binary/octet-stream".to_owned()),
                                ("etag", format!("\"{:x}\"", body.len())),
                            ],
                            body: body.clone(),
                        },
                        None => error(404, "NoSuchKey", "The specified key does not exist."),
                    };
                }
                "DELETE" => {
                    let existed = s.objects.remove(&id).is_some();
                    if existed {
                        s.deletes.push(id);
                    }
                    existed.then(|| s.on_delete.clone()).flatten()
                }
                _ => {
                    return error(
                        405,
                        "MethodNotAllowed",
                        "The specified method is not allowed against this resource.",
                    );
                }
            }
        };
        // Outside the lock: the watch may look at other models.
        if let Some(f) = on_delete {
            f(bucket, key);
        }
        S3Answer {
            status: 204,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }
}
