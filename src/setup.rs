//! Creating the resources sqs-once needs: the dedup table (key `pk`, TTL on
//! `expires_at`) and queues with a dead-letter queue and redrive policy.
//! Idempotent: existing resources are checked, missing settings are added.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    TimeToLiveSpecification,
};
use aws_sdk_sqs::types::QueueAttributeName;
use aws_smithy_types::error::display::DisplayErrorContext;

use crate::dedup::dynamodb::{KEY_ATTRIBUTE, TTL_ATTRIBUTE};

/// A setup step that failed.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {reason}")]
pub struct SetupError {
    what: String,
    reason: String,
}

fn err(what: impl Into<String>, e: impl std::error::Error) -> SetupError {
    SetupError {
        what: what.into(),
        reason: DisplayErrorContext(e).to_string(),
    }
}

/// Creates a table with one string partition key `pk` (on-demand billing) unless
/// it exists, and waits until it is active.
pub async fn ensure_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<(), SetupError> {
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
    if let Err(e) = created
        && !e
            .as_service_error()
            .is_some_and(|e| e.is_resource_in_use_exception())
    {
        return Err(err(format!("creating table {table}"), e));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let d = client
            .describe_table()
            .table_name(table)
            .send()
            .await
            .map_err(|e| err(format!("describing table {table}"), e))?;
        let status = d
            .table()
            .and_then(|t| t.table_status())
            .map(|s| s.as_str().to_owned());
        if status.as_deref() == Some("ACTIVE") {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(SetupError {
                what: format!("table {table}"),
                reason: format!("not ACTIVE after 120 s (status {status:?})"),
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Creates the dedup table and enables TTL on `expires_at`.
pub async fn ensure_dedup_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<(), SetupError> {
    ensure_table(client, table).await?;
    let ttl = client
        .describe_time_to_live()
        .table_name(table)
        .send()
        .await
        .map_err(|e| err(format!("describing TTL of {table}"), e))?;
    let on = ttl.time_to_live_description().is_some_and(|d| {
        d.attribute_name() == Some(TTL_ATTRIBUTE)
            && matches!(
                d.time_to_live_status().map(|s| s.as_str()),
                Some("ENABLED" | "ENABLING")
            )
    });
    if !on {
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
            .map_err(|e| err(format!("enabling TTL on {table}.{TTL_ATTRIBUTE}"), e))?;
    }
    Ok(())
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

/// Checks, changing nothing, that the queue `name` and its `name-dlq` exist and
/// that the queue's redrive policy sends to that DLQ.
pub async fn check_queue_with_dlq(
    client: &aws_sdk_sqs::Client,
    name: &str,
    fifo: bool,
) -> Result<QueuePair, SetupError> {
    let (qname, dname) = queue_names(name, fifo);
    let url_of = |n: String| async move {
        client
            .get_queue_url()
            .queue_name(&n)
            .send()
            .await
            .map_err(|e| SetupError {
                what: format!("queue {n}"),
                reason: e
                    .as_service_error()
                    .filter(|s| s.is_queue_does_not_exist())
                    .map_or_else(
                        || DisplayErrorContext(&e).to_string(),
                        |_| "does not exist".into(),
                    ),
            })?
            .queue_url
            .ok_or_else(|| SetupError {
                what: format!("queue {n}"),
                reason: "no URL in the answer".into(),
            })
    };
    let queue_url = url_of(qname.clone()).await?;
    let dlq_url = url_of(dname.clone()).await?;
    let attrs = |url: String| async move {
        client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(|e| err(format!("reading queue {url}"), e))
            .map(|o| o.attributes.unwrap_or_default())
    };
    let q = attrs(queue_url.clone()).await?;
    let d = attrs(dlq_url.clone()).await?;
    let dlq_arn = d
        .get(&QueueAttributeName::QueueArn)
        .cloned()
        .unwrap_or_default();
    let target = q
        .get(&QueueAttributeName::RedrivePolicy)
        .and_then(|p| serde_json::from_str::<serde_json::Value>(p).ok())
        .and_then(|p| p["deadLetterTargetArn"].as_str().map(str::to_owned));
    match target {
        Some(t) if t == dlq_arn => Ok(QueuePair { queue_url, dlq_url }),
        Some(t) => Err(SetupError {
            what: format!("queue {qname}"),
            reason: format!("its redrive policy sends to {t}, not to {dname}"),
        }),
        None => Err(SetupError {
            what: format!("queue {qname}"),
            reason: format!(
                "has no redrive policy: a message that keeps failing is retried until its retention ends instead of moving to {dname}"
            ),
        }),
    }
}

/// Creates `name` (with `.fifo` appended for FIFO queues when missing) and
/// `name-dlq`, with a redrive policy after `max_receive_count` receives.
pub async fn ensure_queue_with_dlq(
    client: &aws_sdk_sqs::Client,
    name: &str,
    fifo: bool,
    visibility_timeout: Duration,
    max_receive_count: u32,
) -> Result<QueuePair, SetupError> {
    let (qname, dname) = queue_names(name, fifo);
    let mut common = HashMap::new();
    if fifo {
        common.insert(QueueAttributeName::FifoQueue, "true".to_owned());
    }
    let dlq_url = client
        .create_queue()
        .queue_name(&dname)
        .set_attributes(Some(
            common
                .clone()
                .into_iter()
                .chain([(
                    QueueAttributeName::MessageRetentionPeriod,
                    "1209600".to_owned(),
                )])
                .collect(),
        ))
        .send()
        .await
        .map_err(|e| err(format!("creating queue {dname}"), e))?
        .queue_url
        .ok_or_else(|| SetupError {
            what: format!("creating queue {dname}"),
            reason: "no queue URL in the answer".into(),
        })?;
    let dlq_arn = client
        .get_queue_attributes()
        .queue_url(&dlq_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| err(format!("reading ARN of {dname}"), e))?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| SetupError {
            what: format!("reading ARN of {dname}"),
            reason: "no QueueArn attribute".into(),
        })?;
    let redrive = serde_json::json!({
        "deadLetterTargetArn": dlq_arn,
        "maxReceiveCount": max_receive_count.to_string(),
    })
    .to_string();
    let mut attrs = common;
    attrs.insert(
        QueueAttributeName::VisibilityTimeout,
        visibility_timeout.as_secs().to_string(),
    );
    attrs.insert(QueueAttributeName::RedrivePolicy, redrive);
    let created = client
        .create_queue()
        .queue_name(&qname)
        .set_attributes(Some(attrs.clone()))
        .send()
        .await;
    let queue_url = match created {
        Ok(out) => out.queue_url.unwrap_or_default(),
        // Exists with other attributes: set ours.
        Err(e)
            if e.as_service_error()
                .is_some_and(|e| e.is_queue_name_exists()) =>
        {
            let url = client
                .get_queue_url()
                .queue_name(&qname)
                .send()
                .await
                .map_err(|e| err(format!("finding queue {qname}"), e))?
                .queue_url
                .unwrap_or_default();
            attrs.remove(&QueueAttributeName::FifoQueue);
            client
                .set_queue_attributes()
                .queue_url(&url)
                .set_attributes(Some(attrs))
                .send()
                .await
                .map_err(|e| err(format!("updating queue {qname}"), e))?;
            url
        }
        Err(e) => return Err(err(format!("creating queue {qname}"), e)),
    };
    Ok(QueuePair { queue_url, dlq_url })
}
