//! The run's history as text lines stamped with virtual time: what `--seed`
//! prints, and what the determinism check hashes.

use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// The trace of one run. Clones share it.
#[derive(Debug, Clone)]
pub struct Trace {
    inner: Arc<Mutex<TraceInner>>,
    start: Instant,
}

#[derive(Debug)]
struct TraceInner {
    hasher: Sha256,
    lines: Option<Vec<String>>,
    count: u64,
}

impl Trace {
    /// A trace starting now; keeps its lines only when `keep` (else only
    /// their hash).
    pub fn new(keep: bool) -> Self {
        Self {
            inner: Arc::new(Mutex::new(TraceInner {
                hasher: Sha256::new(),
                lines: keep.then(Vec::new),
                count: 0,
            })),
            start: Instant::now(),
        }
    }

    /// Virtual milliseconds since the start.
    pub fn now_ms(&self) -> u128 {
        self.start.elapsed().as_millis()
    }

    /// Records one event.
    pub fn event(&self, what: impl AsRef<str>) {
        let line = format!("{:>10.3}s {}", self.now_ms() as f64 / 1000.0, what.as_ref());
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.hasher.update(line.as_bytes());
        t.hasher.update(b"\n");
        t.count += 1;
        if let Some(lines) = t.lines.as_mut() {
            lines.push(line);
        }
    }

    /// The hash of every line so far (hex), and how many.
    pub fn hash(&self) -> (String, u64) {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (hex::encode(t.hasher.clone().finalize()), t.count)
    }

    /// The kept lines (empty when not kept).
    pub fn lines(&self) -> Vec<String> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.lines.clone().unwrap_or_default()
    }
}
