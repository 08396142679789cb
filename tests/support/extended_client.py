"""Sends messages through the Amazon SQS Extended Client Library for Python
(`amazon-sqs-extended-client`, installed by tools/setup-extended-client), so
that the tests read what a real extended client writes.

Reads one JSON object on stdin:
  {"queue_url": ..., "bucket": ..., "messages": [{"body": ..., "legacy": false,
   "always": false}, ...]}
sends the messages in order (`legacy`: the 1.x attribute and pointer class;
`always`: through S3 even when small) and prints their message ids as a JSON
list. With `"receive": n` instead of `messages`, receives until it has n
messages (or 20 empty receives), deletes them, and prints their bodies as the
extended client hands them over (payloads read from S3) as a JSON list. Endpoints, region and credentials come from the environment
(AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, AWS_DEFAULT_REGION, ...).
"""

import json
import sys

from sqs_extended_client import SQSExtendedClientSession


def main() -> None:
    request = json.load(sys.stdin)
    sqs = SQSExtendedClientSession().client("sqs")
    sqs.large_payload_support = request["bucket"]
    if "receive" in request:
        json.dump(receive(sqs, request["queue_url"], int(request["receive"])), sys.stdout)
        return
    ids = []
    for message in request["messages"]:
        sqs.use_legacy_attribute = bool(message.get("legacy", False))
        sqs.always_through_s3 = bool(message.get("always", False))
        sent = sqs.send_message(QueueUrl=request["queue_url"], MessageBody=message["body"])
        ids.append(sent["MessageId"])
    json.dump(ids, sys.stdout)


def receive(sqs, queue_url: str, n: int) -> list:
    bodies = []
    empty = 0
    while len(bodies) < n and empty < 20:
        got = sqs.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1,
            MessageAttributeNames=["All"],
        ).get("Messages", [])
        empty = 0 if got else empty + 1
        for message in got:
            bodies.append(message["Body"])
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
    return bodies


if __name__ == "__main__":
    main()
