//! DynamoDB's condition and update expressions, for the wire model: the
//! attribute values in their JSON wire form ([`Av`]), a parser that resolves
//! `#name` and `:value` placeholders (and rejects unused or undefined ones,
//! as DynamoDB does), and an evaluator over an item.
//!
//! The subset: comparisons (`= <> < <= > >=`), `BETWEEN`, `IN`,
//! `attribute_exists`, `attribute_not_exists`, `attribute_type`,
//! `begins_with`, `contains`, `size`, `AND`/`OR`/`NOT` (that precedence) and
//! parentheses; `SET` (with `+`, `-`, `if_not_exists`, `list_append`),
//! `REMOVE`, `ADD` and `DELETE`. Document paths are top-level attribute names
//! only (the project never writes nested ones): a nested path is a
//! `ValidationException` here, not a silent misreading.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// An item: attribute name to value.
pub type Item = BTreeMap<String, Av>;

/// An attribute value, as DynamoDB's JSON protocol writes it.
#[derive(Debug, Clone, PartialEq)]
pub enum Av {
    /// `{"S": ...}`
    S(String),
    /// `{"N": ...}`, the number's text.
    N(String),
    /// `{"B": ...}`, base64 as sent.
    B(String),
    /// `{"BOOL": ...}`
    Bool(bool),
    /// `{"NULL": true}`
    Null,
    /// `{"L": [...]}`
    L(Vec<Av>),
    /// `{"M": {...}}`
    M(Item),
    /// `{"SS": [...]}`
    Ss(Vec<String>),
    /// `{"NS": [...]}`
    Ns(Vec<String>),
    /// `{"BS": [...]}`
    Bs(Vec<String>),
}

/// Why an expression or value was refused: the text of a `ValidationException`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

fn invalid<T>(msg: impl Into<String>) -> Result<T, Invalid> {
    Err(Invalid(msg.into()))
}

fn strings(v: &serde_json::Value) -> Result<Vec<String>, Invalid> {
    let Some(a) = v.as_array() else {
        return invalid("a set is not a list");
    };
    let out: Option<Vec<String>> = a.iter().map(|s| s.as_str().map(str::to_owned)).collect();
    out.ok_or_else(|| Invalid("a set of non-strings".into()))
}

impl Av {
    /// Reads a value from its wire form.
    pub fn from_json(v: &serde_json::Value) -> Result<Self, Invalid> {
        let Some((tag, inner)) = v
            .as_object()
            .filter(|o| o.len() == 1)
            .and_then(|o| o.iter().next())
        else {
            return invalid("Supplied AttributeValue has more or less than one datatype");
        };
        let text = || {
            inner
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| Invalid(format!("{tag} is not a string")))
        };
        Ok(match tag.as_str() {
            "S" => Self::S(text()?),
            "N" => {
                let n = text()?;
                if number(&n).is_none() {
                    return invalid(format!(
                        "The parameter cannot be converted to a numeric value: {n}"
                    ));
                }
                Self::N(n)
            }
            "B" => Self::B(text()?),
            "BOOL" => Self::Bool(
                inner
                    .as_bool()
                    .ok_or_else(|| Invalid("BOOL is not a boolean".into()))?,
            ),
            "NULL" => Self::Null,
            "L" => Self::L(
                inner
                    .as_array()
                    .ok_or_else(|| Invalid("L is not a list".into()))?
                    .iter()
                    .map(Self::from_json)
                    .collect::<Result<_, _>>()?,
            ),
            "M" => Self::M(item_from_json(inner)?),
            "SS" => Self::Ss(strings(inner)?),
            "NS" => Self::Ns(strings(inner)?),
            "BS" => Self::Bs(strings(inner)?),
            other => return invalid(format!("unknown attribute value type {other}")),
        })
    }

    /// The value's wire form.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Self::S(s) => json!({ "S": s }),
            Self::N(n) => json!({ "N": n }),
            Self::B(b) => json!({ "B": b }),
            Self::Bool(b) => json!({ "BOOL": b }),
            Self::Null => json!({ "NULL": true }),
            Self::L(l) => json!({ "L": l.iter().map(Self::to_json).collect::<Vec<_>>() }),
            Self::M(m) => json!({ "M": item_to_json(m) }),
            Self::Ss(v) => json!({ "SS": v }),
            Self::Ns(v) => json!({ "NS": v }),
            Self::Bs(v) => json!({ "BS": v }),
        }
    }

    /// The type's name, as `attribute_type` takes it.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::S(_) => "S",
            Self::N(_) => "N",
            Self::B(_) => "B",
            Self::Bool(_) => "BOOL",
            Self::Null => "NULL",
            Self::L(_) => "L",
            Self::M(_) => "M",
            Self::Ss(_) => "SS",
            Self::Ns(_) => "NS",
            Self::Bs(_) => "BS",
        }
    }

    /// Approximate size in bytes, as DynamoDB counts item size.
    pub fn size(&self) -> usize {
        match self {
            Self::S(s) | Self::B(s) => s.len(),
            Self::N(n) => n.len().div_ceil(2) + 1,
            Self::Bool(_) | Self::Null => 1,
            Self::L(l) => 3 + l.iter().map(|v| 1 + v.size()).sum::<usize>(),
            Self::M(m) => 3 + item_size(m),
            Self::Ss(v) | Self::Bs(v) => v.iter().map(String::len).sum(),
            Self::Ns(v) => v.iter().map(|n| n.len().div_ceil(2) + 1).sum(),
        }
    }
}

/// An item's approximate size in bytes.
pub fn item_size(item: &Item) -> usize {
    item.iter().map(|(k, v)| k.len() + v.size()).sum()
}

/// Reads an item (`{"name": {"S": ...}, ...}`).
pub fn item_from_json(v: &serde_json::Value) -> Result<Item, Invalid> {
    let Some(o) = v.as_object() else {
        return invalid("an item is not an object");
    };
    o.iter()
        .map(|(k, v)| Ok((k.clone(), Av::from_json(v)?)))
        .collect()
}

/// An item's wire form.
pub fn item_to_json(item: &Item) -> serde_json::Value {
    serde_json::Value::Object(item.iter().map(|(k, v)| (k.clone(), v.to_json())).collect())
}

/// A number's value: exact for integers (all the project writes), else a float.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
enum Num {
    Int(i128),
    Float(f64),
}

fn number(text: &str) -> Option<Num> {
    if let Ok(i) = text.trim().parse::<i128>() {
        return Some(Num::Int(i));
    }
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|f| f.is_finite())
        .map(Num::Float)
}

fn num_cmp(a: &str, b: &str) -> Option<Ordering> {
    match (number(a)?, number(b)?) {
        (Num::Int(x), Num::Int(y)) => Some(x.cmp(&y)),
        (x, y) => {
            let f = |n: Num| match n {
                Num::Int(i) => i as f64,
                Num::Float(f) => f,
            };
            f(x).partial_cmp(&f(y))
        }
    }
}

fn num_text(n: Num) -> String {
    match n {
        Num::Int(i) => i.to_string(),
        Num::Float(f) => f.to_string(),
    }
}

fn add_numbers(a: &str, b: &str, sign: i128) -> Option<String> {
    Some(match (number(a)?, number(b)?) {
        (Num::Int(x), Num::Int(y)) => num_text(Num::Int(x.checked_add(sign * y)?)),
        (x, y) => {
            let f = |n: Num| match n {
                Num::Int(i) => i as f64,
                Num::Float(f) => f,
            };
            num_text(Num::Float(f(x) + (sign as f64) * f(y)))
        }
    })
}

/// How two values order: only values of one scalar type compare (a number
/// with a string, say, is neither less nor greater; DynamoDB says false).
fn compare(a: &Av, b: &Av) -> Option<Ordering> {
    match (a, b) {
        (Av::N(x), Av::N(y)) => num_cmp(x, y),
        (Av::S(x), Av::S(y)) | (Av::B(x), Av::B(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

/// Equality as DynamoDB judges it: numbers by value, sets as sets.
fn equal(a: &Av, b: &Av) -> bool {
    match (a, b) {
        (Av::N(x), Av::N(y)) => num_cmp(x, y) == Some(Ordering::Equal),
        (Av::Ss(x), Av::Ss(y)) | (Av::Bs(x), Av::Bs(y)) => {
            x.iter().collect::<BTreeSet<_>>() == y.iter().collect::<BTreeSet<_>>()
        }
        (Av::Ns(x), Av::Ns(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|n| y.iter().any(|m| num_cmp(n, m) == Some(Ordering::Equal)))
        }
        (Av::L(x), Av::L(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| equal(p, q)),
        (Av::M(x), Av::M(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| equal(v, w)))
        }
        _ => a == b,
    }
}

/// A comparison operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// `=`
    Eq,
    /// `<>`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

/// A value in an expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    /// An attribute of the item (its resolved name).
    Path(String),
    /// A value from `ExpressionAttributeValues`.
    Value(Av),
    /// `size(path)`.
    Size(String),
    /// `if_not_exists(path, operand)` (update expressions).
    IfNotExists(String, Box<Operand>),
    /// `list_append(a, b)` (update expressions).
    ListAppend(Box<Operand>, Box<Operand>),
    /// `a + b` (update expressions).
    Plus(Box<Operand>, Box<Operand>),
    /// `a - b` (update expressions).
    Minus(Box<Operand>, Box<Operand>),
}

/// A condition expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Cond {
    /// `a op b`
    Compare(Operand, Cmp, Operand),
    /// `a BETWEEN lo AND hi`
    Between(Operand, Operand, Operand),
    /// `a IN (b, c, ...)`
    In(Operand, Vec<Operand>),
    /// `attribute_exists(path)`
    Exists(String),
    /// `attribute_not_exists(path)`
    NotExists(String),
    /// `attribute_type(path, :t)`
    Type(String, Operand),
    /// `begins_with(path, :prefix)`
    BeginsWith(Operand, Operand),
    /// `contains(path, operand)`
    Contains(Operand, Operand),
    /// `a AND b`
    And(Box<Cond>, Box<Cond>),
    /// `a OR b`
    Or(Box<Cond>, Box<Cond>),
    /// `NOT a`
    Not(Box<Cond>),
}

/// An update expression's actions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Update {
    /// `SET path = value`
    pub set: Vec<(String, Operand)>,
    /// `REMOVE path`
    pub remove: Vec<String>,
    /// `ADD path value`
    pub add: Vec<(String, Operand)>,
    /// `DELETE path value`
    pub delete: Vec<(String, Operand)>,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Word(String),
    Name(String),
    Value(String),
    Op(&'static str),
}

fn tokenize(text: &str) -> Result<Vec<Tok>, Invalid> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c == '#' || c == ':' || word(c) {
            let start = i;
            i += 1;
            while i < chars.len() && word(chars[i]) {
                i += 1;
            }
            let s: String = chars[start..i].iter().collect();
            out.push(match c {
                '#' => Tok::Name(s),
                ':' => Tok::Value(s),
                _ => Tok::Word(s),
            });
            continue;
        }
        let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
        let op = match two.as_str() {
            "<>" => Some("<>"),
            "<=" => Some("<="),
            ">=" => Some(">="),
            _ => None,
        };
        if let Some(op) = op {
            out.push(Tok::Op(op));
            i += 2;
            continue;
        }
        let op = match c {
            '=' => "=",
            '<' => "<",
            '>' => ">",
            '(' => "(",
            ')' => ")",
            ',' => ",",
            '+' => "+",
            '-' => "-",
            '.' => ".",
            '[' => "[",
            ']' => "]",
            _ => return invalid(format!("Invalid expression: unexpected character {c:?}")),
        };
        out.push(Tok::Op(op));
        i += 1;
    }
    Ok(out)
}

/// Words DynamoDB reserves that a bare attribute name may not be (a subset of
/// the documented list: those near the project's own attribute names).
const RESERVED: &[&str] = &[
    "status",
    "owner",
    "result",
    "error",
    "name",
    "data",
    "key",
    "value",
    "values",
    "time",
    "timestamp",
    "date",
    "size",
    "count",
    "type",
    "state",
    "user",
    "table",
    "ttl",
    "order",
    "group",
    "level",
    "index",
    "year",
    "month",
    "day",
    "hour",
    "minute",
    "second",
    "number",
    "string",
    "binary",
    "list",
    "map",
    "set",
    "add",
    "remove",
    "delete",
    "and",
    "or",
    "not",
    "between",
    "in",
    "exists",
    "condition",
    "conflict",
    "commit",
];

/// Placeholders an expression may use, and which it did.
pub struct Placeholders<'a> {
    names: &'a HashMap<String, String>,
    values: &'a HashMap<String, Av>,
    used_names: BTreeSet<String>,
    used_values: BTreeSet<String>,
}

impl<'a> Placeholders<'a> {
    /// The request's `ExpressionAttributeNames` and `ExpressionAttributeValues`.
    pub fn new(names: &'a HashMap<String, String>, values: &'a HashMap<String, Av>) -> Self {
        Self {
            names,
            values,
            used_names: BTreeSet::new(),
            used_values: BTreeSet::new(),
        }
    }

    /// After every expression of the request was parsed: an unused
    /// placeholder is refused.
    pub fn check_all_used(&self) -> Result<(), Invalid> {
        let unused: Vec<&String> = self
            .names
            .keys()
            .filter(|k| !self.used_names.contains(*k))
            .collect();
        if !unused.is_empty() {
            let mut unused: Vec<&str> = unused.iter().map(|s| s.as_str()).collect();
            unused.sort_unstable();
            return invalid(format!(
                "Value provided in ExpressionAttributeNames unused in expressions: keys: {{{}}}",
                unused.join(", ")
            ));
        }
        let mut unused: Vec<&str> = self
            .values
            .keys()
            .filter(|k| !self.used_values.contains(*k))
            .map(String::as_str)
            .collect();
        if !unused.is_empty() {
            unused.sort_unstable();
            return invalid(format!(
                "Value provided in ExpressionAttributeValues unused in expressions: keys: {{{}}}",
                unused.join(", ")
            ));
        }
        Ok(())
    }
}

struct Parser<'p, 'a> {
    toks: Vec<Tok>,
    at: usize,
    ph: &'p mut Placeholders<'a>,
}

impl Parser<'_, '_> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at)
    }

    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn keyword(&self, k: &str) -> bool {
        matches!(self.peek(), Some(Tok::Word(w)) if w.eq_ignore_ascii_case(k))
    }

    fn op(&self, o: &str) -> bool {
        matches!(self.peek(), Some(Tok::Op(p)) if *p == o)
    }

    fn expect(&mut self, o: &'static str) -> Result<(), Invalid> {
        if self.op(o) {
            self.at += 1;
            return Ok(());
        }
        invalid(format!(
            "Invalid expression: expected {o:?} near token {}",
            self.at
        ))
    }

    fn path(&mut self) -> Result<String, Invalid> {
        let name = match self.next() {
            Some(Tok::Name(n)) => {
                let Some(resolved) = self.ph.names.get(&n) else {
                    return invalid(format!(
                        "Value provided in ExpressionAttributeNames undefined: {n}"
                    ));
                };
                self.ph.used_names.insert(n);
                resolved.clone()
            }
            Some(Tok::Word(w)) => {
                if RESERVED.iter().any(|r| r.eq_ignore_ascii_case(&w)) {
                    return invalid(format!(
                        "Invalid expression: Attribute name is a reserved keyword; reserved keyword: {w}"
                    ));
                }
                w
            }
            other => {
                return invalid(format!(
                    "Invalid expression: expected a path, found {other:?}"
                ));
            }
        };
        if self.op(".") || self.op("[") {
            return invalid("nested document paths are not modelled");
        }
        Ok(name)
    }

    fn value(&mut self, v: &str) -> Result<Av, Invalid> {
        let Some(av) = self.ph.values.get(v) else {
            return invalid(format!(
                "Value provided in ExpressionAttributeValues undefined: {v}"
            ));
        };
        self.ph.used_values.insert(v.to_owned());
        Ok(av.clone())
    }

    fn function_args(&mut self) -> Result<(), Invalid> {
        self.expect("(")
    }

    /// A condition's operand: a path, a value, or `size(path)`.
    fn operand(&mut self) -> Result<Operand, Invalid> {
        match self.peek().cloned() {
            Some(Tok::Value(v)) => {
                self.at += 1;
                Ok(Operand::Value(self.value(&v)?))
            }
            Some(Tok::Word(w))
                if w == "size" && self.toks.get(self.at + 1) == Some(&Tok::Op("(")) =>
            {
                self.at += 1;
                self.function_args()?;
                let p = self.path()?;
                self.expect(")")?;
                Ok(Operand::Size(p))
            }
            _ => Ok(Operand::Path(self.path()?)),
        }
    }

    fn or(&mut self) -> Result<Cond, Invalid> {
        let mut left = self.and()?;
        while self.keyword("OR") {
            self.at += 1;
            left = Cond::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Cond, Invalid> {
        let mut left = self.not()?;
        while self.keyword("AND") {
            self.at += 1;
            left = Cond::And(Box::new(left), Box::new(self.not()?));
        }
        Ok(left)
    }

    fn not(&mut self) -> Result<Cond, Invalid> {
        if self.keyword("NOT") {
            self.at += 1;
            return Ok(Cond::Not(Box::new(self.not()?)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Cond, Invalid> {
        if self.op("(") {
            self.at += 1;
            let c = self.or()?;
            self.expect(")")?;
            return Ok(c);
        }
        let function = match self.peek() {
            Some(Tok::Word(w)) if self.toks.get(self.at + 1) == Some(&Tok::Op("(")) => {
                Some(w.clone())
            }
            _ => None,
        };
        if let Some(f) = function.filter(|f| f != "size") {
            self.at += 1;
            self.function_args()?;
            let c = match f.as_str() {
                "attribute_exists" => Cond::Exists(self.path()?),
                "attribute_not_exists" => Cond::NotExists(self.path()?),
                "attribute_type" => {
                    let p = self.path()?;
                    self.expect(",")?;
                    Cond::Type(p, self.operand()?)
                }
                "begins_with" => {
                    let p = self.operand()?;
                    self.expect(",")?;
                    Cond::BeginsWith(p, self.operand()?)
                }
                "contains" => {
                    let p = self.operand()?;
                    self.expect(",")?;
                    Cond::Contains(p, self.operand()?)
                }
                other => return invalid(format!("Invalid function name; function: {other}")),
            };
            self.expect(")")?;
            return Ok(c);
        }
        self.comparison()
    }

    fn comparison(&mut self) -> Result<Cond, Invalid> {
        let left = self.operand()?;
        if self.keyword("BETWEEN") {
            self.at += 1;
            let lo = self.operand()?;
            if !self.keyword("AND") {
                return invalid("Invalid expression: BETWEEN without AND");
            }
            self.at += 1;
            return Ok(Cond::Between(left, lo, self.operand()?));
        }
        if self.keyword("IN") {
            self.at += 1;
            self.expect("(")?;
            let mut list = vec![self.operand()?];
            while self.op(",") {
                self.at += 1;
                list.push(self.operand()?);
            }
            self.expect(")")?;
            return Ok(Cond::In(left, list));
        }
        let cmp = match self.next() {
            Some(Tok::Op("=")) => Cmp::Eq,
            Some(Tok::Op("<>")) => Cmp::Ne,
            Some(Tok::Op("<")) => Cmp::Lt,
            Some(Tok::Op("<=")) => Cmp::Le,
            Some(Tok::Op(">")) => Cmp::Gt,
            Some(Tok::Op(">=")) => Cmp::Ge,
            other => {
                return invalid(format!(
                    "Invalid ConditionExpression: expected a comparator, found {other:?}"
                ));
            }
        };
        Ok(Cond::Compare(left, cmp, self.operand()?))
    }

    /// An update's value: operand, or operand `+`/`-` operand.
    fn set_value(&mut self) -> Result<Operand, Invalid> {
        let left = self.update_operand()?;
        if self.op("+") {
            self.at += 1;
            return Ok(Operand::Plus(
                Box::new(left),
                Box::new(self.update_operand()?),
            ));
        }
        if self.op("-") {
            self.at += 1;
            return Ok(Operand::Minus(
                Box::new(left),
                Box::new(self.update_operand()?),
            ));
        }
        Ok(left)
    }

    fn update_operand(&mut self) -> Result<Operand, Invalid> {
        let function = match self.peek() {
            Some(Tok::Word(w)) if self.toks.get(self.at + 1) == Some(&Tok::Op("(")) => {
                Some(w.clone())
            }
            _ => None,
        };
        match function.as_deref() {
            Some("if_not_exists") => {
                self.at += 2;
                let p = self.path()?;
                self.expect(",")?;
                let v = self.update_operand()?;
                self.expect(")")?;
                Ok(Operand::IfNotExists(p, Box::new(v)))
            }
            Some("list_append") => {
                self.at += 2;
                let a = self.update_operand()?;
                self.expect(",")?;
                let b = self.update_operand()?;
                self.expect(")")?;
                Ok(Operand::ListAppend(Box::new(a), Box::new(b)))
            }
            Some(other) => invalid(format!(
                "Invalid UpdateExpression: function {other} is not allowed here"
            )),
            None => match self.next() {
                Some(Tok::Value(v)) => Ok(Operand::Value(self.value(&v)?)),
                Some(t) => {
                    self.at -= 1;
                    let _ = t;
                    Ok(Operand::Path(self.path()?))
                }
                None => invalid("Invalid UpdateExpression: a value is missing"),
            },
        }
    }

    fn update(&mut self) -> Result<Update, Invalid> {
        let mut u = Update::default();
        let mut seen = BTreeSet::new();
        while let Some(tok) = self.next() {
            let Tok::Word(clause) = tok else {
                return invalid("Invalid UpdateExpression: expected SET, REMOVE, ADD or DELETE");
            };
            let clause = clause.to_ascii_uppercase();
            if !seen.insert(clause.clone()) {
                return invalid(format!(
                    "Invalid UpdateExpression: The \"{clause}\" section can only be used once in an update expression"
                ));
            }
            loop {
                match clause.as_str() {
                    "SET" => {
                        let p = self.path()?;
                        self.expect("=")?;
                        u.set.push((p, self.set_value()?));
                    }
                    "REMOVE" => u.remove.push(self.path()?),
                    "ADD" | "DELETE" => {
                        let p = self.path()?;
                        let v = self.update_operand()?;
                        if clause == "ADD" {
                            &mut u.add
                        } else {
                            &mut u.delete
                        }
                        .push((p, v));
                    }
                    other => {
                        return invalid(format!(
                            "Invalid UpdateExpression: unknown clause {other}"
                        ));
                    }
                }
                if !self.op(",") {
                    break;
                }
                self.at += 1;
            }
        }
        Ok(u)
    }
}

fn done<T>(p: &Parser<'_, '_>, v: T) -> Result<T, Invalid> {
    if p.at < p.toks.len() {
        return invalid(format!(
            "Invalid expression: unexpected token {:?}",
            p.toks[p.at]
        ));
    }
    Ok(v)
}

/// Parses a condition expression.
pub fn parse_condition(text: &str, ph: &mut Placeholders<'_>) -> Result<Cond, Invalid> {
    if text.trim().is_empty() {
        return invalid("Invalid ConditionExpression: The expression can not be empty;");
    }
    let mut p = Parser {
        toks: tokenize(text)?,
        at: 0,
        ph,
    };
    let c = p.or()?;
    done(&p, c)
}

/// Parses an update expression, refusing overlapping paths.
pub fn parse_update(text: &str, ph: &mut Placeholders<'_>) -> Result<Update, Invalid> {
    if text.trim().is_empty() {
        return invalid("Invalid UpdateExpression: The expression can not be empty;");
    }
    let mut p = Parser {
        toks: tokenize(text)?,
        at: 0,
        ph,
    };
    let u = p.update()?;
    let u = done(&p, u)?;
    let mut paths = BTreeSet::new();
    let all = u
        .set
        .iter()
        .map(|(p, _)| p)
        .chain(&u.remove)
        .chain(u.add.iter().map(|(p, _)| p))
        .chain(u.delete.iter().map(|(p, _)| p));
    for path in all {
        if !paths.insert(path.clone()) {
            return invalid(format!(
                "Invalid UpdateExpression: Two document paths overlap with each other; must remove or rewrite one of these paths; path one: [{path}], path two: [{path}]"
            ));
        }
    }
    Ok(u)
}

/// An operand's value on `item` (`None`: the attribute is missing).
fn operand_value(o: &Operand, item: &Item) -> Result<Option<Av>, Invalid> {
    Ok(match o {
        Operand::Path(p) => item.get(p).cloned(),
        Operand::Value(v) => Some(v.clone()),
        Operand::Size(p) => match item.get(p) {
            None => None,
            Some(v) => {
                let n = match v {
                    Av::S(s) | Av::B(s) => s.len(),
                    Av::L(l) => l.len(),
                    Av::M(m) => m.len(),
                    Av::Ss(s) | Av::Ns(s) | Av::Bs(s) => s.len(),
                    _ => return Ok(None),
                };
                Some(Av::N(n.to_string()))
            }
        },
        Operand::IfNotExists(p, v) => match item.get(p) {
            Some(v) => Some(v.clone()),
            None => operand_value(v, item)?,
        },
        Operand::ListAppend(a, b) => {
            let (Some(Av::L(mut a)), Some(Av::L(b))) =
                (operand_value(a, item)?, operand_value(b, item)?)
            else {
                return invalid(
                    "Invalid UpdateExpression: Incorrect operand type for operator or function; operator or function: list_append",
                );
            };
            a.extend(b);
            Some(Av::L(a))
        }
        Operand::Plus(a, b) | Operand::Minus(a, b) => {
            let sign = if matches!(o, Operand::Plus(..)) {
                1
            } else {
                -1
            };
            match (operand_value(a, item)?, operand_value(b, item)?) {
                (Some(Av::N(x)), Some(Av::N(y))) => match add_numbers(&x, &y, sign) {
                    Some(n) => Some(Av::N(n)),
                    None => return invalid("Number overflow"),
                },
                (None, _) | (_, None) => {
                    return invalid(
                        "The provided expression refers to an attribute that does not exist in the item",
                    );
                }
                _ => {
                    return invalid(
                        "An operand in the update expression has an incorrect data type",
                    );
                }
            }
        }
    })
}

/// Evaluates a condition on `item` (an absent item: every attribute missing).
pub fn eval(c: &Cond, item: &Item) -> Result<bool, Invalid> {
    Ok(match c {
        Cond::Compare(a, op, b) => {
            let (a, b) = (operand_value(a, item)?, operand_value(b, item)?);
            match (a, b, op) {
                (Some(a), Some(b), Cmp::Eq) => equal(&a, &b),
                (Some(a), Some(b), Cmp::Ne) => !equal(&a, &b),
                // A missing attribute equals nothing and differs from everything.
                (_, _, Cmp::Eq) => false,
                (_, _, Cmp::Ne) => true,
                (Some(a), Some(b), op) => compare(&a, &b).is_some_and(|o| match op {
                    Cmp::Lt => o == Ordering::Less,
                    Cmp::Le => o != Ordering::Greater,
                    Cmp::Gt => o == Ordering::Greater,
                    Cmp::Ge => o != Ordering::Less,
                    Cmp::Eq | Cmp::Ne => false,
                }),
                _ => false,
            }
        }
        Cond::Between(a, lo, hi) => {
            match (
                operand_value(a, item)?,
                operand_value(lo, item)?,
                operand_value(hi, item)?,
            ) {
                (Some(a), Some(lo), Some(hi)) => {
                    if compare(&lo, &hi) == Some(Ordering::Greater) {
                        return invalid(
                            "Invalid ConditionExpression: The BETWEEN operator requires upper bound to be greater than or equal to lower bound",
                        );
                    }
                    compare(&lo, &a).is_some_and(|o| o != Ordering::Greater)
                        && compare(&a, &hi).is_some_and(|o| o != Ordering::Greater)
                }
                _ => false,
            }
        }
        Cond::In(a, list) => match operand_value(a, item)? {
            None => false,
            Some(a) => {
                let mut found = false;
                for o in list {
                    found |= operand_value(o, item)?.is_some_and(|v| equal(&a, &v));
                }
                found
            }
        },
        Cond::Exists(p) => item.contains_key(p),
        Cond::NotExists(p) => !item.contains_key(p),
        Cond::Type(p, t) => match (item.get(p), operand_value(t, item)?) {
            (Some(v), Some(Av::S(t))) => v.type_name() == t,
            (_, Some(Av::S(_))) => false,
            _ => {
                return invalid(
                    "Invalid ConditionExpression: attribute_type takes a string type name",
                );
            }
        },
        Cond::BeginsWith(a, b) => match (operand_value(a, item)?, operand_value(b, item)?) {
            (Some(Av::S(a)), Some(Av::S(b))) | (Some(Av::B(a)), Some(Av::B(b))) => {
                a.starts_with(&b)
            }
            _ => false,
        },
        Cond::Contains(a, b) => match (operand_value(a, item)?, operand_value(b, item)?) {
            (Some(Av::S(a)), Some(Av::S(b))) => a.contains(&b),
            (Some(Av::Ss(a)), Some(Av::S(b))) | (Some(Av::Ns(a)), Some(Av::N(b))) => a.contains(&b),
            (Some(Av::L(a)), Some(b)) => a.iter().any(|v| equal(v, &b)),
            _ => false,
        },
        Cond::And(a, b) => eval(a, item)? && eval(b, item)?,
        Cond::Or(a, b) => eval(a, item)? || eval(b, item)?,
        Cond::Not(a) => !eval(a, item)?,
    })
}

/// Applies an update to `item` (an absent item: empty), every right-hand side
/// read from the item as it was before the update.
pub fn apply(u: &Update, item: &Item) -> Result<Item, Invalid> {
    let mut out = item.clone();
    for (p, v) in &u.set {
        match operand_value(v, item)? {
            Some(v) => {
                out.insert(p.clone(), v);
            }
            None => {
                return invalid(
                    "The provided expression refers to an attribute that does not exist in the item",
                );
            }
        }
    }
    for p in &u.remove {
        out.remove(p);
    }
    for (p, v) in &u.add {
        let v = operand_value(v, item)?;
        let merged = match (item.get(p), v) {
            (None, Some(v @ (Av::N(_) | Av::Ss(_) | Av::Ns(_) | Av::Bs(_)))) => v,
            (Some(Av::N(x)), Some(Av::N(y))) => {
                Av::N(add_numbers(x, &y, 1).ok_or_else(|| Invalid("Number overflow".into()))?)
            }
            (Some(Av::Ss(x)), Some(Av::Ss(y))) => Av::Ss(union(x, &y)),
            (Some(Av::Ns(x)), Some(Av::Ns(y))) => Av::Ns(union(x, &y)),
            (Some(Av::Bs(x)), Some(Av::Bs(y))) => Av::Bs(union(x, &y)),
            _ => return invalid("An operand in the update expression has an incorrect data type"),
        };
        out.insert(p.clone(), merged);
    }
    for (p, v) in &u.delete {
        let v = operand_value(v, item)?;
        let left = match (item.get(p), v) {
            (None, Some(Av::Ss(_) | Av::Ns(_) | Av::Bs(_))) => None,
            (Some(Av::Ss(x)), Some(Av::Ss(y))) => Some(Av::Ss(minus(x, &y))),
            (Some(Av::Ns(x)), Some(Av::Ns(y))) => Some(Av::Ns(minus(x, &y))),
            (Some(Av::Bs(x)), Some(Av::Bs(y))) => Some(Av::Bs(minus(x, &y))),
            _ => return invalid("An operand in the update expression has an incorrect data type"),
        };
        match left {
            Some(Av::Ss(s) | Av::Ns(s) | Av::Bs(s)) if s.is_empty() => {
                out.remove(p);
            }
            Some(v) => {
                out.insert(p.clone(), v);
            }
            None => {}
        }
    }
    Ok(out)
}

fn union(a: &[String], b: &[String]) -> Vec<String> {
    let mut out = a.to_vec();
    out.extend(b.iter().filter(|s| !a.contains(s)).cloned());
    out
}

fn minus(a: &[String], b: &[String]) -> Vec<String> {
    a.iter().filter(|s| !b.contains(s)).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Av {
        Av::S(v.into())
    }

    fn n(v: i64) -> Av {
        Av::N(v.to_string())
    }

    fn ctx(
        names: &[(&str, &str)],
        values: &[(&str, Av)],
    ) -> (HashMap<String, String>, HashMap<String, Av>) {
        (
            names
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            values
                .iter()
                .map(|(k, v)| ((*k).into(), v.clone()))
                .collect(),
        )
    }

    fn holds(expr: &str, item: &Item, values: &[(&str, Av)]) -> Result<bool, Invalid> {
        let (names, values) = ctx(&[("#status", "status")], values);
        let mut ph = Placeholders::new(&names, &values);
        let c = parse_condition(expr, &mut ph)?;
        eval(&c, item)
    }

    fn item(pairs: &[(&str, Av)]) -> Item {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), v.clone()))
            .collect()
    }

    #[test]
    fn comparisons_of_numbers_are_by_value_not_by_text() {
        let it = item(&[("a", n(9))]);
        assert!(holds("a < :v", &it, &[(":v", n(10))]).unwrap());
        assert!(!holds("a > :v", &it, &[(":v", n(10))]).unwrap());
        assert!(holds("a = :v", &it, &[(":v", Av::N("9.0".into()))]).unwrap());
        assert!(holds("a >= :v AND a <= :v", &it, &[(":v", n(9))]).unwrap());
    }

    #[test]
    fn a_missing_attribute_is_neither_less_nor_equal_but_differs() {
        let it = item(&[]);
        assert!(!holds("a < :v", &it, &[(":v", n(1))]).unwrap());
        assert!(!holds("a = :v", &it, &[(":v", n(1))]).unwrap());
        assert!(holds("a <> :v", &it, &[(":v", n(1))]).unwrap());
    }

    #[test]
    fn values_of_different_types_do_not_order() {
        let it = item(&[("a", s("5"))]);
        assert!(!holds("a < :v", &it, &[(":v", n(10))]).unwrap());
        assert!(!holds("a > :v", &it, &[(":v", n(1))]).unwrap());
    }

    #[test]
    fn and_binds_tighter_than_or_and_not_tightest() {
        let it = item(&[("a", n(1))]);
        let v = [(":one", n(1)), (":two", n(2))];
        // true OR (false AND false)
        assert!(holds("a = :one OR a = :two AND a = :two", &it, &v).unwrap());
        // (true OR false) AND false
        assert!(!holds("(a = :one OR a = :two) AND a = :two", &it, &v).unwrap());
        assert!(holds("NOT a = :two AND a = :one", &it, &v).unwrap());
        assert!(!holds("NOT (a = :two OR a = :one)", &it, &v).unwrap());
    }

    #[test]
    fn functions_test_presence_type_and_prefix() {
        let it = item(&[("pk", s("sim#1")), ("x", n(0))]);
        assert!(holds("attribute_exists(pk)", &it, &[]).unwrap());
        assert!(holds("attribute_not_exists(other)", &it, &[]).unwrap());
        assert!(holds("begins_with(pk, :p)", &it, &[(":p", s("sim#"))]).unwrap());
        assert!(holds("attribute_type(pk, :t)", &it, &[(":t", s("S"))]).unwrap());
        assert!(holds("size(pk) = :n", &it, &[(":n", n(5))]).unwrap());
        assert!(holds("pk IN (:a, :b)", &it, &[(":a", s("x")), (":b", s("sim#1"))]).unwrap());
        assert!(
            holds(
                "size(pk) BETWEEN :a AND :b",
                &it,
                &[(":a", n(1)), (":b", n(5))]
            )
            .unwrap()
        );
    }

    #[test]
    fn placeholders_must_be_defined_and_used_and_reserved_words_named() {
        let it = item(&[]);
        assert!(holds("a = :missing", &it, &[]).is_err());
        assert!(holds("#nope = :v", &it, &[(":v", n(1))]).is_err());
        assert!(holds("status = :v", &it, &[(":v", n(1))]).is_err());
        assert!(holds("#status = :v", &it, &[(":v", n(1))]).is_ok());
        let (names, values) = ctx(&[("#status", "status")], &[(":v", n(1)), (":w", n(2))]);
        let mut ph = Placeholders::new(&names, &values);
        parse_condition("#status = :v", &mut ph).unwrap();
        let err = ph.check_all_used().unwrap_err();
        assert!(err.0.contains(":w"), "{err:?}");
    }

    #[test]
    fn malformed_expressions_are_refused() {
        let it = item(&[]);
        for bad in [
            "a =",
            "(a = :v",
            "a = :v)",
            "a == :v",
            "nosuch(a)",
            "a = :v AND",
            "",
        ] {
            assert!(holds(bad, &it, &[(":v", n(1))]).is_err(), "{bad}");
        }
    }

    fn update(expr: &str, it: &Item, values: &[(&str, Av)]) -> Result<Item, Invalid> {
        let (names, values) = ctx(&[("#status", "status"), ("#result", "result")], values);
        let mut ph = Placeholders::new(&names, &values);
        let u = parse_update(expr, &mut ph)?;
        apply(&u, it)
    }

    #[test]
    fn set_reads_the_old_item_and_if_not_exists_defaults() {
        let it = item(&[("attempts", n(2)), ("x", s("old"))]);
        let v = [(":zero", n(0)), (":one", n(1)), (":s", s("IN_PROGRESS"))];
        let out = update(
            "SET attempts = if_not_exists(attempts, :zero) + :one, #status = :s, y = x REMOVE x",
            &it,
            &v,
        )
        .unwrap();
        assert_eq!(out.get("attempts"), Some(&n(3)));
        assert_eq!(out.get("status"), Some(&s("IN_PROGRESS")));
        assert_eq!(out.get("y"), Some(&s("old")));
        assert!(!out.contains_key("x"));
        let out = update(
            "SET attempts = if_not_exists(attempts, :zero) + :one",
            &item(&[]),
            &v[..2],
        )
        .unwrap();
        assert_eq!(out.get("attempts"), Some(&n(1)));
    }

    #[test]
    fn add_counts_and_unions_and_list_append_concatenates() {
        let it = item(&[
            ("c", n(5)),
            ("tags", Av::Ss(vec!["a".into()])),
            ("l", Av::L(vec![n(1)])),
        ]);
        let v = [
            (":d", n(-2)),
            (":t", Av::Ss(vec!["a".into(), "b".into()])),
            (":l", Av::L(vec![n(2)])),
        ];
        let out = update("ADD c :d, tags :t SET l = list_append(l, :l)", &it, &v).unwrap();
        assert_eq!(out.get("c"), Some(&n(3)));
        assert_eq!(out.get("tags"), Some(&Av::Ss(vec!["a".into(), "b".into()])));
        assert_eq!(out.get("l"), Some(&Av::L(vec![n(1), n(2)])));
        let out = update("ADD fresh :d", &it, &v[..1]).unwrap();
        assert_eq!(out.get("fresh"), Some(&n(-2)));
    }

    #[test]
    fn updates_refuse_overlaps_repeated_clauses_and_wrong_types() {
        let it = item(&[("a", s("x"))]);
        let v = [(":one", n(1))];
        assert!(update("SET b = :one REMOVE b", &it, &v).is_err());
        assert!(update("SET b = :one SET c = :one", &it, &v).is_err());
        assert!(update("SET b = a + :one", &it, &v).is_err());
        assert!(update("SET b = missing", &it, &[]).is_err());
        assert!(update("REMOVE #result", &it, &[]).is_ok());
    }
}
