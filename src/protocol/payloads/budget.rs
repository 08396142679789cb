//! The payload budget: how many large payload bytes the process holds at
//! once, across every message in flight (`SQS_ONCE_PAYLOAD_BUDGET_BYTES`).
//!
//! Each payload's bytes are granted before its object is read (as many as
//! its pointer declares, more if the object turns out longer: the read is
//! cut off at the grant, the grant given back, and the object read again
//! under a grant of its size) and given back when its message is finished
//! with. A message whose payload does not fit what is left waits, kept
//! invisible; one whose payload can never fit is parked. Without a budget
//! the process may hold concurrency x `SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget's unit: permits are KiB, so a budget up to 4 TiB fits the
/// semaphore's `u32` requests.
const UNIT: usize = 1024;

/// Of the memory the process may use, the share left to everything but
/// the payloads' bytes as read: two thirds, for one more copy of each
/// payload held (a `handler_fn` handler is handed its own copy of the
/// message; an envelope's payload is taken out beside the body it came in)
/// and the rest of the process (the runtime, the SDK's buffers). The
/// budget is the remaining third.
pub const KEPT_FOR_THE_REST: &str = "2/3";

/// A memory limit at least this large is none (cgroup v1 writes
/// 9223372036854771712 for "unlimited").
const UNLIMITED: u64 = 1 << 50;

/// A budget on the large payload bytes held at once across the process.
#[derive(Debug)]
pub struct PayloadBudget {
    bytes: usize,
    units: u32,
    permits: Arc<Semaphore>,
    held: AtomicUsize,
    high_water: AtomicUsize,
}

/// Bytes of a [`PayloadBudget`] held by one payload, given back when dropped.
#[derive(Debug)]
pub struct PayloadGrant {
    budget: Arc<PayloadBudget>,
    units: u32,
    permit: OwnedSemaphorePermit,
}

impl PayloadGrant {
    /// How many bytes the grant covers (at least what was asked for).
    pub fn bytes(&self) -> usize {
        self.units as usize * UNIT
    }
}

impl PayloadGrant {
    /// Gives back what the grant holds beyond `bytes` (a payload read under
    /// a grant of the whole budget, its pointer declaring no size, holds
    /// only what it turned out to be while its message runs).
    pub fn shrink_to(&mut self, bytes: usize) {
        let keep = PayloadBudget::units_for(bytes)
            .unwrap_or(self.units)
            .min(self.units);
        let excess = self.units - keep;
        if excess == 0 {
            return;
        }
        if let Some(extra) = self.permit.split(excess as usize) {
            drop(extra);
            self.budget
                .held
                .fetch_sub(excess as usize * UNIT, Ordering::SeqCst);
            self.units = keep;
        }
    }
}

impl Drop for PayloadGrant {
    fn drop(&mut self) {
        self.budget
            .held
            .fetch_sub(self.units as usize * UNIT, Ordering::SeqCst);
    }
}

impl PayloadBudget {
    /// A budget of `bytes` (rounded down to whole KiB, at least one).
    pub fn new(bytes: usize) -> Self {
        let units = u32::try_from(bytes / UNIT)
            .unwrap_or(u32::MAX)
            .clamp(1, u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        Self {
            bytes: units as usize * UNIT,
            units,
            permits: Arc::new(Semaphore::new(units as usize)),
            held: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
        }
    }

    /// The budget, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The bytes granted now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// The most bytes ever granted at once.
    pub fn high_water(&self) -> usize {
        self.high_water.load(Ordering::SeqCst)
    }

    fn units_for(bytes: usize) -> Option<u32> {
        u32::try_from(bytes.div_ceil(UNIT)).ok()
    }

    /// Whether a payload of `bytes` can ever be granted.
    pub fn fits(&self, bytes: usize) -> bool {
        Self::units_for(bytes).is_some_and(|u| u <= self.units)
    }

    /// The grant of `bytes` if they are free now.
    pub fn try_grant(self: &Arc<Self>, bytes: usize) -> Option<PayloadGrant> {
        let units = Self::units_for(bytes).filter(|u| *u <= self.units)?;
        let permit = self.permits.clone().try_acquire_many_owned(units).ok()?;
        Some(self.granted(units, permit))
    }

    /// A grant of `bytes`, once they are free (first come, first served: a
    /// large request holds back the smaller ones behind it); `None` when
    /// they can never be ([`Self::fits`]).
    pub async fn grant(self: &Arc<Self>, bytes: usize) -> Option<PayloadGrant> {
        let units = Self::units_for(bytes).filter(|u| *u <= self.units)?;
        let permit = self
            .permits
            .clone()
            .acquire_many_owned(units)
            .await
            .expect("the budget's semaphore is never closed");
        Some(self.granted(units, permit))
    }

    fn granted(self: &Arc<Self>, units: u32, permit: OwnedSemaphorePermit) -> PayloadGrant {
        let held =
            self.held.fetch_add(units as usize * UNIT, Ordering::SeqCst) + units as usize * UNIT;
        self.high_water.fetch_max(held, Ordering::SeqCst);
        PayloadGrant {
            budget: self.clone(),
            units,
            permit,
        }
    }
}

/// The budget a process gets, and what it was taken from (logged at
/// start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FittedBudget {
    /// The budget in bytes; `None`: no budget.
    pub bytes: Option<usize>,
    /// What it was taken from.
    pub from: String,
}

/// Where the memory a process may use is read from: the Lambda function's
/// memory size and the container's cgroup limit, as found.
#[derive(Debug, Clone, Default)]
pub struct MemoryLimits {
    /// `AWS_LAMBDA_FUNCTION_MEMORY_SIZE`, in MB (MiB).
    pub lambda_mb: Option<String>,
    /// `/sys/fs/cgroup/memory.max` (cgroup v2): bytes or `max`.
    pub cgroup_v2: Option<String>,
    /// `/sys/fs/cgroup/memory/memory.limit_in_bytes` (cgroup v1).
    pub cgroup_v1: Option<String>,
    /// `/proc/meminfo` (its `MemTotal`): the host's memory, when no
    /// cgroup limit is found (a Fargate task runs in a VM of its own, whose
    /// memory is about the task's, while its container's cgroup may carry
    /// no limit).
    pub meminfo: Option<String>,
}

impl MemoryLimits {
    /// Read from this process's environment and file system.
    pub fn of_this_process() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        Self {
            lambda_mb: std::env::var("AWS_LAMBDA_FUNCTION_MEMORY_SIZE").ok(),
            cgroup_v2: read("/sys/fs/cgroup/memory.max"),
            cgroup_v1: read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
            meminfo: read("/proc/meminfo"),
        }
    }

    /// The memory limit in bytes and where it was found; `None`: no limit.
    pub fn limit(&self) -> Option<(u64, &'static str)> {
        let number = |text: &Option<String>| {
            text.as_deref()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .filter(|n| *n > 0 && *n < UNLIMITED)
        };
        if let Some(mb) = number(&self.lambda_mb) {
            return Some((mb * 1024 * 1024, "AWS_LAMBDA_FUNCTION_MEMORY_SIZE"));
        }
        if let Some(n) = number(&self.cgroup_v2) {
            return Some((n, "/sys/fs/cgroup/memory.max"));
        }
        if let Some(n) = number(&self.cgroup_v1) {
            return Some((n, "/sys/fs/cgroup/memory/memory.limit_in_bytes"));
        }
        let total_kib = self.meminfo.as_deref().and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        });
        total_kib
            .filter(|k| *k > 0)
            .map(|k| (k * 1024, "/proc/meminfo MemTotal"))
    }
}

/// The budget: `explicit` when set (`0`: none), else a third of the memory
/// limit (two thirds kept for the rest of the process, see
/// [`KEPT_FOR_THE_REST`]): the Lambda function's memory size, the cgroup
/// limit (v2, else v1), else the host's memory; none when none is found.
pub fn fit(explicit: Option<usize>, limits: &MemoryLimits) -> FittedBudget {
    match explicit {
        Some(0) => FittedBudget {
            bytes: None,
            from: "SQS_ONCE_PAYLOAD_BUDGET_BYTES=0: no budget".into(),
        },
        Some(bytes) => FittedBudget {
            bytes: Some(bytes),
            from: "SQS_ONCE_PAYLOAD_BUDGET_BYTES".into(),
        },
        None => match limits.limit() {
            Some((limit, from)) => FittedBudget {
                bytes: Some(usize::try_from(limit / 3).unwrap_or(usize::MAX)),
                from: format!(
                    "a third of the memory limit of {limit} bytes ({from}); two thirds kept for a copy of each payload and the rest of the process"
                ),
            },
            None => FittedBudget {
                bytes: None,
                from: "no memory limit found (no Lambda memory size, no cgroup limit, no /proc/meminfo): no budget; set SQS_ONCE_PAYLOAD_BUDGET_BYTES".into(),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(lambda: Option<&str>, v2: Option<&str>, v1: Option<&str>) -> MemoryLimits {
        MemoryLimits {
            lambda_mb: lambda.map(str::to_owned),
            cgroup_v2: v2.map(str::to_owned),
            cgroup_v1: v1.map(str::to_owned),
            meminfo: None,
        }
    }

    #[test]
    fn a_grant_shrunk_to_what_was_read_gives_the_rest_back() {
        let budget = Arc::new(PayloadBudget::new(1024 * 1024));
        // A pointer without a size: the whole budget, until the read.
        let mut whole = budget.try_grant(1024 * 1024).expect("free");
        assert!(budget.try_grant(1).is_none(), "all of it is held");
        whole.shrink_to(10 * 1024 + 1);
        assert_eq!(budget.held(), 11 * 1024, "rounded up to whole KiB");
        let other = budget
            .try_grant(512 * 1024)
            .expect("the rest is free again");
        drop(whole);
        assert_eq!(budget.held(), 512 * 1024);
        drop(other);
        assert_eq!(budget.held(), 0);
        assert!(
            budget.try_grant(1024 * 1024).is_some(),
            "every byte given back"
        );
    }

    #[test]
    fn the_budget_is_fitted_to_the_memory_the_process_has() {
        let mib = 1024 * 1024;
        let lambda = fit(None, &limits(Some("256"), Some("max\n"), None));
        assert_eq!(lambda.bytes, Some(256 * mib / 3));
        assert!(
            lambda.from.contains("AWS_LAMBDA_FUNCTION_MEMORY_SIZE"),
            "{}",
            lambda.from
        );
        let v2 = fit(None, &limits(None, Some("805306368\n"), None));
        assert_eq!(v2.bytes, Some(256 * mib));
        assert!(v2.from.contains("memory.max"));
        let v1 = fit(None, &limits(None, None, Some("1610612736\n")));
        assert_eq!(v1.bytes, Some(512 * mib));
        // "max", and cgroup v1's huge "unlimited": no limit there.
        assert_eq!(fit(None, &limits(None, Some("max\n"), None)).bytes, None);
        assert_eq!(
            fit(None, &limits(None, None, Some("9223372036854771712\n"))).bytes,
            None
        );
        assert_eq!(fit(None, &MemoryLimits::default()).bytes, None);
        // Then the host's memory.
        let host = MemoryLimits {
            meminfo: Some("MemTotal:        3145728 kB\nMemFree:  1 kB\n".into()),
            ..limits(None, Some("max\n"), None)
        };
        let fitted = fit(None, &host);
        assert_eq!(fitted.bytes, Some(1024 * mib));
        assert!(fitted.from.contains("MemTotal"), "{}", fitted.from);
        let ecs = MemoryLimits {
            cgroup_v2: Some("536870912\n".into()),
            ..host
        };
        assert_eq!(
            fit(None, &ecs).bytes,
            Some(512 * mib / 3),
            "the cgroup's first"
        );
        // An explicit setting wins; 0 is none.
        let explicit = fit(Some(1000 * 1024), &limits(Some("256"), None, None));
        assert_eq!(explicit.bytes, Some(1000 * 1024));
        assert_eq!(fit(Some(0), &limits(Some("256"), None, None)).bytes, None);
    }

    #[tokio::test]
    async fn grants_stay_within_the_budget_and_are_given_back() {
        let budget = Arc::new(PayloadBudget::new(10 * UNIT));
        assert!(budget.fits(10 * UNIT));
        assert!(!budget.fits(10 * UNIT + 1));
        assert!(budget.grant(10 * UNIT + 1).await.is_none());
        let a = budget.grant(6 * UNIT).await.unwrap();
        assert!(budget.try_grant(5 * UNIT).is_none());
        let b = budget.try_grant(4 * UNIT - 10).unwrap();
        assert_eq!(b.bytes(), 4 * UNIT);
        assert_eq!(budget.held(), 10 * UNIT);
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.grant(5 * UNIT).await.map(|g| g.bytes()) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(a);
        assert_eq!(waiting.await.unwrap(), Some(5 * UNIT));
        drop(b);
        assert_eq!(budget.held(), 0);
        assert_eq!(budget.high_water(), 10 * UNIT);
    }
}
