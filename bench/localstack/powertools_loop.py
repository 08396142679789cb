"""The Powertools baseline for bench/localstack/run: an SQS consumer in Python (boto3) whose
ledger update runs under Powertools for AWS Lambda's `idempotent_function` with
its DynamoDB persistence layer. Same queue, same effect, CONCURRENCY threads.

Prints one JSON line: messages deleted, AWS calls by operation (empty receives
apart; the persistence layer is given this script's DynamoDB client so its
calls are counted too), and the batches' handling time (receive answered to
effects done, without the delete: what a Lambda invocation of the batch takes).
"""

import json
import os
import sys
import time
from collections import Counter
import warnings
from concurrent.futures import ThreadPoolExecutor

import boto3
from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyAlreadyInProgressError,
)

# Outside Lambda there is no remaining-time context; Powertools warns on every call.
warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")

QUEUE_URL = os.environ["QUEUE_URL"]
LEDGER_TABLE = os.environ["LEDGER_TABLE"]
IDEMPOTENCY_TABLE = os.environ["IDEMPOTENCY_TABLE"]
CONCURRENCY = int(os.environ.get("CONCURRENCY", "10"))

sqs = boto3.client("sqs")
ddb = boto3.client("dynamodb")

CALLS = Counter()


def _count(event_name, **_):
    # before-call.<service>.<Operation>: once per API call (retries are inside it).
    _, service, operation = event_name.split(".")
    CALLS[("SQS" if service == "sqs" else "DynamoDB") + "." + operation] += 1


sqs.meta.events.register("before-call.*.*", _count)

# The table Powertools documents: partition key `id`, TTL on `expiration`.
try:
    ddb.create_table(
        TableName=IDEMPOTENCY_TABLE,
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.get_waiter("table_exists").wait(TableName=IDEMPOTENCY_TABLE)
    ddb.update_time_to_live(
        TableName=IDEMPOTENCY_TABLE,
        TimeToLiveSpecification={"Enabled": True, "AttributeName": "expiration"},
    )
except ddb.exceptions.ResourceInUseException:
    pass

ddb.meta.events.register("before-call.*.*", _count)
persistence = DynamoDBPersistenceLayer(table_name=IDEMPOTENCY_TABLE, boto3_client=ddb)
config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=3600)


@idempotent_function(data_keyword_argument="event", persistence_store=persistence, config=config)
def apply(event: dict) -> dict:
    ddb.update_item(
        TableName=LEDGER_TABLE,
        Key={"pk": {"S": event["account"]}},
        UpdateExpression="ADD balance_cents :a, applied_events :one",
        ExpressionAttributeValues={
            ":a": {"N": str(event["amount_cents"])},
            ":one": {"N": "1"},
        },
    )
    return {"ok": True}


def handle(message: dict):
    try:
        apply(event=json.loads(message["Body"]))
        return message["ReceiptHandle"]
    except IdempotencyAlreadyInProgressError:
        # Another copy is running: let this one come back shortly.
        sqs.change_message_visibility(
            QueueUrl=QUEUE_URL, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=2
        )
        return None


def main() -> int:
    CALLS.clear()  # the table set-up above is not the loop's
    deleted = 0
    idle = 0
    empty = 0
    batches = 0
    batch_seconds = 0.0
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        while idle < 3:
            got = sqs.receive_message(
                QueueUrl=QUEUE_URL, MaxNumberOfMessages=10, WaitTimeSeconds=1
            ).get("Messages", [])
            if not got:
                idle += 1
                empty += 1
                continue
            idle = 0
            started = time.monotonic()
            receipts = [r for r in pool.map(handle, got) if r]
            batches += 1
            batch_seconds += time.monotonic() - started
            if receipts:
                sqs.delete_message_batch(
                    QueueUrl=QUEUE_URL,
                    Entries=[{"Id": f"m{i}", "ReceiptHandle": r} for i, r in enumerate(receipts)],
                )
                deleted += len(receipts)
    CALLS["SQS.ReceiveMessage"] -= empty
    print(
        json.dumps(
            {
                "loop": "powertools",
                "handled": deleted,
                "empty_receives": empty,
                "calls": dict(sorted(CALLS.items())),
                "batches": batches,
                "batch_ms_total": batch_seconds * 1000,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
