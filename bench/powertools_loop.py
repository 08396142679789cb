"""The Powertools baseline for bench/run: an SQS consumer in Python (boto3) whose
ledger update runs under Powertools for AWS Lambda's `idempotent_function` with
its DynamoDB persistence layer. Same queue, same effect, CONCURRENCY threads.

Prints the number of messages it deleted.
"""

import json
import os
import sys
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

persistence = DynamoDBPersistenceLayer(table_name=IDEMPOTENCY_TABLE)
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
    deleted = 0
    idle = 0
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        while idle < 3:
            got = sqs.receive_message(
                QueueUrl=QUEUE_URL, MaxNumberOfMessages=10, WaitTimeSeconds=1
            ).get("Messages", [])
            if not got:
                idle += 1
                continue
            idle = 0
            receipts = [r for r in pool.map(handle, got) if r]
            if receipts:
                sqs.delete_message_batch(
                    QueueUrl=QUEUE_URL,
                    Entries=[{"Id": f"m{i}", "ReceiptHandle": r} for i, r in enumerate(receipts)],
                )
                deleted += len(receipts)
    print(deleted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
