//! S3 behind its REST-XML protocol, for the calls the project's large-payload
//! support makes: `GetObject` (the body, `Content-Length`, `ETag`),
//! `DeleteObject` (204, whether or not the key exists) and `PutObject` (200
//! with an `ETag`; the outbox's large outgoing bodies). A missing key is
//! `NoSuchKey` (404), an unknown bucket `NoSuchBucket` (404); errors are the
//! XML `<Error><Code>..</Code><Message>..</Message></Error>` S3 answers, and
//! any other method is `MethodNotAllowed` (405).
//! Requests come path-style (`/bucket/key`) or virtual-hosted
//! (`bucket.<endpoint host>/key`, the SDK's default). The simulator's
//! producer puts its objects directly ([`S3Model::put`]), as an extended
//! client's `PutObject` would leave them.
//!
//! A `PutObject` body comes as the SDK sends it: whole, with its checksum in
//! a header (`x-amz-checksum-crc32`, the SDK's default for a body in memory),
//! or `aws-chunked` (`Content-Encoding: aws-chunked`,
//! `x-amz-decoded-content-length`, chunks of `<hex size>[;chunk-signature=..]`
//! and the checksum in a trailer named by `x-amz-trailer`, as the SDK sends a
//! streaming body). The body is decoded and its checksum (CRC32, CRC32C or
//! SHA-256) verified: a mismatch is `BadDigest` (400), a body shorter or
//! longer than declared `IncompleteBody` (400), a malformed chunked body, a
//! trailer announced and missing, or a checksum the model does not verify
//! `InvalidRequest` (400).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use crc_fast::CrcAlgorithm;
use sha2::Digest;

/// What the model calls when an object is deleted: its bucket and key.
pub type OnDelete = Arc<dyn Fn(&str, &str) + Send + Sync>;

#[derive(Default)]
struct State {
    buckets: BTreeSet<String>,
    objects: BTreeMap<(String, String), Vec<u8>>,
    gets: u64,
    puts: u64,
    last_put: Option<BTreeMap<String, String>>,
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

/// What a request carries besides its method and object: its headers (names
/// in lower case; an HTTP trailer sent with the body counts as one) and its
/// body as sent.
#[derive(Debug, Clone, Default)]
pub struct S3Content {
    /// The headers, by lower-case name.
    pub headers: BTreeMap<String, String>,
    /// The body, as sent (`aws-chunked` still encoded).
    pub body: Vec<u8>,
}

impl S3Content {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// The checksums a `PutObject` may carry (header or trailer); the model
/// verifies the first three and refuses the others.
const CHECKSUMS: [&str; 5] = [
    "x-amz-checksum-crc32",
    "x-amz-checksum-crc32c",
    "x-amz-checksum-sha256",
    "x-amz-checksum-sha1",
    "x-amz-checksum-crc64nvme",
];

/// The checksum `header` names of `data`, base64 as S3 spells it; `None`
/// for one the model does not compute.
pub fn checksum(header: &str, data: &[u8]) -> Option<String> {
    let raw: Vec<u8> = match header {
        "x-amz-checksum-crc32" => crc(CrcAlgorithm::Crc32IsoHdlc, data),
        "x-amz-checksum-crc32c" => crc(CrcAlgorithm::Crc32Iscsi, data),
        "x-amz-checksum-sha256" => sha2::Sha256::digest(data).to_vec(),
        _ => return None,
    };
    Some(aws_smithy_types::base64::encode(raw))
}

/// A 32-bit CRC's four bytes, big-endian as S3's header carries them.
fn crc(algorithm: CrcAlgorithm, data: &[u8]) -> Vec<u8> {
    let c = u32::try_from(crc_fast::checksum(algorithm, data)).expect("a 32-bit CRC");
    c.to_be_bytes().to_vec()
}

/// An object's `ETag`: 32 hex digits of its content's SHA-256 (S3's is the
/// MD5 of a single-part object; only its being a function of the content
/// matters here).
fn etag(body: &[u8]) -> String {
    format!("\"{}\"", hex::encode(&sha2::Sha256::digest(body)[..16]))
}

/// An `aws-chunked` body decoded: the data, and the trailers after the last
/// chunk.
fn decode_chunked(body: &[u8]) -> Result<(Vec<u8>, BTreeMap<String, String>), String> {
    fn line(body: &[u8], pos: usize) -> Result<(&[u8], usize), String> {
        let rest = body.get(pos..).ok_or("the body ends early")?;
        let end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a line without CRLF")?;
        Ok((&rest[..end], pos + end + 2))
    }
    let mut data = Vec::new();
    let mut pos = 0;
    loop {
        let (header, next) = line(body, pos)?;
        let header = std::str::from_utf8(header).map_err(|_| "a chunk header is not text")?;
        let size = header.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size, 16)
            .map_err(|_| format!("a chunk size that is not hex: {size:?}"))?;
        pos = next;
        if size == 0 {
            break;
        }
        let chunk = body
            .get(pos..pos + size)
            .ok_or("a chunk shorter than its size")?;
        data.extend_from_slice(chunk);
        pos += size;
        if body.get(pos..pos + 2) != Some(b"\r\n".as_slice()) {
            return Err("a chunk not followed by CRLF".to_owned());
        }
        pos += 2;
    }
    let mut trailers = BTreeMap::new();
    while pos < body.len() {
        let (text, next) = line(body, pos)?;
        pos = next;
        if text.is_empty() {
            break;
        }
        let text = std::str::from_utf8(text).map_err(|_| "a trailer is not text")?;
        let (name, value) = text.split_once(':').ok_or("a trailer without a colon")?;
        trailers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
    }
    Ok((data, trailers))
}

/// A `PutObject`'s object as S3 takes it: the body decoded (`aws-chunked`
/// or whole), its length and checksum checked; or S3's refusal.
fn put_body(content: &S3Content) -> Result<(Vec<u8>, BTreeMap<String, String>), S3Answer> {
    let invalid = |message: &str| error(400, "InvalidRequest", message);
    let incomplete = || {
        error(
            400,
            "IncompleteBody",
            "You did not provide the number of bytes specified by the Content-Length HTTP header.",
        )
    };
    let chunked = content
        .header("content-encoding")
        .is_some_and(|e| e.split(',').any(|p| p.trim() == "aws-chunked"))
        || content
            .header("x-amz-content-sha256")
            .is_some_and(|h| h.starts_with("STREAMING-"));
    let (data, trailers) = if chunked {
        let (data, trailers) = decode_chunked(&content.body)
            .map_err(|e| invalid(&format!("malformed aws-chunked body: {e}")))?;
        let declared = content
            .header("x-amz-decoded-content-length")
            .ok_or_else(|| {
                error(
                    411,
                    "MissingContentLength",
                    "You must provide the Content-Length HTTP header.",
                )
            })?;
        if declared.trim().parse::<usize>().ok() != Some(data.len()) {
            return Err(incomplete());
        }
        (data, trailers)
    } else {
        if let Some(length) = content.header("content-length")
            && length.trim().parse::<usize>().ok() != Some(content.body.len())
        {
            return Err(incomplete());
        }
        (content.body.clone(), BTreeMap::new())
    };
    if let Some(announced) = content.header("x-amz-trailer") {
        for name in announced.split(',').map(|n| n.trim().to_ascii_lowercase()) {
            if !trailers.contains_key(&name) {
                return Err(invalid(&format!(
                    "the trailer {name} was announced (x-amz-trailer) and not sent"
                )));
            }
        }
    }
    if content.header("content-md5").is_some() {
        return Err(invalid(
            "Content-MD5 is not verified by the simulator's model",
        ));
    }
    let mut checksums = BTreeMap::new();
    for name in CHECKSUMS {
        let Some(given) = trailers
            .get(name)
            .map(String::as_str)
            .or_else(|| content.header(name))
        else {
            continue;
        };
        let Some(actual) = checksum(name, &data) else {
            return Err(invalid(&format!(
                "{name} is not verified by the simulator's model"
            )));
        };
        if given != actual {
            let algorithm = name.trim_start_matches("x-amz-checksum-").to_uppercase();
            return Err(error(
                400,
                "BadDigest",
                &format!("The {algorithm} you specified did not match the calculated checksum."),
            ));
        }
        checksums.insert(name.to_owned(), actual);
    }
    Ok((data, checksums))
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

    /// `PutObject` calls that reached the model (stored or refused).
    pub fn puts(&self) -> u64 {
        self.state().puts
    }

    /// The headers of the last `PutObject` that reached the model.
    pub fn last_put_headers(&self) -> Option<BTreeMap<String, String>> {
        self.state().last_put.clone()
    }

    /// The object's content, if it exists.
    pub fn object(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        self.state()
            .objects
            .get(&(bucket.to_owned(), key.to_owned()))
            .cloned()
    }

    /// Answers one request without headers or body: `method` on
    /// `bucket`/`key`.
    pub fn handle(&self, method: &str, bucket: &str, key: &str) -> S3Answer {
        self.handle_with(method, bucket, key, &S3Content::default())
    }

    /// Answers one request: `method` on `bucket`/`key`, with its headers
    /// and body.
    pub fn handle_with(
        &self,
        method: &str,
        bucket: &str,
        key: &str,
        content: &S3Content,
    ) -> S3Answer {
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
                                ("etag", etag(body)),
                            ],
                            body: body.clone(),
                        },
                        None => error(404, "NoSuchKey", "The specified key does not exist."),
                    };
                }
                "PUT" => {
                    s.puts += 1;
                    s.last_put = Some(content.headers.clone());
                    let (data, checksums) = match put_body(content) {
                        Ok(put) => put,
                        Err(refused) => return refused,
                    };
                    let mut headers = vec![("etag", etag(&data))];
                    headers.extend(checksums.into_iter().filter_map(|(name, value)| {
                        CHECKSUMS.iter().find(|c| **c == name).map(|c| (*c, value))
                    }));
                    s.objects.insert(id, data);
                    return S3Answer {
                        status: 200,
                        headers,
                        body: Vec::new(),
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
