//! A model of DynamoDB behind its JSON 1.0 protocol (`X-Amz-Target:
//! DynamoDB_20120810.<Op>`), for the operations the project sends:
//! `GetItem`, `PutItem`, `UpdateItem`, `DeleteItem`, `TransactWriteItems`
//! (`Put`, `Update`, `Delete`, `ConditionCheck`), `DescribeTable` and
//! `DescribeTimeToLive`. It evaluates the condition and update expressions
//! with [`super::expr`], each staged write's own condition inside a
//! transaction, `ReturnValues` and `ReturnValuesOnConditionCheckFailure`, and
//! honours a transaction's `ClientRequestToken` for ten minutes: the same
//! token with the same request answers as the first did without applying
//! again, with another request `IdempotentParameterMismatchException`, and
//! while the first is still being applied `TransactionInProgressException`.
//!
//! Errors have the documented shapes (`__type`, `message`, and for a
//! cancelled transaction `CancellationReasons`, one per item).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use sqs_once::limits::DYNAMODB_MAX_ITEM_BYTES as MAX_ITEM_BYTES;

use super::expr::{self, Av, Invalid, Item, Placeholders};

/// How long DynamoDB remembers a transaction's client request token.
pub const TOKEN_WINDOW: Duration = Duration::from_secs(600);

/// An answer on the wire: HTTP status and JSON body.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The JSON body.
    pub body: Value,
}

impl Answer {
    fn ok(body: Value) -> Self {
        Self { status: 200, body }
    }
}

/// The errors the model answers with.
#[derive(Debug, Clone)]
pub enum DdbError {
    /// `ValidationException` (400).
    Validation(String),
    /// `ConditionalCheckFailedException` (400), with the old item when asked for.
    ConditionFailed(Option<Item>),
    /// `TransactionCanceledException` (400) with one reason per item.
    Cancelled(Vec<Reason>),
    /// `ResourceNotFoundException` (400).
    NotFound,
    /// `IdempotentParameterMismatchException` (400).
    Mismatch,
    /// `TransactionInProgressException` (400).
    InProgress,
    /// `ThrottlingException` (400).
    Throttling,
    /// `ProvisionedThroughputExceededException` (400).
    Provisioned,
    /// `TransactionConflictException` (400): a single-item write to an item
    /// a transaction is writing.
    Conflict,
    /// `InternalServerError` (500).
    Internal,
}

/// A cancellation reason of one transaction item.
#[derive(Debug, Clone)]
pub struct Reason {
    /// `None`, `ConditionalCheckFailed`, `TransactionConflict`,
    /// `ValidationError`, `ThrottlingError`, ...
    pub code: &'static str,
    /// The old item, for a failed condition asking `ALL_OLD`.
    pub item: Option<Item>,
    /// The reason's message.
    pub message: Option<String>,
}

impl Reason {
    fn none() -> Self {
        Self {
            code: "None",
            item: None,
            message: None,
        }
    }
}

impl From<Invalid> for DdbError {
    fn from(e: Invalid) -> Self {
        Self::Validation(e.0)
    }
}

/// `TransactionCanceledException` (400) with one reason per item.
fn cancelled(reasons: &[Reason]) -> Answer {
    let dynamo = "com.amazonaws.dynamodb.v20120810";
    let codes: Vec<&str> = reasons.iter().map(|r| r.code).collect();
    let message = format!(
        "Transaction cancelled, please refer cancellation reasons for specific reasons [{}]",
        codes.join(", ")
    );
    let reasons: Vec<Value> = reasons
        .iter()
        .map(|r| {
            let mut v = json!({ "Code": r.code });
            if let Some(m) = &r.message {
                v["Message"] = m.clone().into();
            }
            if let Some(item) = &r.item {
                v["Item"] = expr::item_to_json(item);
            }
            v
        })
        .collect();
    Answer {
        status: 400,
        body: json!({
            "__type": format!("{dynamo}#TransactionCanceledException"),
            "Message": message,
            "CancellationReasons": reasons,
        }),
    }
}

impl DdbError {
    /// The error as DynamoDB sends it.
    pub fn answer(&self) -> Answer {
        let dynamo = "com.amazonaws.dynamodb.v20120810";
        let (status, kind, message) = match self {
            Self::Validation(m) => (
                400,
                "com.amazon.coral.validate#ValidationException".to_owned(),
                m.clone(),
            ),
            Self::ConditionFailed(_) => (
                400,
                format!("{dynamo}#ConditionalCheckFailedException"),
                "The conditional request failed".to_owned(),
            ),
            Self::Cancelled(reasons) => return cancelled(reasons),
            Self::NotFound => (
                400,
                format!("{dynamo}#ResourceNotFoundException"),
                "Requested resource not found".to_owned(),
            ),
            Self::Mismatch => (
                400,
                format!("{dynamo}#IdempotentParameterMismatchException"),
                "The request uses the same client token as a previous, but non-identical request."
                    .to_owned(),
            ),
            Self::InProgress => (
                400,
                format!("{dynamo}#TransactionInProgressException"),
                "The transaction with the given request token is already in progress.".to_owned(),
            ),
            Self::Throttling => (
                400,
                "com.amazon.coral.availability#ThrottlingException".to_owned(),
                "Rate of requests exceeds the allowed throughput.".to_owned(),
            ),
            Self::Provisioned => (
                400,
                format!("{dynamo}#ProvisionedThroughputExceededException"),
                "The level of configured provisioned throughput for the table was exceeded."
                    .to_owned(),
            ),
            Self::Conflict => (
                400,
                format!("{dynamo}#TransactionConflictException"),
                "Transaction is ongoing for the item".to_owned(),
            ),
            Self::Internal => (
                500,
                format!("{dynamo}#InternalServerError"),
                "Internal server error".to_owned(),
            ),
        };
        let mut body = json!({ "__type": kind, "message": message });
        if let Self::ConditionFailed(Some(item)) = self {
            body["Item"] = expr::item_to_json(item);
        }
        Answer { status, body }
    }
}

/// A table: its key attribute, its items, its TTL attribute.
#[derive(Debug, Clone)]
struct Table {
    key: String,
    ttl: Option<String>,
    items: BTreeMap<String, Item>,
}

/// A transaction's token as DynamoDB keeps it.
#[derive(Debug, Clone)]
struct Token {
    request: Value,
    at: Instant,
    /// `None` while the first request is being applied.
    answer: Option<Answer>,
}

#[derive(Debug, Default)]
struct State {
    tables: BTreeMap<String, Table>,
    tokens: HashMap<String, Token>,
    /// Items put into tables other than the fenced one by committed
    /// transactions, in commit order (the staged writes' rows), with the
    /// instant each committed.
    committed: Vec<(String, Item, Instant)>,
    /// The table whose writes are watched for fencing.
    fenced: Option<String>,
    /// Writes that changed a record another owner held in progress.
    breaches: Vec<String>,
    /// When each record of the fenced table became `COMPLETED` (the
    /// model's time, not the writer's `:now_ms`, which a paused or resent
    /// request carries from before it was applied).
    completions: HashMap<String, Instant>,
    /// `COMPLETED` records of the fenced table that a write replaced with
    /// another owner's (a claim or a fast-path commit, which the store's
    /// conditions allow only past `expires_at` by the writer's clock): the
    /// key, the old `expires_at` and when. And records TTL deleted
    /// ([`DynamoModel::sweep_expired`]), with the instant they were deleted.
    ended_by_ttl: Vec<(String, i64, Instant)>,
    /// Requests applied (not answered from a token).
    applied: u64,
    /// The highest `fence` each record of the fenced table has held,
    /// deleted ones included: a write that stores one not above it is a
    /// breach.
    fences: HashMap<String, i128>,
    /// The check of each record write's `expires_at`
    /// ([`DynamoModel::expect_ttl`]).
    ttl: TtlWatch,
}

/// The store call a write of a record comes from, told from the record
/// before and after it: each sets `expires_at` from its writer's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stamp {
    /// A claim (a record taken: new, or from another owner or state).
    Claim,
    /// A completion of the holder's claim.
    Complete,
    /// The holder's claim marked failed.
    Fail,
    /// The holder's lease extended.
    Extend,
    /// A fast-path commit (a new record, or one written over).
    Fast,
}

/// The check that every record write carries the configured TTL: its
/// `expires_at` is its writer's clock, as the store read it for the call,
/// in whole seconds plus the TTL. The hosts' stores note each call's
/// reading ([`DynamoModel::stamp`]), read in the same poll as the store's
/// own (no virtual time passes between), so the check is exact whatever
/// the host's skew or jumps and however late the request lands.
#[derive(Debug, Default)]
struct TtlWatch {
    /// The configured TTL, whole seconds.
    expected_s: Option<i64>,
    /// The writer's clock (ms) of each store call, by (key, owner, call).
    stamps: HashMap<(String, String, Stamp), Vec<i64>>,
    /// Keys whose record holds an `expires_at` found wrong: TTL ending it
    /// excuses nothing (noted as a breach, not as an end).
    wrong: HashSet<String>,
    /// What was found wrong, described.
    breaches: Vec<String>,
}

impl TtlWatch {
    /// Whether TTL may end `key`'s record as an excuse (its `expires_at`
    /// passed the check); if not, the end is noted as a breach.
    fn may_end(&mut self, key: &str, how: &str) -> bool {
        if !self.wrong.remove(key) {
            return true;
        }
        self.breaches.push(format!(
            "{key}: its record, written with a wrong expires_at, {how}"
        ));
        false
    }
}

/// The DynamoDB model. Clones share the tables.
#[derive(Debug, Clone, Default)]
pub struct DynamoModel(Arc<Mutex<State>>);

/// One write of a request, parsed and checked, ready to evaluate.
struct Write {
    table: String,
    /// The table's key attribute.
    key_attr: String,
    key: String,
    kind: WriteKind,
    condition: Option<expr::Cond>,
    all_old_on_failure: bool,
    /// The request's `:owner`, if it carries one (for the fencing history).
    owner: Option<String>,
}

enum WriteKind {
    Put(Item),
    Update(expr::Update),
    Delete,
    Check,
}

fn text<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get(field).and_then(Value::as_str)
}

fn names_of(v: &Value) -> Result<HashMap<String, String>, DdbError> {
    let Some(m) = v.get("ExpressionAttributeNames") else {
        return Ok(HashMap::new());
    };
    let m = m
        .as_object()
        .ok_or_else(|| DdbError::Validation("ExpressionAttributeNames is not a map".into()))?;
    if m.is_empty() {
        return Err(DdbError::Validation(
            "ExpressionAttributeNames must not be empty".into(),
        ));
    }
    m.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_owned())),
            None => Err(DdbError::Validation(
                "an attribute name is not a string".into(),
            )),
        })
        .collect()
}

fn values_of(v: &Value) -> Result<HashMap<String, Av>, DdbError> {
    let Some(m) = v.get("ExpressionAttributeValues") else {
        return Ok(HashMap::new());
    };
    let m = m
        .as_object()
        .ok_or_else(|| DdbError::Validation("ExpressionAttributeValues is not a map".into()))?;
    if m.is_empty() {
        return Err(DdbError::Validation(
            "ExpressionAttributeValues must not be empty".into(),
        ));
    }
    m.iter()
        .map(|(k, v)| Ok((k.clone(), Av::from_json(v)?)))
        .collect()
}

impl DynamoModel {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Creates a table keyed by the string attribute `key`, with TTL on `ttl`.
    pub fn create_table(&self, name: &str, key: &str, ttl: Option<&str>) {
        self.lock().tables.insert(
            name.to_owned(),
            Table {
                key: key.to_owned(),
                ttl: ttl.map(str::to_owned),
                items: BTreeMap::new(),
            },
        );
    }

    /// Watches `table`'s writes for fencing: a write carrying an `:owner`
    /// that changes a record another owner holds in progress, without taking
    /// it over (setting the owner), is a breach.
    pub fn watch_fencing(&self, table: &str) {
        self.lock().fenced = Some(table.to_owned());
    }

    /// A table's items, in key order.
    pub fn items(&self, table: &str) -> Vec<Item> {
        self.lock()
            .tables
            .get(table)
            .map(|t| t.items.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The items committed transactions put into tables other than the
    /// fenced one, with their table and the instant they committed, in
    /// commit order.
    pub fn committed(&self) -> Vec<(String, Item, Instant)> {
        self.lock().committed.clone()
    }

    /// The fencing breaches seen (none while fencing holds).
    pub fn fencing_breaches(&self) -> Vec<String> {
        self.lock().breaches.clone()
    }

    /// Checks from now on that every write of a record of the fenced
    /// table carries `ttl`: its `expires_at` is the writer's clock, as
    /// noted by [`DynamoModel::stamp`] for the call, in whole seconds plus
    /// `ttl` (a write that sets no time leaves it as it was). A write found
    /// wrong is a breach ([`DynamoModel::ttl_breaches`]), and TTL ending
    /// its record is noted as one, not as an end.
    pub fn expect_ttl(&self, ttl: Duration) {
        self.lock().ttl.expected_s = Some(i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2));
    }

    /// Notes the writer's clock (`now_ms`) of a store call of `owner` on
    /// the record `key`, read as the store reads it for the call.
    pub fn stamp(&self, key: &str, owner: &str, call: Stamp, now_ms: i64) {
        self.lock()
            .ttl
            .stamps
            .entry((key.to_owned(), owner.to_owned(), call))
            .or_default()
            .push(now_ms);
    }

    /// Record writes whose `expires_at` was not the writer's clock plus the
    /// expected TTL, and TTL ends of such records, described.
    pub fn ttl_breaches(&self) -> Vec<String> {
        self.lock().ttl.breaches.clone()
    }

    /// When the record `key` of the fenced table became `COMPLETED`, if it is.
    pub fn completed_at(&self, key: &str) -> Option<Instant> {
        self.lock().completions.get(key).copied()
    }

    /// `COMPLETED` records replaced by another owner's write or deleted by
    /// TTL: (key, their `expires_at`, when).
    pub fn ended_by_ttl(&self) -> Vec<(String, i64, Instant)> {
        self.lock().ended_by_ttl.clone()
    }

    /// DynamoDB's TTL deletion, which comes some time after expiry: deletes
    /// each item of `table` whose TTL attribute is below `now_s` and for
    /// which `due(key, expires_at)` says its deletion has come; answers the
    /// items deleted.
    pub fn sweep_expired(
        &self,
        table: &str,
        now_s: i64,
        mut due: impl FnMut(&str, i64) -> bool,
    ) -> Vec<Item> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(t) = state.tables.get_mut(table) else {
            return Vec::new();
        };
        let Some(attr) = t.ttl.clone() else {
            return Vec::new();
        };
        let expired: Vec<(String, i64)> = t
            .items
            .iter()
            .filter_map(|(k, i)| Some((k.clone(), number(i.get(&attr)?)?)))
            .filter(|(k, at)| *at < now_s && due(k, *at))
            .collect();
        let mut deleted = Vec::new();
        for (key, at) in expired {
            let Some(item) = t.items.remove(&key) else {
                continue;
            };
            let ends = state.ttl.may_end(&key, "was deleted by TTL");
            if state.completions.remove(&key).is_some() && ends {
                state.ended_by_ttl.push((key, at, Instant::now()));
            }
            deleted.push(item);
        }
        deleted
    }

    /// Requests applied so far (answers from a token not counted).
    pub fn applied(&self) -> u64 {
        self.lock().applied
    }

    /// Whether `request` is a transaction whose token is held by a request
    /// still being applied; if not, and it carries a token not yet known,
    /// the token is held from now until [`DynamoModel::handle`] applies it.
    /// (For a request the network delays on the service's side.)
    pub fn hold(&self, target: &str, request: &Value) -> Option<Answer> {
        if target != "TransactWriteItems" {
            return None;
        }
        let token = text(request, "ClientRequestToken")?;
        let mut state = self.lock();
        let now = Instant::now();
        state
            .tokens
            .retain(|_, t| now.duration_since(t.at) < TOKEN_WINDOW || t.answer.is_none());
        match state.tokens.get(token) {
            Some(t) if t.answer.is_none() => Some(DdbError::InProgress.answer()),
            Some(_) => None,
            None => {
                let mut request = request.clone();
                if let Some(o) = request.as_object_mut() {
                    o.remove("ClientRequestToken");
                }
                state.tokens.insert(
                    token.to_owned(),
                    Token {
                        request,
                        at: now,
                        answer: None,
                    },
                );
                None
            }
        }
    }

    /// Answers one request: `target` is the operation (`GetItem`, ...).
    pub fn handle(&self, target: &str, request: &Value) -> Answer {
        let mut state = self.lock();
        let out = match target {
            "GetItem" => get_item(&state, request),
            "PutItem" | "UpdateItem" | "DeleteItem" => single_write(&mut state, target, request),
            "TransactWriteItems" => transact(&mut state, request),
            "DescribeTable" => describe_table(&state, request),
            "DescribeTimeToLive" => describe_ttl(&state, request),
            other => Err(DdbError::Validation(format!(
                "operation {other} is not modelled"
            ))),
        };
        out.unwrap_or_else(|e| e.answer())
    }
}

fn table<'a>(state: &'a State, request: &Value) -> Result<(&'a str, &'a Table), DdbError> {
    let name = text(request, "TableName")
        .ok_or_else(|| DdbError::Validation("TableName is missing".into()))?;
    state
        .tables
        .get_key_value(name)
        .map(|(k, t)| (k.as_str(), t))
        .ok_or(DdbError::NotFound)
}

/// The key of a `Key` map, checked against the table's schema.
fn key_of(t: &Table, key: &Value) -> Result<String, DdbError> {
    let key = expr::item_from_json(key)?;
    match (key.len(), key.get(&t.key)) {
        (1, Some(Av::S(k))) if !k.is_empty() => Ok(k.clone()),
        _ => Err(DdbError::Validation(
            "The provided key element does not match the schema".into(),
        )),
    }
}

fn get_item(state: &State, request: &Value) -> Result<Answer, DdbError> {
    let (_, t) = table(state, request)?;
    let key = key_of(t, request.get("Key").unwrap_or(&Value::Null))?;
    Ok(Answer::ok(match t.items.get(&key) {
        Some(item) => json!({ "Item": expr::item_to_json(item) }),
        None => json!({}),
    }))
}

/// Parses and checks one write (`op`: `Put`, `Update`, `Delete`,
/// `ConditionCheck`, or their single-request names).
fn parse_write(state: &State, op: &str, w: &Value) -> Result<Write, DdbError> {
    let (name, t) = table(state, w)?;
    let names = names_of(w)?;
    let values = values_of(w)?;
    let mut ph = Placeholders::new(&names, &values);
    let (key, kind) = match op {
        "Put" | "PutItem" => {
            let item = expr::item_from_json(w.get("Item").unwrap_or(&Value::Null))?;
            let key =
                match item.get(&t.key) {
                    Some(Av::S(k)) if !k.is_empty() => k.clone(),
                    _ => return Err(DdbError::Validation(
                        "One or more parameter values were invalid: Missing the key pk in the item"
                            .into(),
                    )),
                };
            (key, WriteKind::Put(item))
        }
        "Update" | "UpdateItem" => {
            let key = key_of(t, w.get("Key").unwrap_or(&Value::Null))?;
            let Some(u) = text(w, "UpdateExpression") else {
                return Err(DdbError::Validation(
                    "an update without UpdateExpression is not modelled".into(),
                ));
            };
            let u = expr::parse_update(u, &mut ph)?;
            let touches_key = u
                .set
                .iter()
                .map(|(p, _)| p)
                .chain(&u.remove)
                .chain(u.add.iter().map(|(p, _)| p))
                .any(|p| *p == t.key);
            if touches_key {
                return Err(DdbError::Validation(format!(
                    "One or more parameter values were invalid: Cannot update attribute {}. This attribute is part of the key",
                    t.key
                )));
            }
            (key, WriteKind::Update(u))
        }
        "Delete" | "DeleteItem" => (
            key_of(t, w.get("Key").unwrap_or(&Value::Null))?,
            WriteKind::Delete,
        ),
        "ConditionCheck" => (
            key_of(t, w.get("Key").unwrap_or(&Value::Null))?,
            WriteKind::Check,
        ),
        other => {
            return Err(DdbError::Validation(format!(
                "unknown transaction item {other}"
            )));
        }
    };
    let condition = match text(w, "ConditionExpression") {
        Some(c) => Some(expr::parse_condition(c, &mut ph)?),
        None if op == "ConditionCheck" => {
            return Err(DdbError::Validation(
                "ConditionCheck without ConditionExpression".into(),
            ));
        }
        None => None,
    };
    ph.check_all_used()?;
    let owner = writer(&values, &kind);
    Ok(Write {
        table: name.to_owned(),
        key_attr: t.key.clone(),
        key,
        kind,
        condition,
        all_old_on_failure: text(w, "ReturnValuesOnConditionCheckFailure") == Some("ALL_OLD"),
        owner,
    })
}

/// A write's owner: its `:owner`, or the owner a put writes (the fast
/// path's new record), so the fencing check sees puts as it sees updates.
fn writer(values: &HashMap<String, Av>, kind: &WriteKind) -> Option<String> {
    match (values.get(":owner"), kind) {
        (Some(Av::S(o)), _) => Some(o.clone()),
        (_, WriteKind::Put(item)) => match item.get("owner") {
            Some(Av::S(o)) => Some(o.clone()),
            _ => None,
        },
        _ => None,
    }
}

impl Write {
    /// The item after this write (`None`: deleted or absent), or why not.
    fn evaluate(&self, old: Option<&Item>) -> Result<Result<Option<Item>, Reason>, DdbError> {
        let empty = Item::new();
        let base = old.unwrap_or(&empty);
        if let Some(c) = &self.condition
            && !expr::eval(c, base)?
        {
            return Ok(Err(Reason {
                code: "ConditionalCheckFailed",
                item: old.filter(|_| self.all_old_on_failure).cloned(),
                message: Some("The conditional request failed".into()),
            }));
        }
        let new = match &self.kind {
            WriteKind::Put(item) => Some(item.clone()),
            // An update of an absent item creates it, with its key.
            WriteKind::Update(u) => match old {
                Some(old) => Some(expr::apply(u, old)?),
                None => {
                    let key = Item::from([(self.key_attr.clone(), Av::S(self.key.clone()))]);
                    Some(expr::apply(u, &key)?)
                }
            },
            WriteKind::Delete => None,
            WriteKind::Check => old.cloned(),
        };
        if let Some(item) = &new
            && expr::item_size(item) > MAX_ITEM_BYTES
        {
            return Err(DdbError::Validation(
                "Item size has exceeded the maximum allowed size".into(),
            ));
        }
        Ok(Ok(new))
    }
}

/// A number attribute's value, whole.
fn number(v: &Av) -> Option<i64> {
    match v {
        Av::N(n) => n.parse().ok(),
        _ => None,
    }
}

/// Notes a `fence` a write to record `key` stored (one other than the old
/// item's): one not above every fence the key held is a breach.
fn note_fence(state: &mut State, key: &str, old: Option<&Item>, new: Option<&Item>) {
    let fence = |i: Option<&Item>| match i.and_then(|i| i.get("fence")) {
        Some(Av::N(n)) => n.parse::<i128>().ok(),
        _ => None,
    };
    let Some(stored) = fence(new).filter(|f| Some(*f) != fence(old)) else {
        return;
    };
    let highest = state.fences.entry(key.to_owned()).or_insert(i128::MIN);
    if stored <= *highest {
        let highest = *highest;
        state.breaches.push(format!(
            "{key}: a write stored fence {stored}, not above the {highest} the key held"
        ));
    } else {
        *highest = stored;
    }
}

/// Checks the `expires_at` a write of record `key` by `writer` left (see
/// [`TtlWatch`]): a write that starts, finishes, fails or extends a claim,
/// or commits on the fast path, sets it from its call's clock reading; any
/// other leaves it as it was.
fn check_ttl(state: &mut State, key: &str, writer: Option<&str>, old: Option<&Item>, new: &Item) {
    let Some(ttl_s) = state.ttl.expected_s else {
        return;
    };
    let s = |i: &Item, k: &str| match i.get(k) {
        Some(Av::S(v)) => Some(v.clone()),
        _ => None,
    };
    let num = |i: &Item, k: &str| i.get(k).and_then(number);
    let writer = writer.map(str::to_owned).or_else(|| s(new, "owner"));
    let writer = writer.unwrap_or_default();
    let held = old.is_some_and(|o| {
        s(o, "owner").as_deref() == Some(writer.as_str())
            && s(o, "status").as_deref() == Some("IN_PROGRESS")
    });
    // A claim and a fast-path commit count an attempt (a claim may be its
    // own owner's again, sent anew after an unknown outcome).
    let counted = old.is_none_or(|o| num(new, "attempts") > num(o, "attempts"));
    let call = match s(new, "status").as_deref() {
        Some("IN_PROGRESS") if counted => Some(Stamp::Claim),
        Some("IN_PROGRESS")
            if held && num(new, "lease_until") > old.and_then(|o| num(o, "lease_until")) =>
        {
            Some(Stamp::Extend)
        }
        Some("COMPLETED") if counted => Some(Stamp::Fast),
        Some("COMPLETED") if held => Some(Stamp::Complete),
        Some("FAILED") if held => Some(Stamp::Fail),
        _ => None,
    };
    let stored = num(new, "expires_at");
    let Some(call) = call else {
        let before = old.and_then(|o| num(o, "expires_at"));
        if stored != before {
            state.ttl.wrong.insert(key.to_owned());
            state.ttl.breaches.push(format!(
                "{key}: a write of owner {writer} that sets no time changed expires_at from {before:?} to {stored:?}"
            ));
        }
        return;
    };
    let times = state
        .ttl
        .stamps
        .get(&(key.to_owned(), writer.clone(), call))
        .map_or(&[][..], Vec::as_slice);
    let matched: Vec<i64> = times
        .iter()
        .copied()
        .filter(|t| stored.is_some_and(|e| t.div_euclid(1000) + ttl_s == e))
        .collect();
    if !matched.is_empty() {
        state.ttl.wrong.remove(key);
        // An extension holds only a live lease: one over by its writer's
        // clock when the call read it (at or before the earliest reading
        // the write can be, so at its own) must not apply, whatever
        // condition the store sent.
        let lease = old.and_then(|o| num(o, "lease_until"));
        if call == Stamp::Extend
            && let Some(lease) = lease
            && matched.iter().all(|&t| lease <= t)
        {
            let t = matched.iter().min().copied().unwrap_or_default();
            state.breaches.push(format!(
                "{key}: an extension of owner {writer} applied to a lease over by its clock (lease until {lease}, its clock at least {t})"
            ));
        }
        return;
    }
    let seconds: Vec<i64> = times.iter().map(|t| t.div_euclid(1000)).collect();
    state.ttl.breaches.push(format!(
        "{key}: a {call:?} write of owner {writer} stored expires_at {stored:?}, not its clock ({seconds:?} s) plus the configured TTL {ttl_s}s"
    ));
    state.ttl.wrong.insert(key.to_owned());
}

/// Stores the result of a write, noting a fencing breach.
fn store(state: &mut State, w: &Write, old: Option<&Item>, new: Option<Item>) {
    if matches!(w.kind, WriteKind::Check) {
        return;
    }
    if state.fenced.as_deref() == Some(w.table.as_str())
        && let (Some(owner), Some(old)) = (&w.owner, old)
    {
        let s = |i: &Item, k: &str| match i.get(k) {
            Some(Av::S(v)) => Some(v.clone()),
            _ => None,
        };
        let held_by = s(old, "owner");
        let takes_over = new
            .as_ref()
            .is_some_and(|n| s(n, "owner").as_deref() == Some(owner.as_str()))
            && held_by.as_deref() != Some(owner.as_str())
            && matches!(&w.kind, WriteKind::Update(u) if u.set.iter().any(|(p, _)| p == "owner"));
        if s(old, "status").as_deref() == Some("IN_PROGRESS")
            && held_by.as_deref() != Some(owner.as_str())
            && !takes_over
        {
            state.breaches.push(format!(
                "{}: a write of owner {owner} applied while {} held it",
                w.key,
                held_by.as_deref().unwrap_or("nobody")
            ));
        }
    }
    let fenced = state.fenced.as_deref() == Some(w.table.as_str());
    if fenced {
        note_fence(state, &w.key, old, new.as_ref());
    }
    if fenced {
        let completed =
            |i: Option<&Item>| i.and_then(|i| i.get("status")) == Some(&Av::S("COMPLETED".into()));
        let owner = |i: Option<&Item>| match i.and_then(|i| i.get("owner")) {
            Some(Av::S(v)) => Some(v.clone()),
            _ => None,
        };
        // Another owner's write over a `COMPLETED` record: a claim or a
        // fast-path commit after its expiry.
        let replaced = new.is_some() && owner(new.as_ref()) != owner(old);
        if completed(old) && replaced && state.ttl.may_end(&w.key, "was replaced by another owner")
        {
            let attr = state.tables.get(&w.table).and_then(|t| t.ttl.clone());
            let at = old.zip(attr).and_then(|(o, a)| o.get(&a).and_then(number));
            state
                .ended_by_ttl
                .push((w.key.clone(), at.unwrap_or(i64::MAX), Instant::now()));
        }
        match (completed(old), completed(new.as_ref())) {
            (was, true) if !was || replaced => {
                state.completions.insert(w.key.clone(), Instant::now());
            }
            (_, true) => {}
            (_, false) => {
                state.completions.remove(&w.key);
            }
        }
        // Beside the fence: the TTL this write stored (after the end of
        // the record it replaced was judged by the TTL that record held).
        if let Some(new) = &new {
            check_ttl(state, &w.key, w.owner.as_deref(), old, new);
        }
    }
    if let (false, WriteKind::Put(item)) = (fenced, &w.kind) {
        state
            .committed
            .push((w.table.clone(), item.clone(), Instant::now()));
    }
    let Some(t) = state.tables.get_mut(&w.table) else {
        return;
    };
    match new {
        Some(item) => {
            t.items.insert(w.key.clone(), item);
        }
        None => {
            t.items.remove(&w.key);
        }
    }
}

fn single_write(state: &mut State, op: &str, request: &Value) -> Result<Answer, DdbError> {
    let w = parse_write(state, op, request)?;
    let return_values = text(request, "ReturnValues").unwrap_or("NONE");
    let allowed: &[&str] = match op {
        "UpdateItem" => &["NONE", "ALL_OLD", "ALL_NEW", "UPDATED_OLD", "UPDATED_NEW"],
        _ => &["NONE", "ALL_OLD"],
    };
    if !allowed.contains(&return_values) {
        return Err(DdbError::Validation(format!(
            "ReturnValues {return_values} is not valid for {op}"
        )));
    }
    let old = state.tables[&w.table].items.get(&w.key).cloned();
    let new = match w.evaluate(old.as_ref())? {
        Ok(new) => new,
        Err(reason) => return Err(DdbError::ConditionFailed(reason.item)),
    };
    state.applied += 1;
    let shown = match return_values {
        "ALL_OLD" | "UPDATED_OLD" => old.clone(),
        "ALL_NEW" | "UPDATED_NEW" => new.clone(),
        _ => None,
    };
    store(state, &w, old.as_ref(), new);
    Ok(Answer::ok(match shown {
        Some(item) => json!({ "Attributes": expr::item_to_json(&item) }),
        None => json!({}),
    }))
}

const TRANSACTION_OPS: [&str; 4] = ["Put", "Update", "Delete", "ConditionCheck"];

fn transact(state: &mut State, request: &Value) -> Result<Answer, DdbError> {
    let Some(items) = request.get("TransactItems").and_then(Value::as_array) else {
        return Err(DdbError::Validation("TransactItems is missing".into()));
    };
    if items.is_empty() || items.len() > 100 {
        return Err(DdbError::Validation(format!(
            "1 validation error detected: Value at 'transactItems' failed to satisfy constraint: Member must have length between 1 and 100 (has {})",
            items.len()
        )));
    }
    let token = text(request, "ClientRequestToken").map(str::to_owned);
    let mut bare = request.clone();
    if let Some(o) = bare.as_object_mut() {
        o.remove("ClientRequestToken");
    }
    if let Some(token) = &token {
        let now = Instant::now();
        state
            .tokens
            .retain(|_, t| now.duration_since(t.at) < TOKEN_WINDOW || t.answer.is_none());
        if let Some(known) = state.tokens.get(token) {
            if known.request != bare {
                return Err(DdbError::Mismatch);
            }
            if let Some(answer) = &known.answer {
                return Ok(answer.clone());
            }
        }
    }
    let out = transact_apply(state, items);
    if let Some(token) = token {
        match &out {
            Ok(answer) => {
                let at = state.tokens.get(&token).map_or_else(Instant::now, |t| t.at);
                state.tokens.insert(
                    token,
                    Token {
                        request: bare,
                        at,
                        answer: Some(answer.clone()),
                    },
                );
            }
            // A transaction that did not commit leaves no token behind.
            Err(_) => {
                state.tokens.remove(&token);
            }
        }
    }
    out
}

fn transact_apply(state: &mut State, items: &[Value]) -> Result<Answer, DdbError> {
    let mut writes = Vec::with_capacity(items.len());
    for item in items {
        let Some((op, w)) = item
            .as_object()
            .filter(|o| o.len() == 1)
            .and_then(|o| o.iter().next())
        else {
            return Err(DdbError::Validation(
                "a transaction item must have exactly one operation".into(),
            ));
        };
        if !TRANSACTION_OPS.contains(&op.as_str()) {
            return Err(DdbError::Validation(format!(
                "unknown transaction item {op}"
            )));
        }
        if op != "ConditionCheck" && text(w, "ReturnValues").is_some() {
            return Err(DdbError::Validation(
                "ReturnValues is not valid in a transaction".into(),
            ));
        }
        writes.push(parse_write(state, op, w)?);
    }
    for (i, a) in writes.iter().enumerate() {
        if writes[..i]
            .iter()
            .any(|b| b.table == a.table && b.key == a.key)
        {
            return Err(DdbError::Validation(
                "Transaction request cannot include multiple operations on one item".into(),
            ));
        }
    }
    let mut reasons = Vec::with_capacity(writes.len());
    let mut outcomes = Vec::with_capacity(writes.len());
    let mut failed = false;
    for w in &writes {
        let old = state.tables[&w.table].items.get(&w.key).cloned();
        match w.evaluate(old.as_ref()) {
            Ok(Ok(new)) => {
                reasons.push(Reason::none());
                outcomes.push((old, new));
            }
            Ok(Err(reason)) => {
                failed = true;
                reasons.push(reason);
                outcomes.push((old, None));
            }
            Err(DdbError::Validation(m)) => {
                failed = true;
                reasons.push(Reason {
                    code: "ValidationError",
                    item: None,
                    message: Some(m),
                });
                outcomes.push((old, None));
            }
            Err(e) => return Err(e),
        }
    }
    if failed {
        return Err(DdbError::Cancelled(reasons));
    }
    state.applied += 1;
    for (w, (old, new)) in writes.iter().zip(outcomes) {
        store(state, w, old.as_ref(), new);
    }
    Ok(Answer::ok(json!({})))
}

fn describe_table(state: &State, request: &Value) -> Result<Answer, DdbError> {
    let (name, t) = table(state, request)?;
    Ok(Answer::ok(json!({
        "Table": {
            "TableName": name,
            "TableArn": format!("arn:aws:dynamodb:us-east-1:000000000000:table/{name}"),
            "TableStatus": "ACTIVE",
            "KeySchema": [{ "AttributeName": t.key, "KeyType": "HASH" }],
            "AttributeDefinitions": [{ "AttributeName": t.key, "AttributeType": "S" }],
            "ItemCount": t.items.len(),
            "BillingModeSummary": { "BillingMode": "PAY_PER_REQUEST" },
        }
    })))
}

fn describe_ttl(state: &State, request: &Value) -> Result<Answer, DdbError> {
    let (_, t) = table(state, request)?;
    Ok(Answer::ok(json!({
        "TimeToLiveDescription": match &t.ttl {
            Some(a) => json!({ "TimeToLiveStatus": "ENABLED", "AttributeName": a }),
            None => json!({ "TimeToLiveStatus": "DISABLED" }),
        }
    })))
}
