#!/bin/sh
# Runs inside the LocalStack container once it is ready. The tests and the demo
# create their own uniquely named resources, so nothing needs creating here;
# this hook only warms DynamoDB so the first test does not pay for its start.
awslocal dynamodb list-tables >/dev/null
echo "sqs-once: LocalStack ready"
