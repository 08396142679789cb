//! Creating the resources sqs-once needs: the dedup table (key `pk`, TTL on
//! `expires_at`) and queues with a dead-letter queue and redrive policy.
//! `sqs-once init` and [`SqsOnce::ensure_table`](crate::SqsOnce::ensure_table)
//! use it. What exists is never changed unless asked: an existing resource is checked and
//! its differences reported; a change is made only when its [`Change`] is allowed.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    TimeToLiveSpecification,
};
use aws_sdk_sqs::types::QueueAttributeName;
use aws_smithy_types::error::display::DisplayErrorContext;

use crate::aws::dynamodb::{KEY_ATTRIBUTE, TTL_ATTRIBUTE};

type DescribeTableError = aws_sdk_dynamodb::operation::describe_table::DescribeTableError;
type CreateTableError = aws_sdk_dynamodb::operation::create_table::CreateTableError;
type DescribeTtlError = aws_sdk_dynamodb::operation::describe_time_to_live::DescribeTimeToLiveError;
type UpdateTtlError = aws_sdk_dynamodb::operation::update_time_to_live::UpdateTimeToLiveError;
type GetQueueUrlError = aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError;
type GetQueueAttributesError =
    aws_sdk_sqs::operation::get_queue_attributes::GetQueueAttributesError;
type CreateQueueError = aws_sdk_sqs::operation::create_queue::CreateQueueError;
type SetQueueAttributesError =
    aws_sdk_sqs::operation::set_queue_attributes::SetQueueAttributesError;

/// A setup step that failed: what was being done to which resource, with the
/// AWS error (its source) where a call failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// `DescribeTable` failed.
    #[error("describing table {table}: {}", DisplayErrorContext(.source))]
    DescribeTable {
        /// The table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<DescribeTableError>>,
    },
    /// `CreateTable` failed.
    #[error("creating table {table}: {}", DisplayErrorContext(.source))]
    CreateTable {
        /// The table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<CreateTableError>>,
    },
    /// The table was not there right after it was created.
    #[error("table {table}: does not exist right after it was created")]
    TableVanished {
        /// The table.
        table: String,
    },
    /// The table is not keyed by one string partition key `pk`: not a table
    /// sqs-once made. Nothing was written to it.
    #[error(
        "table {table}: has key schema [{keys}], not one string partition key `{key}`: not a table sqs-once made (a wrong --table?); nothing was written to it",
        key = KEY_ATTRIBUTE
    )]
    KeySchema {
        /// The table.
        table: String,
        /// Its keys, as `name:KEY_TYPE`.
        keys: String,
    },
    /// The table did not become `ACTIVE` within 120 s.
    #[error("table {table}: not ACTIVE after 120 s (status {status:?})")]
    TableNotActive {
        /// The table.
        table: String,
        /// Its last status.
        status: Option<String>,
    },
    /// `DescribeTimeToLive` failed.
    #[error("describing TTL of {table}: {}", DisplayErrorContext(.source))]
    DescribeTtl {
        /// The table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<DescribeTtlError>>,
    },
    /// `UpdateTimeToLive` failed.
    #[error("enabling TTL on {table}.{attribute}: {}", DisplayErrorContext(.source), attribute = TTL_ATTRIBUTE)]
    EnableTtl {
        /// The table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<UpdateTtlError>>,
    },
    /// `GetQueueUrl` failed (other than for a queue that does not exist).
    #[error("finding queue {name}: {}", DisplayErrorContext(.source))]
    FindQueue {
        /// The queue's name.
        name: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetQueueUrlError>>,
    },
    /// `GetQueueAttributes` failed.
    #[error("reading queue {url}: {}", DisplayErrorContext(.source))]
    ReadQueue {
        /// The queue's URL.
        url: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetQueueAttributesError>>,
    },
    /// `CreateQueue` failed.
    #[error("creating queue {name}: {}", DisplayErrorContext(.source))]
    CreateQueue {
        /// The queue's name.
        name: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<CreateQueueError>>,
    },
    /// `CreateQueue` answered without the queue's URL.
    #[error("creating queue {name}: no queue URL in the answer")]
    NoQueueUrl {
        /// The queue's name.
        name: String,
    },
    /// A queue's attributes came back without its ARN.
    #[error("reading ARN of {name}: no QueueArn attribute")]
    NoQueueArn {
        /// The queue's name.
        name: String,
    },
    /// The queue to check does not exist.
    #[error("queue {name}: does not exist")]
    QueueMissing {
        /// The queue's name.
        name: String,
    },
    /// `SetQueueAttributes` failed.
    #[error("updating queue {name}: {}", DisplayErrorContext(.source))]
    UpdateQueue {
        /// The queue's name.
        name: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<SetQueueAttributesError>>,
    },
    /// Existing resources differ from what was asked for; nothing was changed.
    #[error("existing resources differ: {}", differences(.0))]
    Differences(Vec<Difference>),
}

fn differences(list: &[Difference]) -> String {
    let list: Vec<String> = list.iter().map(ToString::to_string).collect();
    list.join("; ")
}

/// A change to an existing resource: `init` makes it only when its flag is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Enable TTL on `expires_at` of an existing dedup table.
    EnableTtl,
    /// Set an existing queue's visibility timeout to the one asked for.
    SetVisibilityTimeout,
    /// Point an existing queue's redrive policy at `<name>-dlq` (created if missing).
    SetRedrivePolicy,
}

impl Change {
    /// The `sqs-once init` flag that allows this change.
    pub fn flag(self) -> &'static str {
        match self {
            Change::EnableTtl => "--enable-ttl",
            Change::SetVisibilityTimeout => "--set-visibility-timeout",
            Change::SetRedrivePolicy => "--set-redrive-policy",
        }
    }
}

/// How an existing resource differs from what was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The resource.
    pub what: String,
    /// What differs.
    pub problem: String,
    /// The change that would fix it, if `init` can make it.
    pub fix: Option<Change>,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, self.problem)?;
        match self.fix {
            Some(c) => write!(
                f,
                " (left as it is; `sqs-once init {}` changes it)",
                c.flag()
            ),
            None => write!(f, " (left as it is; init does not change this)"),
        }
    }
}

/// What an `init_*` call did and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Resources created (they did not exist).
    pub created: Vec<String>,
    /// Changes made to existing resources (each allowed by its flag).
    pub changed: Vec<String>,
    /// Differences left as they are.
    pub differences: Vec<Difference>,
}

impl Outcome {
    /// Adds what another call did and found.
    pub fn merge(&mut self, other: Outcome) {
        self.created.extend(other.created);
        self.changed.extend(other.changed);
        self.differences.extend(other.differences);
    }

    fn into_result(self) -> Result<(), SetupError> {
        if self.differences.is_empty() {
            return Ok(());
        }
        Err(SetupError::Differences(self.differences))
    }
}

/// The keys (`name:KEY_TYPE`) of a table that is not keyed by one string
/// partition key `pk`; `None` for one that is.
fn wrong_keys(t: &aws_sdk_dynamodb::types::TableDescription) -> Option<String> {
    let keys: Vec<String> = t
        .key_schema()
        .iter()
        .map(|k| format!("{}:{}", k.attribute_name(), k.key_type().as_str()))
        .collect();
    let pk_is_string = t.attribute_definitions().iter().any(|d| {
        d.attribute_name() == KEY_ATTRIBUTE && *d.attribute_type() == ScalarAttributeType::S
    });
    let ok = t.key_schema().len() == 1
        && t.key_schema()[0].attribute_name() == KEY_ATTRIBUTE
        && *t.key_schema()[0].key_type() == KeyType::Hash
        && pk_is_string;
    (!ok).then(|| keys.join(", "))
}

/// The table's description, `None` when it does not exist.
async fn describe(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<Option<aws_sdk_dynamodb::types::TableDescription>, SetupError> {
    match client.describe_table().table_name(table).send().await {
        Ok(d) => Ok(d.table),
        Err(e)
            if e.as_service_error()
                .is_some_and(|e| e.is_resource_not_found_exception()) =>
        {
            Ok(None)
        }
        Err(e) => Err(SetupError::DescribeTable {
            table: table.to_owned(),
            source: e.into(),
        }),
    }
}

async fn create_table(client: &aws_sdk_dynamodb::Client, table: &str) -> Result<bool, SetupError> {
    let created = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name(KEY_ATTRIBUTE)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("complete attribute definition"),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name(KEY_ATTRIBUTE)
                .key_type(KeyType::Hash)
                .build()
                .expect("complete key schema"),
        )
        .send()
        .await;
    match created {
        Ok(_) => Ok(true),
        // Created at the same time by someone else: checked like an existing one.
        Err(e)
            if e.as_service_error()
                .is_some_and(|e| e.is_resource_in_use_exception()) =>
        {
            Ok(false)
        }
        Err(e) => Err(SetupError::CreateTable {
            table: table.to_owned(),
            source: e.into(),
        }),
    }
}

/// Creates a table with one string partition key `pk` (on-demand billing) if it
/// does not exist; an existing table is only checked: one with other keys is an
/// error and nothing is written to it. Waits until the table is active; `true`
/// when this call created it.
pub async fn init_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<bool, SetupError> {
    let mut created = false;
    if describe(client, table).await?.is_none() {
        created = create_table(client, table).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let t = describe(client, table)
            .await?
            .ok_or_else(|| SetupError::TableVanished {
                table: table.to_owned(),
            })?;
        if let Some(keys) = wrong_keys(&t) {
            return Err(SetupError::KeySchema {
                table: table.to_owned(),
                keys,
            });
        }
        let status = t.table_status().map(|s| s.as_str().to_owned());
        if status.as_deref() == Some("ACTIVE") {
            return Ok(created);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(SetupError::TableNotActive {
                table: table.to_owned(),
                status,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// [`init_table`] without the flag.
pub async fn ensure_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<(), SetupError> {
    init_table(client, table).await.map(|_| ())
}

/// Creates the dedup table with TTL on `expires_at` if it does not exist. An
/// existing table's key schema is checked before anything is written to it;
/// missing TTL on an existing table is a [`Difference`], enabled only when
/// `allow` holds [`Change::EnableTtl`].
pub async fn init_dedup_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
    allow: &[Change],
) -> Result<Outcome, SetupError> {
    let mut outcome = Outcome::default();
    let created = init_table(client, table).await?;
    if created {
        outcome.created.push(format!("table {table}"));
    }
    let ttl = client
        .describe_time_to_live()
        .table_name(table)
        .send()
        .await
        .map_err(|e| SetupError::DescribeTtl {
            table: table.to_owned(),
            source: e.into(),
        })?;
    let desc = ttl.time_to_live_description();
    let attr = desc.and_then(|d| d.attribute_name());
    let status = desc
        .and_then(|d| d.time_to_live_status())
        .map_or("DISABLED", |s| s.as_str());
    let on = matches!(status, "ENABLED" | "ENABLING");
    if on && attr == Some(TTL_ATTRIBUTE) {
        return Ok(outcome);
    }
    if on {
        outcome.differences.push(Difference {
            what: format!("table {table}"),
            problem: format!(
                "TTL is {status} on {}, not on {TTL_ATTRIBUTE}: records never expire (DynamoDB allows one TTL attribute; change it yourself if this is the dedup table)",
                attr.unwrap_or("another attribute")
            ),
            fix: None,
        });
        return Ok(outcome);
    }
    if !created && !allow.contains(&Change::EnableTtl) {
        outcome.differences.push(Difference {
            what: format!("table {table}"),
            problem: format!("TTL is {status}: records on {TTL_ATTRIBUTE} never expire"),
            fix: Some(Change::EnableTtl),
        });
        return Ok(outcome);
    }
    client
        .update_time_to_live()
        .table_name(table)
        .time_to_live_specification(
            TimeToLiveSpecification::builder()
                .attribute_name(TTL_ATTRIBUTE)
                .enabled(true)
                .build()
                .expect("complete TTL specification"),
        )
        .send()
        .await
        .map_err(|e| SetupError::EnableTtl {
            table: table.to_owned(),
            source: e.into(),
        })?;
    if !created {
        outcome
            .changed
            .push(format!("table {table}: TTL enabled on {TTL_ATTRIBUTE}"));
    }
    Ok(outcome)
}

/// Creates the dedup table (key checked first if it exists) and enables TTL on
/// `expires_at` if it is off; any other difference is an error.
pub async fn ensure_dedup_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<(), SetupError> {
    init_dedup_table(client, table, &[Change::EnableTtl])
        .await?
        .into_result()
}

/// The URLs of a queue and its dead-letter queue.
#[derive(Debug, Clone)]
pub struct QueuePair {
    /// The source queue.
    pub queue_url: String,
    /// Its DLQ.
    pub dlq_url: String,
}

/// The queue and DLQ names [`ensure_queue_with_dlq`] uses for `name`.
fn queue_names(name: &str, fifo: bool) -> (String, String) {
    let base = name.trim_end_matches(".fifo");
    if fifo {
        (format!("{base}.fifo"), format!("{base}-dlq.fifo"))
    } else {
        (base.to_owned(), format!("{base}-dlq"))
    }
}

/// What [`init_queue_with_dlq`] is asked for. `None` settings are compared
/// with an existing queue only when given; a new queue gets the defaults
/// (60 s visibility, 5 receives).
#[derive(Debug, Clone)]
pub struct QueueSpec {
    /// The queue's name (`.fifo` is appended for FIFO queues when missing).
    pub name: String,
    /// FIFO queue and DLQ.
    pub fifo: bool,
    /// The visibility timeout.
    pub visibility_timeout: Option<Duration>,
    /// Receives before SQS moves a message to the DLQ.
    pub max_receive_count: Option<u32>,
}

/// What [`init_queue_with_dlq`] found and did.
#[derive(Debug, Clone)]
pub struct QueueInit {
    /// The queue.
    pub queue_url: String,
    /// `<name>-dlq` when the queue's redrive policy sends to it.
    pub dlq_url: Option<String>,
    /// Created, changed, different.
    pub outcome: Outcome,
}

async fn queue_url(client: &aws_sdk_sqs::Client, name: &str) -> Result<Option<String>, SetupError> {
    match client.get_queue_url().queue_name(name).send().await {
        Ok(o) => Ok(o.queue_url),
        Err(e)
            if e.as_service_error()
                .is_some_and(|s| s.is_queue_does_not_exist()) =>
        {
            Ok(None)
        }
        Err(e) => Err(SetupError::FindQueue {
            name: name.to_owned(),
            source: e.into(),
        }),
    }
}

async fn queue_attributes(
    client: &aws_sdk_sqs::Client,
    url: &str,
) -> Result<HashMap<QueueAttributeName, String>, SetupError> {
    client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .map_err(|e| SetupError::ReadQueue {
            url: url.to_owned(),
            source: e.into(),
        })
        .map(|o| o.attributes.unwrap_or_default())
}

async fn create_queue(
    client: &aws_sdk_sqs::Client,
    name: &str,
    attrs: HashMap<QueueAttributeName, String>,
) -> Result<String, SetupError> {
    client
        .create_queue()
        .queue_name(name)
        .set_attributes(Some(attrs))
        .send()
        .await
        .map_err(|e| SetupError::CreateQueue {
            name: name.to_owned(),
            source: e.into(),
        })?
        .queue_url
        .ok_or_else(|| SetupError::NoQueueUrl {
            name: name.to_owned(),
        })
}

/// The DLQ `name` (created if missing) and its ARN.
async fn dlq(
    client: &aws_sdk_sqs::Client,
    name: &str,
    fifo: bool,
    outcome: &mut Outcome,
) -> Result<(String, String), SetupError> {
    let url = match queue_url(client, name).await? {
        Some(url) => url,
        None => {
            let mut attrs = HashMap::from([(
                QueueAttributeName::MessageRetentionPeriod,
                "1209600".to_owned(),
            )]);
            if fifo {
                attrs.insert(QueueAttributeName::FifoQueue, "true".to_owned());
            }
            let url = create_queue(client, name, attrs).await?;
            outcome.created.push(format!("queue {name}"));
            url
        }
    };
    let arn = queue_attributes(client, &url)
        .await?
        .remove(&QueueAttributeName::QueueArn)
        .ok_or_else(|| SetupError::NoQueueArn {
            name: name.to_owned(),
        })?;
    Ok((url, arn))
}

fn redrive_policy(dlq_arn: &str, max_receive_count: u32) -> String {
    serde_json::json!({
        "deadLetterTargetArn": dlq_arn,
        "maxReceiveCount": max_receive_count.to_string(),
    })
    .to_string()
}

/// Creates the queue `name` and `name-dlq` with a redrive policy if the queue
/// does not exist. An existing queue is compared, never changed unless `allow`
/// holds the change: its visibility timeout (when `spec` gives one) and its
/// redrive policy (to `name-dlq`, after `max_receive_count` receives when given).
pub async fn init_queue_with_dlq(
    client: &aws_sdk_sqs::Client,
    spec: &QueueSpec,
    allow: &[Change],
) -> Result<QueueInit, SetupError> {
    let (qname, dname) = queue_names(&spec.name, spec.fifo);
    let mut outcome = Outcome::default();
    let Some(url) = queue_url(client, &qname).await? else {
        let (dlq_url, dlq_arn) = dlq(client, &dname, spec.fifo, &mut outcome).await?;
        let vt = spec.visibility_timeout.unwrap_or(Duration::from_secs(60));
        let mut attrs = HashMap::from([
            (
                QueueAttributeName::VisibilityTimeout,
                vt.as_secs().to_string(),
            ),
            (
                QueueAttributeName::RedrivePolicy,
                redrive_policy(&dlq_arn, spec.max_receive_count.unwrap_or(5)),
            ),
        ]);
        if spec.fifo {
            attrs.insert(QueueAttributeName::FifoQueue, "true".to_owned());
        }
        let queue_url = create_queue(client, &qname, attrs).await?;
        outcome.created.push(format!("queue {qname}"));
        return Ok(QueueInit {
            queue_url,
            dlq_url: Some(dlq_url),
            outcome,
        });
    };
    compare_queue(client, spec, url, allow, outcome).await
}

/// Checks, creating and changing nothing, that the queue exists and has the
/// settings `spec` asks for (as [`init_queue_with_dlq`] compares them); a
/// missing queue is an error.
pub async fn check_queue(
    client: &aws_sdk_sqs::Client,
    spec: &QueueSpec,
) -> Result<QueueInit, SetupError> {
    let (qname, _) = queue_names(&spec.name, spec.fifo);
    let url = queue_url(client, &qname)
        .await?
        .ok_or(SetupError::QueueMissing { name: qname })?;
    compare_queue(client, spec, url, &[], Outcome::default()).await
}

/// Compares an existing queue with `spec`; changes only what `allow` allows.
async fn compare_queue(
    client: &aws_sdk_sqs::Client,
    spec: &QueueSpec,
    url: String,
    allow: &[Change],
    mut outcome: Outcome,
) -> Result<QueueInit, SetupError> {
    let (qname, dname) = queue_names(&spec.name, spec.fifo);
    let attrs = queue_attributes(client, &url).await?;
    let mut set = HashMap::new();
    if let Some(want) = spec.visibility_timeout {
        let have = attrs
            .get(&QueueAttributeName::VisibilityTimeout)
            .cloned()
            .unwrap_or_default();
        if have != want.as_secs().to_string() {
            let problem = format!("visibility timeout is {have} s, not {} s", want.as_secs());
            if allow.contains(&Change::SetVisibilityTimeout) {
                outcome
                    .changed
                    .push(format!("queue {qname}: {problem}: set"));
                set.insert(
                    QueueAttributeName::VisibilityTimeout,
                    want.as_secs().to_string(),
                );
            } else {
                outcome.differences.push(Difference {
                    what: format!("queue {qname}"),
                    problem,
                    fix: Some(Change::SetVisibilityTimeout),
                });
            }
        }
    }
    let dlq_url = compare_redrive(
        client,
        spec,
        &qname,
        &dname,
        &attrs,
        allow,
        &mut outcome,
        &mut set,
    )
    .await?;
    if !set.is_empty() {
        client
            .set_queue_attributes()
            .queue_url(&url)
            .set_attributes(Some(set))
            .send()
            .await
            .map_err(|e| SetupError::UpdateQueue {
                name: qname.clone(),
                source: e.into(),
            })?;
    }
    Ok(QueueInit {
        queue_url: url,
        dlq_url,
        outcome,
    })
}

/// Compares an existing queue's redrive policy with `dname` (and the receive
/// count when given); adds the new policy to `set` when allowed. The DLQ's URL
/// when the policy (as it will be) sends to `dname`.
#[allow(clippy::too_many_arguments)]
async fn compare_redrive(
    client: &aws_sdk_sqs::Client,
    spec: &QueueSpec,
    qname: &str,
    dname: &str,
    attrs: &HashMap<QueueAttributeName, String>,
    allow: &[Change],
    outcome: &mut Outcome,
    set: &mut HashMap<QueueAttributeName, String>,
) -> Result<Option<String>, SetupError> {
    let policy = attrs
        .get(&QueueAttributeName::RedrivePolicy)
        .and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok());
    let target = policy
        .as_ref()
        .and_then(|p| p["deadLetterTargetArn"].as_str().map(str::to_owned));
    let count = policy.as_ref().and_then(|p| match &p["maxReceiveCount"] {
        serde_json::Value::String(s) => s.parse::<u32>().ok(),
        v => v.as_u64().and_then(|n| u32::try_from(n).ok()),
    });
    let existing_dlq = queue_url(client, dname).await?;
    let existing_arn = match &existing_dlq {
        Some(u) => queue_attributes(client, u)
            .await?
            .remove(&QueueAttributeName::QueueArn),
        None => None,
    };
    let problem = match (&target, &existing_arn) {
        (Some(t), Some(a)) if t == a => match (spec.max_receive_count, count) {
            (Some(want), Some(have)) if want != have => Some(format!(
                "its redrive policy moves a message to {dname} after {have} receives, not {want}"
            )),
            _ => None,
        },
        (Some(t), _) => Some(format!("its redrive policy sends to {t}, not to {dname}")),
        (None, _) => Some(format!(
            "has no redrive policy: a message that keeps failing is retried until its retention ends instead of moving to {dname}"
        )),
    };
    let Some(problem) = problem else {
        return Ok(existing_dlq);
    };
    if !allow.contains(&Change::SetRedrivePolicy) {
        outcome.differences.push(Difference {
            what: format!("queue {qname}"),
            problem,
            fix: Some(Change::SetRedrivePolicy),
        });
        return Ok(None);
    }
    let (dlq_url, dlq_arn) = dlq(client, dname, spec.fifo, outcome).await?;
    let receives = spec.max_receive_count.or(count).unwrap_or(5);
    set.insert(
        QueueAttributeName::RedrivePolicy,
        redrive_policy(&dlq_arn, receives),
    );
    outcome.changed.push(format!(
        "queue {qname}: {problem}: now sends to {dname} after {receives} receives"
    ));
    Ok(Some(dlq_url))
}

/// Creates `name` and `name-dlq` as [`init_queue_with_dlq`] does; an existing
/// queue that differs is an error (nothing is changed).
pub async fn ensure_queue_with_dlq(
    client: &aws_sdk_sqs::Client,
    name: &str,
    fifo: bool,
    visibility_timeout: Duration,
    max_receive_count: u32,
) -> Result<QueuePair, SetupError> {
    let spec = QueueSpec {
        name: name.to_owned(),
        fifo,
        visibility_timeout: Some(visibility_timeout),
        max_receive_count: Some(max_receive_count),
    };
    let init = init_queue_with_dlq(client, &spec, &[]).await?;
    let queue_url = init.queue_url.clone();
    let dlq_url = init.dlq_url.clone();
    init.outcome.into_result()?;
    Ok(QueuePair {
        queue_url,
        dlq_url: dlq_url.unwrap_or_default(),
    })
}

/// Whether `endpoint` (an SDK endpoint URL override) is on this machine or
/// LocalStack's: a loopback address, `localhost` or a name under it,
/// `localstack`, or `localhost.localstack.cloud` and its names. No endpoint
/// means AWS's own. What `sqs-once demo`, `sqs-once local-lambda` and
/// [`SqsOnce::ensure_table`](crate::SqsOnce::ensure_table) create or run
/// against without being told to go remote.
pub fn is_local_endpoint(endpoint: Option<&str>) -> bool {
    let Some(endpoint) = endpoint else {
        return false;
    };
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.split(':').next().unwrap_or_default(),
    }
    .to_ascii_lowercase();
    host.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
        || host == "localhost"
        || host == "localstack"
        || host.ends_with(".localhost")
        || host == "localhost.localstack.cloud"
        || host.ends_with(".localhost.localstack.cloud")
}

#[cfg(test)]
mod tests {
    use super::is_local_endpoint;

    #[test]
    fn only_local_endpoints_are_local() {
        for local in [
            "http://localhost:4566",
            "http://127.0.0.1:4566/",
            "http://[::1]:4566",
            "http://localstack:4566",
            "https://s3.localhost.localstack.cloud:4566",
        ] {
            assert!(is_local_endpoint(Some(local)), "{local}");
        }
        for remote in [
            "https://sqs.us-east-1.amazonaws.com",
            "http://localhost.evil.example",
            "http://127.0.0.1.example.com",
            "https://localstack.example.com",
        ] {
            assert!(!is_local_endpoint(Some(remote)), "{remote}");
        }
        assert!(!is_local_endpoint(None), "no endpoint is AWS");
    }
}
