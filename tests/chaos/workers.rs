//! The processes under test (pollers, or local Lambda event sources with the
//! function behind them) and the faults done to them, each on its own clock.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Mutex;

use crate::Rng;
use crate::proxy::Faults;

/// One process: what starts it, and the running child.
pub struct Slot {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    child: Option<tokio::process::Child>,
    started: Instant,
}

impl Slot {
    pub fn new(program: &str, args: Vec<String>, env: Vec<(String, String)>) -> Self {
        Self {
            program: program.to_owned(),
            args,
            env,
            child: None,
            started: Instant::now(),
        }
    }
}

/// What happened to the processes.
#[derive(Default)]
pub struct Counts {
    pub kills: AtomicU64,
    pub kills_during_drain: AtomicU64,
    pub kills_during_refusal: AtomicU64,
    pub terms: AtomicU64,
    pub unclean_terms: AtomicU64,
    pub function_kills: AtomicU64,
    pub freezes: AtomicU64,
    pub timeouts: AtomicU64,
    pub refusals: AtomicU64,
    pub panics: AtomicU64,
    pub draining: AtomicU32,
    /// Exits nobody caused, with their status.
    pub unexpected_exits: std::sync::Mutex<Vec<String>>,
}

pub struct Workers {
    pub slots: Vec<Mutex<Slot>>,
    pub counts: Counts,
    pub lambda: bool,
    /// Set by [`Workers::stop_all`]: nothing is restarted after it.
    stopping: AtomicBool,
}

/// Sends `signal` (e.g. "-KILL") to a process id.
fn signal(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// The child processes of `pid` (the function behind a local event source).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

impl Workers {
    pub fn new(slots: Vec<Slot>, lambda: bool) -> Arc<Self> {
        Arc::new(Self {
            slots: slots.into_iter().map(Mutex::new).collect(),
            counts: Counts::default(),
            lambda,
            stopping: AtomicBool::new(false),
        })
    }

    fn spawn(self: &Arc<Self>, slot: &mut Slot) {
        let mut c = tokio::process::Command::new(&slot.program);
        c.args(&slot.args)
            .envs(slot.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = c.spawn().expect("start a process under test");
        let stderr = child.stderr.take().unwrap();
        let me = self.clone();
        // `CHAOS_LOG_DIR`: every process's stderr kept, a file per process
        // id (appended to: an id used again keeps what was there).
        let mut kept = std::env::var_os("CHAOS_LOG_DIR").and_then(|dir| {
            let name = format!("{}.log", child.id().unwrap_or_default());
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(std::path::Path::new(&dir).join(name))
                .ok()
        });
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(f) = kept.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(f, "{line}");
                }
                if line.contains("handler panicked") {
                    me.counts.panics.fetch_add(1, Ordering::Relaxed);
                } else if line.contains("timed out after") {
                    me.counts.timeouts.fetch_add(1, Ordering::Relaxed);
                } else if line.contains("ERROR") && std::env::var_os("CHAOS_VERBOSE").is_some() {
                    eprintln!("{line}");
                }
            }
        });
        slot.child = Some(child);
        slot.started = Instant::now();
    }

    pub async fn start_all(self: &Arc<Self>) {
        for s in &self.slots {
            self.spawn(&mut *s.lock().await);
        }
    }

    /// SIGKILL process `i` and start it again.
    pub async fn kill(self: &Arc<Self>, i: usize, faults: &Faults) {
        let mut slot = self.slots[i].lock().await;
        let Some(mut child) = slot.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            for f in children_of(pid) {
                signal(f, "-KILL");
            }
        }
        let _ = child.kill().await;
        let c = &self.counts;
        c.kills.fetch_add(1, Ordering::Relaxed);
        if c.draining.load(Ordering::Relaxed) > 0 {
            c.kills_during_drain.fetch_add(1, Ordering::Relaxed);
        }
        if faults.is_refusing() {
            c.kills_during_refusal.fetch_add(1, Ordering::Relaxed);
        }
        self.spawn(&mut slot);
    }

    /// SIGTERM process `i`, wait (up to 30 s, without holding the others) for
    /// it to exit 0, then start it again.
    pub async fn terminate(self: &Arc<Self>, i: usize) {
        let mut child = {
            let mut slot = self.slots[i].lock().await;
            // A signal before a process has installed any handler kills it
            // whatever the program does: give a just-started one 2 s.
            tokio::time::sleep_until((slot.started + Duration::from_secs(2)).into()).await;
            let Some(child) = slot.child.take() else {
                return;
            };
            self.counts.draining.fetch_add(1, Ordering::SeqCst);
            child
        };
        let c = &self.counts;
        c.terms.fetch_add(1, Ordering::Relaxed);
        if let Some(pid) = child.id() {
            signal(pid, "-TERM");
        }
        let exited = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        c.draining.fetch_sub(1, Ordering::SeqCst);
        if !matches!(exited, Ok(Ok(s)) if s.success()) {
            eprintln!("chaos: a poller did not exit 0 within 30 s of SIGTERM: {exited:?}");
            c.unclean_terms.fetch_add(1, Ordering::Relaxed);
            let _ = child.kill().await;
        }
        if !self.stopping.load(Ordering::SeqCst) {
            self.spawn(&mut *self.slots[i].lock().await);
        }
    }

    /// The function process behind event source `i`, if one is running.
    async fn function_of(&self, i: usize) -> Option<u32> {
        let slot = self.slots[i].lock().await;
        let pid = slot.child.as_ref()?.id()?;
        children_of(pid).into_iter().next()
    }

    /// SIGKILL the function behind event source `i` (mid-batch, if one runs).
    pub async fn kill_function(&self, i: usize) {
        if let Some(pid) = self.function_of(i).await {
            signal(pid, "-KILL");
            self.counts.function_kills.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// SIGSTOP the function behind event source `i` for `hold` (past the
    /// function timeout: the invocation times out and the function is
    /// replaced), then SIGCONT it in case it was idle.
    pub async fn freeze_function(&self, i: usize, hold: Duration) {
        if let Some(pid) = self.function_of(i).await {
            signal(pid, "-STOP");
            self.counts.freezes.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(hold).await;
            signal(pid, "-CONT");
        }
    }

    /// Records (and restarts) processes that exited without being told to.
    pub async fn watch_exits(self: &Arc<Self>) {
        for s in &self.slots {
            let mut slot = s.lock().await;
            let exited = slot
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                let what = format!("{} exited on its own with {status}", slot.program);
                eprintln!("chaos: {what}");
                self.counts.unexpected_exits.lock().unwrap().push(what);
                self.spawn(&mut slot);
            }
        }
    }

    /// Stops every process: SIGTERM and up to 30 s to exit (pollers); the
    /// function then the event source (Lambda).
    pub async fn stop_all(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let mut children = Vec::new();
        for s in &self.slots {
            if let Some(c) = s.lock().await.child.take() {
                children.push(c);
            }
        }
        // Let SIGTERMs in progress finish their drain (30 s at most each).
        let until = Instant::now() + Duration::from_secs(35);
        while self.counts.draining.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for c in &children {
            if let Some(pid) = c.id() {
                if self.lambda {
                    children_of(pid)
                        .into_iter()
                        .for_each(|f| signal(f, "-KILL"));
                }
                signal(pid, "-TERM");
            }
        }
        for mut c in children {
            let _ = tokio::time::timeout(Duration::from_secs(30), c.wait()).await;
            let _ = c.kill().await;
        }
    }
}

/// How often each fault happens (seconds between, drawn uniformly).
pub struct Schedule {
    pub kill: Option<(u64, u64)>,
    pub term: Option<(u64, u64)>,
    pub refuse: (u64, u64),
    pub refuse_for: Duration,
    pub function_kill: Option<(u64, u64)>,
    pub freeze: Option<((u64, u64), Duration)>,
}

/// Sleeps a random time within `range` seconds (in tenths); false once `stop` is set.
async fn pause(rng: &mut Rng, range: (u64, u64), stop: &AtomicBool) -> bool {
    let tenths = range.0 * 10 + rng.below(((range.1 - range.0) * 10 + 1) as usize) as u64;
    let until = Instant::now() + Duration::from_millis(tenths * 100);
    while Instant::now() < until {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    !stop.load(Ordering::Relaxed)
}

/// Starts one task per kind of fault, each on its own clock (so they overlap),
/// and the watch for unexpected exits. They end when `stop` is set.
pub fn schedule(
    workers: &Arc<Workers>,
    faults: &Arc<Faults>,
    plan: Schedule,
    seed: u64,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let n = workers.slots.len();
    let mut tasks = Vec::new();
    let mut each = |k: u64, range: Option<(u64, u64)>, what: u8| {
        let Some(range) = range else { return };
        let (w, f, stop) = (workers.clone(), faults.clone(), stop.clone());
        let mut rng = Rng((seed ^ k.wrapping_mul(0x9E37_79B9)) | 1);
        let freeze_for = plan.freeze.map(|f| f.1).unwrap_or_default();
        let refuse_for = plan.refuse_for;
        tasks.push(tokio::spawn(async move {
            while pause(&mut rng, range, &stop).await {
                let i = rng.below(n);
                match what {
                    0 => w.kill(i, &f).await,
                    1 => {
                        // Its own task: the drain runs while other faults go on.
                        let w = w.clone();
                        tokio::spawn(async move { w.terminate(i).await });
                    }
                    2 => {
                        f.refuse();
                        w.counts.refusals.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(refuse_for).await;
                        f.accept();
                    }
                    3 => w.kill_function(i).await,
                    _ => w.freeze_function(i, freeze_for).await,
                }
            }
        }));
    };
    each(1, plan.kill, 0);
    each(2, plan.term, 1);
    each(3, Some(plan.refuse), 2);
    each(4, plan.function_kill, 3);
    each(5, plan.freeze.map(|f| f.0), 4);
    let (w, stop) = (workers.clone(), stop.clone());
    tasks.push(tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            w.watch_exits().await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }));
    tasks
}
