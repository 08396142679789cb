//! The simulated world of one run: the scenario drawn from the seed (events,
//! consumers, fault plan, scheduled crashes, drains and partitions), the
//! external API, and the two handlers (staged writes only, and an external
//! effect with an idempotency key).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqs_once::dynamodb_types::{AttributeValue, Put, TransactWriteItem};
use sqs_once::{Context, Effects, Handler, HandlerError, HandlerResult, Message};

use crate::faults::{Dice, FaultPlan, Life, Service};
use crate::trace::Trace;

/// The longest lease a run draws.
pub const LEASE: Duration = Duration::from_secs(60);
/// The source queue's visibility timeout (and the Lambda event source's)
/// where the run keeps the default deployment ([`Deployment`]).
pub const VISIBILITY: Duration = Duration::from_secs(30);
/// A Lambda invocation's timeout, by default.
pub const FUNCTION_TIMEOUT: Duration = Duration::from_secs(25);
/// A poller's receive-ahead (`PollerConfig::prefetch`), by default.
pub const PREFETCH: usize = 10;
/// A poller's drain deadline at shutdown, by default.
pub const DRAIN: Duration = Duration::from_secs(10);
/// The records' retention (`ProcessorConfig::ttl`) where the run keeps the
/// default: longer than any run, so no record expires.
pub const TTL: Duration = Duration::from_secs(24 * 3600);
/// Receives after which SQS moves a message to the DLQ.
pub const MAX_RECEIVE_COUNT: u32 = 10;
/// Both queues' `MaximumMessageSize` (small, so bodies near it are cheap).
pub const MAX_MESSAGE_BYTES: usize = 2048;

/// What the handler's effect is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A ledger row staged on the context (the fast path).
    Staged,
    /// A charge at the simulated API with the idempotency key (the claim path).
    External,
}

/// Where a run's consumers read the dedup key from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPlace {
    /// The body's `id` (`json:/id`), the default.
    Id,
    /// The id nested in the body (`json:/order/id`).
    Nested,
    /// A string message attribute (`attribute:event-id`).
    Attribute,
    /// A compound of the event's tenant (a string message attribute: its
    /// group) and the body's `id` (`attribute:tenant,json:/id`).
    Compound,
}

impl KeyPlace {
    /// The key source, as `SQS_ONCE_DEDUP_KEY` spells it.
    pub fn source(self) -> &'static str {
        match self {
            Self::Id => "json:/id",
            Self::Nested => "json:/order/id",
            Self::Attribute => "attribute:event-id",
            Self::Compound => "attribute:tenant,json:/id",
        }
    }
}

/// The event a dedup record's key (`sim#{key}`) stands for: the key itself,
/// or a compound key's last part (`{bytes}:{tenant}|{bytes}:{id}`; an event
/// id holds no `|`).
pub fn event_of_pk(pk: &str) -> String {
    let key = pk.trim_start_matches("sim#");
    match key.rsplit_once('|') {
        Some((_, last)) => last.split_once(':').map_or(last, |(_, id)| id).to_owned(),
        None => key.to_owned(),
    }
}

/// One logical event a producer sends.
#[derive(Debug, Clone)]
pub struct EventSpec {
    /// Its position in the run (and in its FIFO group).
    pub seq: u64,
    /// The dedup key (`json:/id`).
    pub id: String,
    /// FIFO message group.
    pub group: String,
    /// The body sent.
    pub body: String,
    /// The handler always fails it permanently (it must be parked).
    pub permanent: bool,
    /// When it is sent, from the start.
    pub send_at: Duration,
    /// When a producer sends it again, if it does.
    pub late_duplicate_at: Option<Duration>,
    /// The string message attributes it is sent with.
    pub attributes: BTreeMap<String, String>,
    /// Sent through S3, as an extended client sends a large body: the body
    /// stored as an object, a pointer to it sent ([`Scenario::draw_payloads`]).
    pub through_s3: bool,
}

/// The bucket the producer stores payloads in.
pub const PAYLOAD_BUCKET: &str = "sim-payloads";

/// The object key of the `n`th send of event `id` through S3.
pub fn payload_key(id: &str, n: usize) -> String {
    format!("payloads/{id}/{n}")
}

/// The event an object key (`payloads/{id}/{n}`) stands for.
pub fn event_of_payload_key(key: &str) -> Option<&str> {
    key.strip_prefix("payloads/")?.split('/').next()
}

/// The key prefix the hosts store large outgoing bodies under
/// (`SQS_ONCE_OUTBOX_PAYLOAD_BUCKET=sim-payloads/outbox/`).
pub const OUTBOX_PREFIX: &str = "outbox/";

/// The length of the padding of event `id`'s large outgoing body: above
/// SQS's 256 KiB, so the outbox stores the body in S3
/// ([`Scenario::draw_large_outgoing`]); a function of the event, so the
/// second stage can tell the body it got is the one sent.
pub fn outgoing_pad(id: &str) -> usize {
    let seq: usize = id.trim_start_matches("evt-").parse().unwrap_or(0);
    sqs_once::limits::SQS_DEFAULT_MAX_MESSAGE_BYTES + 512 + (seq * 977) % (8 * 1024)
}

/// Large payloads in a run: which events go through S3, and whether the
/// consumers delete the objects of finished messages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PayloadPlan {
    /// The consumers delete each finished message's object after the
    /// message (`SQS_ONCE_DELETE_PAYLOADS`).
    pub delete: bool,
}

/// Which runtime a consumer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// `sqs_once::poller::run` with this concurrency.
    Poller {
        /// Messages in flight at most.
        concurrency: usize,
    },
    /// Lambda invocations of up to this many records.
    Lambda {
        /// The event source mapping's batch size.
        batch: usize,
    },
}

/// One consumer host.
#[derive(Debug, Clone)]
pub struct ConsumerSpec {
    /// Its name in the trace.
    pub name: String,
    /// Its runtime.
    pub runtime: Runtime,
    /// Its clock's offset from true time, in ms (from its jump on, where
    /// it has one).
    pub skew_ms: i64,
    /// A step of its clock ([`Scenario::draw_clock_jumps`]): until `at`
    /// into the run its offset is `before_ms`, then `skew_ms`.
    pub jump: Option<ClockJump>,
    /// Its handler's effect: the run's kind, unless the run mixes them
    /// ([`Scenario::draw_mixed`]).
    pub kind: Kind,
}

/// A step of a host's clock, as a time sync that corrects it at once
/// does, forward or back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockJump {
    /// When, into the run.
    pub at: Duration,
    /// Its offset from true time until then, in ms.
    pub before_ms: i64,
}

impl ConsumerSpec {
    /// The most its clock runs ahead of true time at any point, in ms.
    pub fn most_ahead_ms(&self) -> u64 {
        let before = self.jump.map_or(0, |j| j.before_ms);
        self.skew_ms.max(before).max(0).unsigned_abs()
    }
}

/// Something done to a consumer at a scheduled time.
#[derive(Debug, Clone)]
pub enum Action {
    /// The host dies mid-whatever (its tasks freeze), and is restarted after `down`.
    Crash {
        /// Which consumer.
        consumer: usize,
        /// How long it stays down.
        down: Duration,
    },
    /// SIGTERM: the runtime drains and stops; restarted after `down`.
    Sigterm {
        /// Which consumer.
        consumer: usize,
        /// How long it stays down.
        down: Duration,
    },
    /// One service throttles half the calls of the host for a while
    /// ([`Scenario::draw_long_trouble`]).
    Storm {
        /// Which consumer.
        consumer: usize,
        /// Which service.
        service: Service,
        /// For how long.
        length: Duration,
    },
    /// DynamoDB refuses half the host's writes with a `TransactionConflict`
    /// for a while ([`Scenario::draw_conflict_storms`]).
    Conflicts {
        /// Which consumer.
        consumer: usize,
        /// For how long.
        length: Duration,
    },
    /// The host stops making and hearing requests for a while, its time
    /// running on ([`crate::faults::Link::freeze`]).
    Freeze {
        /// Which consumer.
        consumer: usize,
        /// For how long.
        length: Duration,
    },
    /// The host is cut off from SQS, DynamoDB or both for a while.
    Partition {
        /// Which consumer.
        consumer: usize,
        /// From what.
        services: Vec<Service>,
        /// For how long.
        length: Duration,
    },
}

/// Everything a run does, drawn from its seed.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// A FIFO queue (else standard).
    pub fifo: bool,
    /// The handler's effect.
    pub kind: Kind,
    /// The events, by seq.
    pub events: Vec<EventSpec>,
    /// The consumers.
    pub consumers: Vec<ConsumerSpec>,
    /// Faults in calls.
    pub plan: FaultPlan,
    /// Crashes, drains and partitions, by time.
    pub actions: Vec<(Duration, Action)>,
    /// How often a handler call panics.
    pub panic_rate: f64,
    /// How often a handler call runs long (up to beyond the lease and the
    /// visibility timeout).
    pub slow_rate: f64,
    /// The consumers' lease.
    pub lease: Duration,
    /// The consumers' heartbeat (below the lease less its margin).
    pub heartbeat: Duration,
    /// External handlers also stage a ledger row (committed with the
    /// completion), so the ledger check covers the claim path too.
    pub claim_stages: bool,
    /// What SQS might do besides (drawn last).
    pub might: crate::might::MightPlan,
    /// The source queue's redrive policy's `maxReceiveCount` (drawn from a
    /// dice of its own, see `crate::simulate`).
    pub max_receive_count: u32,
    /// The queue's and the runtimes' settings (drawn from a dice of their
    /// own, see [`Deployment::draw`]).
    pub deployment: Deployment,
    /// The records' retention, [`TTL`] unless the run draws a short one
    /// ([`Scenario::draw_ttl`]).
    pub ttl: Duration,
    /// The host whose clock is off by more than the lease margin, if one is
    /// ([`Scenario::draw_skew_beyond_margin`]): its attempts may overlap
    /// another's, and only fencing still holds for them.
    pub skew_beyond_margin: Option<String>,
    /// How often a handler call answers a transient error with a
    /// retry-after hint instead of making its effect (0 unless the run
    /// draws it: [`Scenario::draw_retry_after`]).
    pub retry_after: f64,
    /// Where the dedup key is read from ([`Scenario::draw_keys`]).
    pub key: KeyPlace,
    /// Handlers answer every other event with a result of 32 to 40 KiB,
    /// above `max_result_bytes` ([`Scenario::draw_large_results`]).
    pub large_results: bool,
    /// Large payloads through S3, if the run sends any
    /// ([`Scenario::draw_payloads`]).
    pub payloads: Option<PayloadPlan>,
    /// The events whose handler sends the second stage a body too large
    /// for SQS, which the outbox stores in S3 ([`Scenario::draw_large_outgoing`]);
    /// where there are any, the hosts send such bodies through S3.
    pub large_outgoing: BTreeSet<String>,
    /// An event whose first run on a poller takes hours, and how long
    /// ([`Scenario::draw_long_trouble`]).
    pub long_handler: Option<(String, Duration)>,
    /// A Lambda invocation that times out runs on in its execution
    /// environment, reused for the next invocations, instead of being
    /// killed ([`Scenario::draw_long_trouble`]).
    pub runs_on_after_timeout: bool,
}

/// What a deployment sets around the processor: the source queue's
/// visibility timeout, the Lambda function's timeout, a poller's
/// receive-ahead and drain deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deployment {
    /// The source queue's visibility timeout (what the event source mapping
    /// receives with; a poller receives with its lease).
    pub visibility: Duration,
    /// A Lambda invocation's timeout.
    pub function_timeout: Duration,
    /// A poller's receive-ahead.
    pub prefetch: usize,
    /// A poller's drain deadline at shutdown.
    pub drain: Duration,
}

impl Default for Deployment {
    fn default() -> Self {
        Self {
            visibility: VISIBILITY,
            function_timeout: FUNCTION_TIMEOUT,
            prefetch: PREFETCH,
            drain: DRAIN,
        }
    }
}

impl Deployment {
    /// Draws a deployment from `dice`, a stream of its own (so a seed's
    /// other draws are unchanged): half the runs keep the defaults, the
    /// others draw each setting from what a deployment would use. A function
    /// timeout of 15 s to 2 min (room for a batch of ten handlers of up to
    /// 1.5 s, and at least twice the Lambda margin, so a record's lease
    /// keeps the 300 ms margin the skews are drawn within); a visibility
    /// timeout from above both the function timeout (as the event source
    /// mapping requires) and the heartbeat (or the poller's start-up check
    /// warns) to six times the function timeout (the SAM template's ratio);
    /// a receive-ahead of 0 to 50; a drain of 15 s (below that, plus the 5 s
    /// cleanup, the long poll's 20 s: the runtime warns) to 90 s.
    pub fn draw(dice: &Dice, heartbeat: Duration) -> Self {
        if dice.chance(0.5) {
            return Self::default();
        }
        let function_timeout = dice.millis(Duration::from_secs(15), Duration::from_secs(120));
        let lowest = function_timeout.max(heartbeat) + Duration::from_secs(1);
        let visibility = dice.millis(lowest, (6 * function_timeout).max(lowest));
        let prefetch = [0, 1, 2, 5, 10, 20, 50][dice.int(0, 6) as usize];
        let drain = dice.millis(Duration::from_secs(15), Duration::from_secs(90));
        Self {
            visibility,
            function_timeout,
            prefetch,
            drain,
        }
    }

    /// What differs from the defaults, for the run's summary line.
    fn summary(&self) -> String {
        let default = Self::default();
        let mut out = String::new();
        if self.visibility != default.visibility {
            out += &format!(", visibility {:?}", self.visibility);
        }
        if self.function_timeout != default.function_timeout {
            out += &format!(", function timeout {:?}", self.function_timeout);
        }
        if self.prefetch != default.prefetch {
            out += &format!(", prefetch {}", self.prefetch);
        }
        if self.drain != default.drain {
            out += &format!(", drain {:?}", self.drain);
        }
        out
    }
}

/// Swarm knobs: per run, how much of each kind of trouble there is, so that
/// a run concentrates on a few fault classes at high rates instead of all of
/// them at low ones (a bug that needs two rare things at once is then found
/// in hundreds of seeds, not tens of thousands).
#[derive(Debug, Clone, Copy)]
struct Swarm {
    /// Share of events a producer sends again.
    duplicates: f64,
    /// Share of those sent again within a minute (the first copy may still run).
    soon: f64,
    /// Scheduled crashes, drains and partitions, at most.
    actions: u64,
}

impl Swarm {
    fn draw(dice: &Dice) -> Self {
        let pick = |options: &[f64]| options[dice.int(0, options.len() as u64 - 1) as usize];
        Self {
            duplicates: pick(&[0.0, 0.3, 0.3, 0.9]),
            soon: pick(&[0.5, 1.0]),
            actions: if dice.chance(0.3) { 30 } else { 10 },
        }
    }
}

/// The body of an event.
#[derive(Debug, serde::Deserialize)]
struct Body {
    id: String,
    permanent: bool,
}

impl Scenario {
    /// Draws a scenario.
    pub fn draw(dice: &Dice) -> Self {
        let lease = dice.millis(Duration::from_secs(10), LEASE);
        let margin = Duration::from_secs(3).min(lease / 10);
        let heartbeat = dice.millis(lease / 5, lease - margin - Duration::from_millis(500));
        let fifo = dice.chance(0.5);
        let kind = if dice.chance(0.5) {
            Kind::Staged
        } else {
            Kind::External
        };
        let mut consumers = (0..dice.int(1, 4))
            .map(|i| ConsumerSpec {
                kind,
                ..draw_consumer(dice, i)
            })
            .collect::<Vec<_>>();
        draw_skews(dice, &mut consumers, lease);
        let plan = FaultPlan {
            error: dice.rate(0.0, 0.15),
            lost: dice.rate(0.0, 0.10),
            timeout: dice.rate(0.0, 0.05),
            delay: dice.rate(0.0, 0.20),
            late: dice.rate(0.0, 0.05),
            max_delay: dice.millis(Duration::from_millis(200), Duration::from_secs(5)),
            // A swarm knob: half the runs have no pauses at all, the others
            // pause often enough that a write sent after its lease meets
            // another consumer's claim.
            pause: if dice.chance(0.5) {
                0.0
            } else {
                dice.rate(0.02, 0.15)
            },
            max_pause: 2 * lease + Duration::from_secs(10),
        };
        let swarm = Swarm::draw(dice);
        let groups = dice.int(1, 4);
        // Sent in seq order: a FIFO group's order is its send order.
        let spread = dice.millis(Duration::from_secs(1), Duration::from_secs(300));
        let mut times: Vec<Duration> = (0..dice.int(10, 80))
            .map(|_| dice.millis(Duration::ZERO, spread))
            .collect();
        times.sort();
        let events = times
            .into_iter()
            .enumerate()
            .map(|(seq, at)| draw_event(dice, seq as u64, groups, at, swarm))
            .collect();
        let actions = draw_actions(dice, consumers.len(), lease, swarm.actions);
        Self {
            fifo,
            kind,
            events,
            consumers,
            plan,
            actions,
            panic_rate: dice.rate(0.0, 0.05),
            slow_rate: if dice.chance(0.3) {
                dice.rate(0.2, 0.6)
            } else {
                dice.rate(0.0, 0.15)
            },
            lease,
            heartbeat,
            claim_stages: dice.chance(0.5),
            might: crate::might::MightPlan::draw(dice),
            max_receive_count: MAX_RECEIVE_COUNT,
            deployment: Deployment::default(),
            ttl: TTL,
            skew_beyond_margin: None,
            retry_after: 0.0,
            key: KeyPlace::Id,
            large_results: false,
            payloads: None,
            large_outgoing: BTreeSet::new(),
            long_handler: None,
            runs_on_after_timeout: false,
        }
    }

    /// A swarm knob, from a dice of its own: one run in five sends a third
    /// of its events, or all of them, through S3 as an SQS Extended Client
    /// does (the body stored as an object, a pointer with
    /// `ExtendedPayloadSize` sent; a producer's re-send stores its own
    /// object), and the consumers read them through the real `aws-sdk-s3`
    /// client over the wire; in three of those runs in four the consumers
    /// delete each finished message's object.
    pub fn draw_payloads(&mut self, dice: &Dice) {
        if !dice.chance(0.2) {
            return;
        }
        let share = if dice.chance(0.5) { 1.0 / 3.0 } else { 1.0 };
        self.payloads = Some(PayloadPlan {
            delete: dice.chance(0.75),
        });
        for e in &mut self.events {
            e.through_s3 = dice.chance(share);
        }
    }

    /// A swarm knob for chained runs, from a dice of its own: in one
    /// chained run in four the handlers send a third of the events' messages
    /// to the second stage, or all of them, with a body above SQS's 256 KiB
    /// ([`outgoing_pad`]); the hosts are configured as a user sending large
    /// bodies is (`SQS_ONCE_OUTBOX_PAYLOAD_BUCKET`), so the outbox stores
    /// each such body in S3 through the real `aws-sdk-s3` client over the
    /// wire (its faults drawn on the host's link) and sends a pointer, and
    /// the second stage reads the objects back.
    pub fn draw_large_outgoing(&mut self, dice: &Dice) {
        if !dice.chance(0.25) {
            return;
        }
        let share = if dice.chance(0.5) { 1.0 / 3.0 } else { 1.0 };
        for e in &self.events {
            if dice.chance(share) {
                self.large_outgoing.insert(e.id.clone());
            }
        }
    }

    /// A swarm knob, from a dice of its own: in one run in five the
    /// handlers answer every other event (even seq) with a result of 32 to
    /// 40 KiB, above the processor's `max_result_bytes` (32 KiB), which the
    /// record then keeps as a digest (`SimHandler::large_result`).
    pub fn draw_large_results(&mut self, dice: &Dice) {
        self.large_results = dice.chance(0.2);
    }

    /// A swarm knob, from a dice of its own: half the runs keep `json:/id`
    /// keys, the others read them from the body elsewhere, from a message
    /// attribute, or from a compound of an attribute and the body (a third
    /// each); there, one event in twenty-five is sent without its key (a
    /// permanent failure: it must be parked). One run in three sends
    /// unrelated message attributes besides.
    pub fn draw_keys(&mut self, dice: &Dice) {
        if dice.chance(0.5) {
            self.key = [KeyPlace::Nested, KeyPlace::Attribute, KeyPlace::Compound]
                [dice.int(0, 2) as usize];
        }
        let unrelated = dice.chance(1.0 / 3.0);
        for e in &mut self.events {
            let keyless = self.key != KeyPlace::Id && dice.chance(0.04);
            e.permanent |= keyless;
            let mut body: serde_json::Value =
                serde_json::from_str(&e.body).unwrap_or_else(|_| serde_json::json!({}));
            match self.key {
                KeyPlace::Id => {}
                KeyPlace::Nested if !keyless => body["order"] = serde_json::json!({ "id": e.id }),
                KeyPlace::Attribute if !keyless => {
                    e.attributes.insert("event-id".into(), e.id.clone());
                }
                KeyPlace::Compound if !keyless => {
                    e.attributes.insert("tenant".into(), e.group.clone());
                }
                _ => body["permanent"] = true.into(),
            }
            e.body = body.to_string();
            if unrelated {
                e.attributes.insert("source".into(), "sim-producer".into());
                let tag = format!("{:x}", dice.int(0, u64::from(u32::MAX)));
                e.attributes.insert("trace-tag".into(), tag);
            }
        }
    }

    /// The record key (`sim#{key}`) of the event `id`, under the run's key
    /// source.
    pub fn record_pk(&self, id: &str) -> String {
        match self.key {
            KeyPlace::Compound => {
                let group = self
                    .events
                    .iter()
                    .find(|e| e.id == id)
                    .map_or("", |e| e.group.as_str());
                format!("sim#{}:{group}|{}:{id}", group.len(), id.len())
            }
            _ => format!("sim#{id}"),
        }
    }

    /// A swarm knob, from a dice of its own: one run in four with two
    /// consumers or more draws each consumer's handler kind, so fast-path
    /// and claim-path consumers process messages of the same keys against
    /// the same records (at least one of each). Their claim-path handlers
    /// stage no row there: a ledger row is then a fast-path application.
    pub fn draw_mixed(&mut self, dice: &Dice) {
        if self.consumers.len() < 2 || !dice.chance(0.25) {
            return;
        }
        for c in &mut self.consumers {
            c.kind = if dice.chance(0.5) {
                Kind::Staged
            } else {
                Kind::External
            };
        }
        if !self.mixed() {
            let flip = dice.int(0, self.consumers.len() as u64 - 1) as usize;
            let c = &mut self.consumers[flip];
            c.kind = match c.kind {
                Kind::Staged => Kind::External,
                Kind::External => Kind::Staged,
            };
        }
    }

    /// Whether fast-path and claim-path consumers share the run's records.
    pub fn mixed(&self) -> bool {
        self.stages() && self.calls()
    }

    /// Whether some consumer runs the fast path (a ledger row per event).
    pub fn stages(&self) -> bool {
        self.runs(Kind::Staged)
    }

    /// Whether some consumer runs the claim path (a charge at the API).
    pub fn calls(&self) -> bool {
        self.runs(Kind::External)
    }

    /// Whether some consumer's handler is of `kind` (the run's kind, where
    /// the scenario names no consumer).
    fn runs(&self, kind: Kind) -> bool {
        if self.consumers.is_empty() {
            return self.kind == kind;
        }
        self.consumers.iter().any(|c| c.kind == kind)
    }

    /// A swarm knob, from a dice of its own: one run in four has its
    /// handler answer 5% to 30% of its calls with a transient error that
    /// carries a retry-after hint (`HandlerError::retry_after`), before
    /// making its effect, as a rate-limited API does; the hints are drawn
    /// per call ([`SimHandler::retry_after`]).
    pub fn draw_retry_after(&mut self, dice: &Dice) {
        if dice.chance(0.25) {
            self.retry_after = dice.rate(0.05, 0.3);
        }
    }

    /// A swarm knob, from a dice of its own: one run in ten sets one host's
    /// clock off by 1.5 to 10 times the lease margin (a host whose time
    /// sync failed), beyond what the lease promises to absorb. The others
    /// keep every skew within the margin ([`draw_skews`]).
    pub fn draw_skew_beyond_margin(&mut self, dice: &Dice) {
        if !dice.chance(0.1) {
            return;
        }
        let margin_ms = skew_margin_ms(&self.consumers, self.lease);
        let host = dice.int(0, self.consumers.len() as u64 - 1) as usize;
        let off = dice.int(margin_ms * 3 / 2, margin_ms * 10) as i64;
        self.consumers[host].skew_ms = if dice.chance(0.5) { off } else { -off };
        self.skew_beyond_margin = Some(self.consumers[host].name.clone());
    }

    /// A swarm knob, from a dice of its own: one run in five keeps its
    /// records only 3 to 20 minutes, short of the late duplicates (up to
    /// ten minutes after the first send) and of the redrive at the calm
    /// point, so records expire, DynamoDB's TTL deletes them, and copies
    /// arrive after their record's TTL (the documented limit). The others
    /// keep [`TTL`], which no run reaches.
    pub fn draw_ttl(&mut self, dice: &Dice) {
        if dice.chance(0.2) {
            self.ttl = dice.millis(Duration::from_secs(180), Duration::from_secs(1200));
        }
    }

    /// A swarm knob, from a dice of its own: clocks that step. Half the
    /// hosts whose clock is off beyond the margin
    /// ([`Scenario::draw_skew_beyond_margin`]) got there by a jump, 30 s
    /// to 10 minutes into the run, their clock within the margin until
    /// then; in one run in ten of the others, one host's clock steps,
    /// forward or back, to another offset within the margin (a time sync
    /// correcting it at once: wall-clock time that goes backwards).
    pub fn draw_clock_jumps(&mut self, dice: &Dice) {
        let margin_ms = skew_margin_ms(&self.consumers, self.lease);
        let half = margin_ms * 45 / 100;
        let within = |dice: &Dice| dice.int(0, 2 * half) as i64 - half as i64;
        let at = dice.millis(Duration::from_secs(30), Duration::from_secs(600));
        if let Some(host) = self.skew_beyond_margin.clone() {
            if dice.chance(0.5)
                && let Some(c) = self.consumers.iter_mut().find(|c| c.name == host)
            {
                c.jump = Some(ClockJump {
                    at,
                    before_ms: within(dice),
                });
            }
            return;
        }
        if dice.chance(0.1) {
            let host = dice.int(0, self.consumers.len() as u64 - 1) as usize;
            let c = &mut self.consumers[host];
            c.jump = Some(ClockJump {
                at,
                before_ms: c.skew_ms,
            });
            c.skew_ms = within(dice);
        }
    }

    /// A swarm knob, from a dice of its own: trouble that lasts. One run in
    /// ten cuts one consumer off from SQS alone for 5 to 15 minutes (from
    /// 1 to 10 minutes into the run), while DynamoDB stays in reach: its
    /// held messages' visibility runs out, its deletes cannot land, other
    /// consumers receive them. One run in ten with a poller makes one
    /// event's first run on a poller take 1 to 2.5 hours (a handler that
    /// runs for hours: its visibility and lease kept by the heartbeat the
    /// whole time, SQS's 12 hours from the receive the only cap; Lambda
    /// functions stop at 15 minutes, so not there). One run in five
    /// freezes a host for 2 s to 90 s, and one run in three with a Lambda
    /// consumer lets its invocations run on after they time out.
    pub fn draw_long_trouble(&mut self, dice: &Dice) {
        if dice.chance(0.1) {
            let consumer = dice.int(0, self.consumers.len() as u64 - 1) as usize;
            let at = dice.millis(Duration::from_secs(60), Duration::from_secs(600));
            let length = dice.millis(Duration::from_secs(300), Duration::from_secs(900));
            self.actions.push((
                at,
                Action::Partition {
                    consumer,
                    services: vec![Service::Sqs],
                    length,
                },
            ));
            self.actions.sort_by_key(|(at, _)| *at);
        }
        // Sustained throttling: one run in five, one to three storms, each
        // of one consumer's calls to SQS or DynamoDB, 20 s to 3 minutes.
        if dice.chance(0.2) {
            for _ in 0..dice.int(1, 3) {
                let consumer = dice.int(0, self.consumers.len() as u64 - 1) as usize;
                let at = dice.millis(Duration::from_secs(1), Duration::from_secs(600));
                let service = if dice.chance(0.5) {
                    Service::Sqs
                } else {
                    Service::Ddb
                };
                let length = dice.millis(Duration::from_secs(20), Duration::from_secs(180));
                self.actions.push((
                    at,
                    Action::Storm {
                        consumer,
                        service,
                        length,
                    },
                ));
            }
            self.actions.sort_by_key(|(at, _)| *at);
        }
        let poller = self
            .consumers
            .iter()
            .any(|c| matches!(c.runtime, Runtime::Poller { .. }));
        if dice.chance(0.1) && poller && !self.events.is_empty() {
            let event = dice.int(0, self.events.len() as u64 - 1) as usize;
            let took = dice.millis(Duration::from_secs(3600), Duration::from_secs(9000));
            self.long_handler = Some((self.events[event].id.clone(), took));
        }
        // Stop-the-world pauses: one run in five, one or two, 2 s to 90 s.
        if dice.chance(0.2) {
            for _ in 0..dice.int(1, 2) {
                let consumer = dice.int(0, self.consumers.len() as u64 - 1) as usize;
                let at = dice.millis(Duration::from_secs(1), Duration::from_secs(600));
                let length = dice.millis(Duration::from_secs(2), Duration::from_secs(90));
                self.actions.push((at, Action::Freeze { consumer, length }));
            }
            self.actions.sort_by_key(|(at, _)| *at);
        }
        // (Drawn last: the draws above keep their schedules.) One run in
        // three with a Lambda consumer: an invocation that
        // times out is not killed. Its environment is reused and its tasks
        // run on beside the next invocations (their calls answered late,
        // its handler finishing, its commits and deletes landing after the
        // event source mapping gave its records up).
        let lambda = self
            .consumers
            .iter()
            .any(|c| matches!(c.runtime, Runtime::Lambda { .. }));
        self.runs_on_after_timeout = lambda && dice.chance(1.0 / 3.0);
    }

    /// Sustained contention (from `dice`, a stream of its own, so the
    /// other draws keep their schedules): one run in six, one or two
    /// storms of 20 s to 3 minutes in which DynamoDB refuses half the
    /// writes with a `TransactionConflict`, each of one consumer's writes
    /// or (one in three) every consumer's, as when other writers keep
    /// transactions on the same items. The store answers `Busy` after
    /// every attempt was refused, and the message comes back after the
    /// short contention backoff: its receives run out faster than under
    /// throttling, toward the DLQ and the redrive.
    pub fn draw_conflict_storms(&mut self, dice: &Dice) {
        if !dice.chance(1.0 / 6.0) {
            return;
        }
        for _ in 0..dice.int(1, 2) {
            let at = dice.millis(Duration::from_secs(1), Duration::from_secs(600));
            let length = dice.millis(Duration::from_secs(20), Duration::from_secs(180));
            let consumers = if dice.chance(1.0 / 3.0) {
                (0..self.consumers.len()).collect()
            } else {
                vec![dice.int(0, self.consumers.len() as u64 - 1) as usize]
            };
            for consumer in consumers {
                self.actions
                    .push((at, Action::Conflicts { consumer, length }));
            }
        }
        self.actions.sort_by_key(|(at, _)| *at);
    }

    /// Draws the knobs added after the scenario's first draws from `knobs`,
    /// a dice of their own, so that a seed keeps the rest of its schedule:
    /// half the runs keep SQS's `maxReceiveCount` at 10, the others draw it
    /// from 3 to 9 (fewer receives to spend before the DLQ).
    pub fn draw_knobs(&mut self, knobs: &Dice) {
        if knobs.chance(0.5) {
            self.max_receive_count = u32::try_from(knobs.int(3, 9)).unwrap_or(MAX_RECEIVE_COUNT);
        }
    }

    /// One line saying what the run is.
    pub fn summary(&self) -> String {
        let consumers: Vec<String> = self
            .consumers
            .iter()
            .map(|c| {
                let jump = c.jump.map_or(String::new(), |j| {
                    format!(" ({}ms until {:?})", j.before_ms, j.at)
                });
                format!("{}={:?}/skew {}ms{jump}", c.name, c.runtime, c.skew_ms)
            })
            .collect();
        format!(
            "scenario: lease {:?}, heartbeat {:?}, {} queue, {:?} handler{}, {} events, consumers [{}], faults {:?}, panic {:.3}, slow {:.3}, {} actions, SQS might: {}",
            self.lease,
            self.heartbeat,
            if self.fifo { "FIFO" } else { "standard" },
            self.kind,
            if self.kind == Kind::External && self.claim_stages {
                " staging a row"
            } else {
                ""
            },
            self.events.len(),
            consumers.join(", "),
            self.plan,
            self.panic_rate,
            self.slow_rate,
            self.actions.len(),
            self.might.summary()
        ) + &if self.max_receive_count == MAX_RECEIVE_COUNT {
            String::new()
        } else {
            format!(", maxReceiveCount {}", self.max_receive_count)
        } + &self.deployment.summary()
            + &if self.ttl == TTL {
                String::new()
            } else {
                format!(", TTL {:?}", self.ttl)
            }
            + if self.skew_beyond_margin.is_some() {
                ", a skew beyond the margin"
            } else {
                ""
            }
            + &self.breadth_summary()
    }

    /// The breadth knobs' part of the summary: what differs from the defaults.
    fn breadth_summary(&self) -> String {
        let mut out = String::new();
        if self.mixed() {
            let kinds: Vec<String> = self
                .consumers
                .iter()
                .map(|c| format!("{}={:?}", c.name, c.kind))
                .collect();
            out += &format!(", handler kinds mixed [{}]", kinds.join(", "));
        }
        if self.retry_after > 0.0 {
            out += &format!(", retry-after {:.3}", self.retry_after);
        }
        if self.large_results {
            out += ", large results";
        }
        if self.runs_on_after_timeout {
            out += ", timed-out invocations run on";
        }
        if let Some(p) = self.payloads {
            let n = self.events.iter().filter(|e| e.through_s3).count();
            out += &format!(
                ", {n} events through S3{}",
                if p.delete { " (objects deleted)" } else { "" }
            );
        }
        if !self.large_outgoing.is_empty() {
            out += &format!(
                ", {} large outgoing bodies through S3",
                self.large_outgoing.len()
            );
        }
        if self.key != KeyPlace::Id {
            out += &format!(", key {}", self.key.source());
        }
        if self
            .events
            .iter()
            .any(|e| e.attributes.contains_key("source"))
        {
            out += ", unrelated attributes";
        }
        out
    }
}

fn draw_consumer(dice: &Dice, i: u64) -> ConsumerSpec {
    let runtime = if dice.chance(0.5) {
        Runtime::Poller {
            concurrency: dice.int(1, 6) as usize,
        }
    } else {
        Runtime::Lambda {
            batch: dice.int(1, 10) as usize,
        }
    };
    ConsumerSpec {
        name: format!("c{i}"),
        runtime,
        skew_ms: 0,
        jump: None,
        kind: Kind::Staged,
    }
}

/// Clock offsets within the promise: two hosts may disagree by less than the
/// lease margin. The margin is 3 s, at most a tenth of the lease granted; a
/// Lambda claim near the end of its invocation gets a lease of 3 s or so (a
/// record is not started with less left), hence a margin of 300 ms.
fn draw_skews(dice: &Dice, consumers: &mut [ConsumerSpec], lease: Duration) {
    let margin_ms = skew_margin_ms(consumers, lease);
    // Each host within 45% of the margin: any two within 90% of it.
    let half = margin_ms * 45 / 100;
    for c in consumers {
        c.skew_ms = dice.int(0, 2 * half) as i64 - half as i64;
    }
}

/// The lease margin the skews are measured against: 300 ms where a Lambda
/// runs (see [`draw_skews`]), else the run's (3 s, at most a tenth of the
/// lease).
fn skew_margin_ms(consumers: &[ConsumerSpec], lease: Duration) -> u64 {
    let lambda = consumers
        .iter()
        .any(|c| matches!(c.runtime, Runtime::Lambda { .. }));
    if lambda {
        300
    } else {
        Duration::from_secs(3).min(lease / 10).as_millis() as u64
    }
}

fn draw_event(dice: &Dice, seq: u64, groups: u64, send_at: Duration, swarm: Swarm) -> EventSpec {
    let id = format!("evt-{seq:04}");
    let group = format!("g{}", dice.int(0, groups - 1));
    let permanent = dice.chance(0.05);
    let mut body = serde_json::json!({"id": id, "seq": seq, "group": group, "permanent": permanent, "pad": ""});
    if dice.chance(0.05) {
        // Near the size limit: some just under, some just over (refused).
        let base = body.to_string().len();
        let target = MAX_MESSAGE_BYTES + 40 - dice.int(0, 240) as usize;
        body["pad"] = serde_json::Value::String("x".repeat(target.saturating_sub(base)));
    }
    // Half of the duplicates soon (the first copy may still be running), half
    // up to ten minutes later (past FIFO's deduplication window).
    let late_duplicate_at = dice.chance(swarm.duplicates).then(|| {
        let within = if dice.chance(swarm.soon) { 60 } else { 600 };
        send_at + dice.millis(Duration::ZERO, Duration::from_secs(within))
    });
    EventSpec {
        seq,
        id,
        group,
        body: body.to_string(),
        permanent,
        send_at,
        late_duplicate_at,
        attributes: BTreeMap::new(),
        through_s3: false,
    }
}

fn draw_actions(
    dice: &Dice,
    consumers: usize,
    lease: Duration,
    most: u64,
) -> Vec<(Duration, Action)> {
    let mut actions: Vec<(Duration, Action)> = (0..dice.int(0, most))
        .map(|_| {
            let at = dice.millis(Duration::from_secs(1), Duration::from_secs(600));
            let consumer = dice.int(0, consumers as u64 - 1) as usize;
            let down = dice.millis(Duration::from_secs(1), Duration::from_secs(90));
            let action = match dice.int(0, 4) {
                0 => Action::Crash { consumer, down },
                1 => Action::Sigterm { consumer, down },
                n => Action::Partition {
                    consumer,
                    services: match n {
                        2 => vec![Service::Sqs],
                        3 => vec![Service::Ddb],
                        _ => vec![Service::Sqs, Service::Ddb],
                    },
                    // Up to twice the lease.
                    length: dice.millis(Duration::from_secs(1), 2 * lease),
                },
            };
            (at, action)
        })
        .collect();
    actions.sort_by_key(|(at, _)| *at);
    actions
}

/// One call at the simulated API.
#[derive(Debug, Clone)]
pub struct ApiCall {
    /// The idempotency key.
    pub key: String,
    /// The event (for messages).
    pub event: String,
    /// The SQS message whose delivery called.
    pub message: String,
    /// Who called.
    pub consumer: String,
    /// The claim's attempt number the call was made under.
    pub attempt: u32,
    /// When the call started and ended (ms of virtual time; `None`: still open).
    pub start_ms: u128,
    /// When it ended.
    pub end_ms: Option<u128>,
    /// The event's record said `COMPLETED` when the call started: the
    /// effect was made again for an event already done.
    pub after_completed: bool,
}

#[derive(Debug, Default)]
struct ApiState {
    /// Charges by idempotency key: (event, how many times it was charged).
    charges: BTreeMap<String, (String, u32)>,
    calls: Vec<ApiCall>,
}

/// When an event's record was completed, if it is (ms from the run's start).
type CompletedAt = dyn Fn(&str) -> Option<u128> + Send + Sync;

/// The external API: honours idempotency keys (a key is charged once; later
/// calls get the first answer) and records every call with its times.
#[derive(Clone)]
pub struct SimApi {
    state: Arc<Mutex<ApiState>>,
    trace: Trace,
    /// When an event's record was completed, ms from the run's start
    /// (looked up at each call): `None` while it is not.
    completed: Arc<CompletedAt>,
}

impl std::fmt::Debug for SimApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimApi").finish_non_exhaustive()
    }
}

/// Closes a call when the caller goes away (answer, interruption or death).
struct OpenCall {
    api: SimApi,
    index: usize,
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        let now = self.api.trace.now_ms();
        let mut s = self.api.lock();
        if let Some(c) = s.calls.get_mut(self.index)
            && c.end_ms.is_none()
        {
            c.end_ms = Some(now);
        }
    }
}

impl SimApi {
    /// An API with no calls; `completed` says whether an event is done.
    pub fn new(
        trace: Trace,
        completed: impl Fn(&str) -> Option<u128> + Send + Sync + 'static,
    ) -> Self {
        Self {
            state: Arc::default(),
            trace,
            completed: Arc::new(completed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ApiState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A charge for `event` with `key`, answered after `latency`; `who` is
    /// the consumer and the claim's attempt number.
    async fn charge(
        &self,
        key: &str,
        event: &str,
        message: &str,
        who: (&str, u32),
        latency: Duration,
    ) -> u32 {
        let (consumer, attempt) = who;
        let after_completed = (self.completed)(event).is_some();
        let index = {
            let mut s = self.lock();
            s.calls.push(ApiCall {
                after_completed,
                key: key.to_owned(),
                event: event.to_owned(),
                message: message.to_owned(),
                consumer: consumer.to_owned(),
                attempt,
                start_ms: self.trace.now_ms(),
                end_ms: None,
            });
            let charge = s
                .charges
                .entry(key.to_owned())
                .or_insert((event.to_owned(), 0));
            if charge.1 == 0 {
                charge.1 = 1;
            }
            s.calls.len() - 1
        };
        self.trace.event(format!("api {consumer} charge {event}"));
        let _open = OpenCall {
            api: self.clone(),
            index,
        };
        tokio::time::sleep(latency).await;
        self.lock().charges.get(key).map_or(0, |c| c.1)
    }

    /// When `event`'s record was completed (ms from the run's start), if it is.
    pub fn completed_at(&self, event: &str) -> Option<u128> {
        (self.completed)(event)
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<ApiCall> {
        self.lock().calls.clone()
    }

    /// Charges by key: (event, times charged).
    pub fn charges(&self) -> BTreeMap<String, (String, u32)> {
        self.lock().charges.clone()
    }
}

/// Live handler calls of one host generation, and the most at once.
#[derive(Debug, Default)]
pub struct Gauge {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Gauge {
    fn enter(self: &Arc<Self>) -> GaugeGuard {
        let live = self.live.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(live, Ordering::Relaxed);
        GaugeGuard(self.clone())
    }

    /// The most handler calls at once.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

struct GaugeGuard(Arc<Gauge>);

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The handler of one host generation, of the run's kind.
pub struct SimHandler {
    /// The run's handler kind.
    pub kind: Kind,
    /// The host's name.
    pub consumer: String,
    /// The host's life: a dead host's handler makes no more progress.
    pub life: Life,
    /// The run's dice.
    pub dice: Dice,
    /// The API (external effects).
    pub api: SimApi,
    /// The trace.
    pub trace: Trace,
    /// Live calls of this generation.
    pub gauge: Arc<Gauge>,
    /// How often a call panics.
    pub panic_rate: f64,
    /// How often a call runs long.
    pub slow_rate: f64,
    /// The lease (slow calls run up to twice it).
    pub lease: Duration,
    /// External calls also stage a ledger row.
    pub claim_stages: bool,
    /// A chained run's second stage: each event sends one message there.
    pub next_url: Option<String>,
    /// Once the run is calm, no call runs longer than this (Lambda: half
    /// the function's timeout). A handler slower than its function's
    /// timeout on every receive is a misconfiguration no redrive mends;
    /// before the calm point such calls are drawn, to exercise the
    /// deadline's interruption, and the receives they spend are explained.
    pub calm_cap: Option<Duration>,
    /// How often a call answers a transient error with a retry-after hint,
    /// and the dice its draws come from (its own: a run that does not draw
    /// the knob keeps its schedule).
    pub retry_after: Option<(f64, Dice)>,
    /// The run draws large results ([`Scenario::draw_large_results`]).
    pub large_results: bool,
    /// The events whose message to the second stage has a large body
    /// ([`Scenario::draw_large_outgoing`]).
    pub large_outgoing: Arc<BTreeSet<String>>,
    /// On a poller, the event whose first run takes hours, how long
    /// ([`Scenario::draw_long_trouble`]), and whether that run has started
    /// (shared by the run's hosts).
    pub long: Option<(String, Duration, Arc<std::sync::atomic::AtomicBool>)>,
}

impl SimHandler {
    /// How long attempt `attempt` of event `id` runs: drawn, or the hours
    /// of the run's long handler on the first attempt of its event's first
    /// run on a poller (drawn all the same, so the dice stream stays as it
    /// was).
    fn took(&self, id: &str, attempt: u32) -> Duration {
        match &self.long {
            Some((event, long, started))
                if event == id && attempt == 1 && !started.swap(true, Ordering::Relaxed) =>
            {
                let _ = self.duration();
                *long
            }
            _ => self.duration(),
        }
    }

    fn duration(&self) -> Duration {
        if self.dice.chance(self.slow_rate) {
            let longest = 2 * self.lease + Duration::from_secs(10);
            let calm = tokio::time::Instant::now() >= self.trace.start() + crate::CALM_AT;
            let longest = match self.calm_cap {
                Some(cap) if calm => longest.min(cap),
                _ => longest,
            };
            self.dice.millis(Duration::ZERO, longest)
        } else {
            self.dice
                .millis(Duration::ZERO, Duration::from_millis(1500))
        }
    }

    /// The handler's result: `result`, or where the run draws large
    /// results and the event's seq is even, a result of 32 to 40 KiB
    /// (its size a function of the event).
    fn large_result(
        &self,
        id: &str,
        result: Option<serde_json::Value>,
    ) -> Option<serde_json::Value> {
        let seq: usize = id.trim_start_matches("evt-").parse().unwrap_or(1);
        if !self.large_results || seq % 2 == 1 {
            return result;
        }
        let pad = 32 * 1024 + (seq * 977) % (8 * 1024);
        Some(serde_json::json!({ "event": id, "receipt": "r".repeat(pad), "result": result }))
    }

    /// A retry-after hint, where this call draws one: none, up to 5 s, or
    /// up to 15 minutes (a tenth each of the hints).
    fn retry_after(&self) -> Option<Duration> {
        let (rate, dice) = self.retry_after.as_ref()?;
        if !dice.chance(*rate) {
            return None;
        }
        Some(match dice.int(0, 9) {
            0 => Duration::ZERO,
            9 => dice.millis(Duration::from_secs(5), Duration::from_secs(900)),
            _ => dice.millis(Duration::ZERO, Duration::from_secs(5)),
        })
    }

    async fn run(&self, message: &Message, ctx: &Context) -> HandlerResult {
        let body: Body = message.json().map_err(HandlerError::permanent)?;
        if self.kind == Kind::Staged
            && message.receive_count() > 1
            && let Some(done_ms) = self.api.completed_at(&body.id)
        {
            self.trace.rerun(
                message.id(),
                message.receive_count(),
                &self.consumer,
                &body.id,
                done_ms,
            );
        }
        let _live = self.gauge.enter();
        let took = self.took(&body.id, ctx.attempt());
        if took > Duration::from_millis(1500) {
            self.trace.event_trouble(&body.id, took);
        }
        self.trace.event(format!(
            "handler {} {} attempt {} for {took:?}",
            self.consumer,
            body.id,
            ctx.attempt()
        ));
        // Sent before the handler can still fail: nothing may go out for an
        // effect that does not commit.
        if let Some(next) = &self.next_url {
            // Names the delivery that sent it: only the run whose effect
            // committed may have its message sent.
            let mut sent = serde_json::json!({ "id": body.id, "by": message.id() });
            if self.large_outgoing.contains(&body.id) {
                // Too large for SQS: the outbox stores it in S3. The
                // external handler stores it before its effect, as the
                // library advises a claim-path handler to
                // (`Context::send_large`); the staged one leaves it to the
                // processor, which stores it once the handler returns.
                sent["pad"] = serde_json::Value::String("p".repeat(outgoing_pad(&body.id)));
                let large = sqs_once::outbox::Outgoing::new(next, sent.to_string());
                match self.kind {
                    Kind::External => ctx.send_large(large).await?,
                    Kind::Staged => ctx.send_message(large)?,
                }
            } else {
                ctx.send(next, sent.to_string())?;
            }
        }
        // Once the run is calm the handler neither panics nor asks to be
        // retried: with few receives (`maxReceiveCount` 3), a handler that
        // fails on each of them after the redrive ends in the DLQ again
        // whatever the library does. (The panic is still drawn, so the
        // dice stream before the calm point is the same.)
        let calm = tokio::time::Instant::now() >= self.trace.start() + crate::CALM_AT;
        if self.dice.chance(self.panic_rate) && !calm {
            self.trace.event_trouble(&body.id, Duration::ZERO);
            panic!("simulated handler panic");
        }
        if body.permanent {
            return Err(HandlerError::permanent("declined (a permanent failure)"));
        }
        if let Some(hint) = self.retry_after().filter(|_| !calm) {
            self.trace.event(format!(
                "handler {} {} retry after {hint:?}",
                self.consumer, body.id
            ));
            self.trace.event_trouble(&body.id, hint);
            return Err(HandlerError::retry_after(hint, "rate limited"));
        }
        match self.kind {
            Kind::Staged => {
                self.life.guard(tokio::time::sleep(took)).await;
                ctx.stage(ledger_row(&body.id, message.id(), &self.consumer)?);
                Ok(self.large_result(&body.id, None))
            }
            Kind::External => {
                if self.claim_stages {
                    ctx.stage(ledger_row(&body.id, message.id(), &self.consumer)?);
                }
                let key = ctx.idempotency_key().unwrap_or_default();
                let charged = self
                    .life
                    .guard(self.api.charge(
                        key,
                        &body.id,
                        message.id(),
                        (&self.consumer, ctx.attempt()),
                        took,
                    ))
                    .await;
                let result = serde_json::json!({ "charged": charged });
                Ok(self.large_result(&body.id, Some(result)))
            }
        }
    }
}

/// The ledger row an event stages, naming the message that made it.
fn ledger_row(id: &str, message: &str, by: &str) -> Result<TransactWriteItem, HandlerError> {
    let put = Put::builder()
        .table_name("ledger")
        .item("pk", AttributeValue::S(id.to_owned()))
        .item("message", AttributeValue::S(message.to_owned()))
        .item("by", AttributeValue::S(by.to_owned()))
        .build()
        .map_err(HandlerError::permanent)?;
    Ok(TransactWriteItem::builder().put(put).build())
}

/// The effect a staged ledger row is: its event and message, and when it
/// committed (`at_ms`, from the run's start).
pub fn row_effect(item: &TransactWriteItem, at_ms: u128) -> Option<crate::check::Effect> {
    let item = item.put()?.item();
    let text = |name: &str| item.get(name)?.as_s().ok().cloned();
    Some(crate::check::Effect {
        event: text("pk")?,
        message: text("message")?,
        at_ms,
        by: text("by").unwrap_or_default(),
    })
}

impl Handler for SimHandler {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        self.run(message, ctx).await
    }

    fn effects(&self) -> Effects {
        match self.kind {
            Kind::Staged => Effects::StagedOnly,
            Kind::External => Effects::External,
        }
    }
}
