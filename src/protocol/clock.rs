//! Wall-clock time as a parameter, so expiry and leases can be tested without waiting.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time. Leases and expiry are decided by comparing with
/// this clock, never by trusting DynamoDB's lazy TTL deletion.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> SystemTime;

    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64 {
        to_ms(self.now())
    }
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<SystemTime>>);

impl ManualClock {
    /// A manual clock starting at the current system time.
    pub fn starting_now() -> Self {
        Self(Arc::new(Mutex::new(SystemTime::now())))
    }

    /// Sets the clock, backwards too (a request built earlier arriving late).
    pub fn set(&self, to: SystemTime) {
        *self.0.lock().expect("clock lock") = to;
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let mut t = self.0.lock().expect("clock lock");
        *t += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().expect("clock lock")
    }
}

/// Milliseconds since the Unix epoch (0 for times before it).
pub(crate) fn to_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Wall-clock time that follows tokio's clock from a starting point: with
/// tokio's time paused (tests, simulation) it moves only as virtual time does,
/// so leases judged by the store and timers in the runtime agree.
#[derive(Debug, Clone)]
pub struct TokioClock {
    start: SystemTime,
    at: tokio::time::Instant,
}

impl TokioClock {
    /// A clock reading `start` now.
    pub fn starting_at(start: SystemTime) -> Self {
        Self {
            start,
            at: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> SystemTime {
        self.start + self.at.elapsed()
    }
}
