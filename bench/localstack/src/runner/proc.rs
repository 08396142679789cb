//! What the OS says of a process: CPU seconds and resident memory from /proc, and stopping it.

pub(crate) fn rss_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// utime + stime of a process, seconds.
pub(crate) fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

pub(crate) fn descendants(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
        out.extend(descendants(c));
    }
    out
}

pub(crate) fn localstack_cpu() -> f64 {
    let pidfile = format!(
        "{}/../../localstack/.state/localstack.pid",
        env!("CARGO_MANIFEST_DIR")
    );
    let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|p| p.trim().parse().ok())
    else {
        return f64::NAN;
    };
    descendants(pid).into_iter().map(cpu_secs).sum()
}

/// User + system CPU seconds of this process's children that have ended and
/// been waited for (`cutime` + `cstime` of /proc/self/stat).
pub(crate) fn children_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(13).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(14).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}
