"""How long the emulator takes for one transaction of each consumer's shape,
sequentially (no concurrency): sqs-once's fast-path record update (its SET/REMOVE
expression, claim condition and ClientRequestToken) + the ledger update, against
the hand-written loop's conditional put + the same ledger update, and the plain
loop's UpdateItem alone. Two variants tell which part of sqs-once's costs: its
record as a Put of the same attributes under the same condition, and its update
under the loop's condition. The emulator serves DynamoDB one request at a time, so
this per-call time bounds each consumer's throughput there; on DynamoDB a call's
latency does not depend on the expression's length in this way.

Usage: AWS_ENDPOINT_URL=... python bench/localstack/transaction_cost.py [N]  (default 200)
Prints one JSON line: median ms per call by shape.
"""

import hashlib
import json
import statistics
import sys
import time
import uuid

import boto3

N = int(sys.argv[1]) if len(sys.argv) > 1 else 200
ddb = boto3.client("dynamodb", region_name="us-east-1")
suffix = uuid.uuid4().hex[:8]
tables = {k: f"bench-cost-{k}-{suffix}" for k in ("dedup", "ledger")}
for t in tables.values():
    ddb.create_table(
        TableName=t,
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )

# As src/aws/dynamodb/mod.rs has it.
CLAIM_CONDITION = (
    "attribute_not_exists(pk) OR expires_at < :now_s "
    "OR (#status = :failed AND (attribute_not_exists(message_id) OR message_id <> :mid) "
    "AND (attribute_not_exists(claimed_at) OR claimed_at <= :now_ms)) "
    "OR (#status = :in_progress AND lease_until < :now_ms)"
)


def ledger(i):
    return {
        "Update": {
            "TableName": tables["ledger"],
            "Key": {"pk": {"S": f"acct-{i % 10}"}},
            "UpdateExpression": "ADD balance_cents :amount, applied_events :one",
            "ExpressionAttributeValues": {":amount": {"N": str(i)}, ":one": {"N": "1"}},
        }
    }


def sqs_once(i):
    now_ms = int(time.time() * 1000)
    pk = f"bench#evt-{i}-{suffix}"
    owner = str(uuid.uuid4())
    record = {
        "Update": {
            "TableName": tables["dedup"],
            "Key": {"pk": {"S": pk}},
            "UpdateExpression": "SET #status = :completed, #owner = :owner, expires_at = :expires_at, "
            "payload_sha256 = :payload, message_id = :mid, claimed_at = :now_ms, "
            "completed_at = :now_ms, attempts = if_not_exists(attempts, :zero) + :one "
            "REMOVE lease_until, #error",
            "ConditionExpression": CLAIM_CONDITION,
            "ExpressionAttributeNames": {"#status": "status", "#owner": "owner", "#error": "error"},
            "ExpressionAttributeValues": {
                ":now_s": {"N": str(now_ms // 1000)},
                ":now_ms": {"N": str(now_ms)},
                ":failed": {"S": "FAILED"},
                ":in_progress": {"S": "IN_PROGRESS"},
                ":completed": {"S": "COMPLETED"},
                ":owner": {"S": owner},
                ":expires_at": {"N": str(now_ms // 1000 + 604800)},
                ":payload": {"S": hashlib.sha256(pk.encode()).hexdigest()},
                ":mid": {"S": str(uuid.uuid4())},
                ":zero": {"N": "0"},
                ":one": {"N": "1"},
            },
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
    }
    token = hashlib.sha256(f"fast#{pk}#{owner}".encode()).hexdigest()[:36]
    ddb.transact_write_items(TransactItems=[record, ledger(i)], ClientRequestToken=token)


def sqs_once_put(i):
    # sqs-once's record as a Put of the same attributes, same claim condition:
    # whether the update expression or the condition costs.
    now_ms = int(time.time() * 1000)
    pk = f"bench#put-{i}-{suffix}"
    record = {
        "Put": {
            "TableName": tables["dedup"],
            "Item": {
                "pk": {"S": pk},
                "status": {"S": "COMPLETED"},
                "owner": {"S": str(uuid.uuid4())},
                "expires_at": {"N": str(now_ms // 1000 + 604800)},
                "payload_sha256": {"S": hashlib.sha256(pk.encode()).hexdigest()},
                "message_id": {"S": str(uuid.uuid4())},
                "claimed_at": {"N": str(now_ms)},
                "completed_at": {"N": str(now_ms)},
                "attempts": {"N": "1"},
            },
            "ConditionExpression": CLAIM_CONDITION,
            "ExpressionAttributeNames": {"#status": "status"},
            "ExpressionAttributeValues": {
                ":now_s": {"N": str(now_ms // 1000)},
                ":now_ms": {"N": str(now_ms)},
                ":failed": {"S": "FAILED"},
                ":in_progress": {"S": "IN_PROGRESS"},
                ":mid": {"S": str(uuid.uuid4())},
            },
            "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        }
    }
    ddb.transact_write_items(TransactItems=[record, ledger(i)])


def sqs_once_simple_condition(i):
    # sqs-once's record update with the hand-written loop's condition.
    global ddb_tx
    ddb_tx = ddb.transact_write_items

    def strip(**kw):
        item = kw["TransactItems"][0]["Update"]
        item["ConditionExpression"] = "attribute_not_exists(pk)"
        values = item["ExpressionAttributeValues"]
        for k in (":now_s", ":failed", ":in_progress"):
            values.pop(k)
        return ddb_tx(**kw)

    try:
        ddb.transact_write_items = strip
        sqs_once(i + 20_000_000)
    finally:
        ddb.transact_write_items = ddb_tx


def handwritten(i):
    now = int(time.time())
    record = {
        "Put": {
            "TableName": tables["dedup"],
            "Item": {
                "pk": {"S": f"bench#hw-{i}-{suffix}"},
                "status": {"S": "DONE"},
                "completed_at": {"N": str(now)},
                "expires_at": {"N": str(now + 604800)},
            },
            "ConditionExpression": "attribute_not_exists(pk)",
        }
    }
    ddb.transact_write_items(TransactItems=[record, ledger(i)])


def plain(i):
    ddb.update_item(**ledger(i)["Update"])


def sqs_once_without_token(i):
    # The same record update, no ClientRequestToken: which part costs.
    global ddb_tx
    ddb_tx = ddb.transact_write_items
    try:
        ddb.transact_write_items = lambda **kw: ddb_tx(**{k: v for k, v in kw.items() if k != "ClientRequestToken"})
        sqs_once(i + 10_000_000)
    finally:
        ddb.transact_write_items = ddb_tx


out = {}
SHAPES = (
    ("sqs_once", sqs_once),
    ("sqs_once_without_token", sqs_once_without_token),
    ("sqs_once_put", sqs_once_put),
    ("sqs_once_simple_condition", sqs_once_simple_condition),
    ("handwritten", handwritten),
    ("plain", plain),
)
times = {k: [] for k, _ in SHAPES}
for i in range(N):
    # Alternated, so drift in the shared emulator hits all alike.
    for name, f in SHAPES:
        t = time.perf_counter()
        f(i)
        times[name].append((time.perf_counter() - t) * 1000)
for t in tables.values():
    ddb.delete_table(TableName=t)
print(json.dumps({k: round(statistics.median(v), 2) for k, v in times.items()}))
