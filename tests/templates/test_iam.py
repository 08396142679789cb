"""The IAM actions each role grants against the AWS calls the code makes.

The calls are read from the source: every SDK fluent call (`.get_item()`,
`.send_message_batch()`, ...) whose name is an operation of a service the
crates use (the operation names come from botocore's service models, which the
tools venv has). A consumer's calls are those of `src/` (test code left out)
except `src/aws/setup.rs`, the resource setup that `sqs-once init` and the
development-only `SqsOnce::ensure_table` share; the operator tool's are those
of `cli/src/` plus that setup, and are documented, not granted to a consumer.

Each consumer call's IAM action must be granted by the Lambda function's role
(template.yaml), the ECS task role (infra/ecs.yaml) and the two policy blocks
users copy (docs/iam/), unless listed below with a reason; and each action they
grant must be one the code calls, unless listed with a reason. The operator
tool's actions must each be named in docs/permissions.md.

Run with the tools venv: `scripts/check-templates`. Run this file directly
(`tools/.venv/bin/python tests/templates/test_iam.py --list`) to print the
calls and the actions they map to.
"""

import json
import re
import sys
import unittest

import botocore.session
from botocore import xform_name

from cfn import ROOT, load, resolve

# The services whose SDK crates the code uses, by botocore's name, with the
# IAM prefix of their actions.
SERVICES = {"sqs": "sqs", "dynamodb": "dynamodb", "s3": "s3"}

# Operations whose IAM action is not `prefix:OperationName`.
ACTIONS = {
    # SQS authorizes a batch as its single-message action.
    ("sqs", "SendMessageBatch"): {"sqs:SendMessage"},
    ("sqs", "DeleteMessageBatch"): {"sqs:DeleteMessage"},
    ("sqs", "ChangeMessageVisibilityBatch"): {"sqs:ChangeMessageVisibility"},
    # DynamoDB authorizes each item of a transaction with its item action:
    # the library's transactions put or update the dedup record (a handler's
    # staged writes go to its own tables, granted by its own statements).
    ("dynamodb", "TransactWriteItems"): {"dynamodb:PutItem", "dynamodb:UpdateItem"},
}

# Setup code: called by `sqs-once init` and by `SqsOnce::ensure_table` (which
# refuses a non-local endpoint unless told), never by a deployed consumer.
SETUP_FILES = {"src/aws/setup.rs"}

# Calls a role may leave ungranted, and why.
CALLS_NOT_GRANTED = {
    "template.yaml": {
        "s3:PutObject": "outgoing bodies too large for SQS stored in S3 (SQS_ONCE_OUTBOX_PAYLOAD_BUCKET), which the template does not set",
    },
    "infra/ecs.yaml": {
        "s3:PutObject": "outgoing bodies too large for SQS stored in S3 (SQS_ONCE_OUTBOX_PAYLOAD_BUCKET), which the template does not set",
    },
    "docs/iam/poller-policy.json": {},
    "docs/iam/lambda-policy.json": {},
}

# Grants no call of the code needs, and why.
LOGS = "Lambda writes the function's stdout and stderr to its log group with the function's role"
LIST_BUCKET = "without it S3 answers GetObject of a missing object with 403 instead of NoSuchKey, and the message is retried rather than parked"
KMS = "SQS, DynamoDB and S3 call KMS with the role's credentials for data encrypted with a customer managed key (KmsKeyArn)"
GRANTS_NOT_CALLED = {
    "template.yaml": {
        "logs:CreateLogStream": LOGS,
        "logs:PutLogEvents": LOGS,
        "s3:ListBucket": LIST_BUCKET,
        "kms:Decrypt": KMS,
        "kms:GenerateDataKey": KMS,
    },
    "infra/ecs.yaml": {
        "s3:ListBucket": LIST_BUCKET,
        "kms:Decrypt": KMS,
        "kms:GenerateDataKey": KMS,
    },
    "docs/iam/poller-policy.json": {"s3:ListBucket": LIST_BUCKET},
    "docs/iam/lambda-policy.json": {
        "logs:CreateLogStream": LOGS,
        "logs:PutLogEvents": LOGS,
        "s3:ListBucket": LIST_BUCKET,
    },
}


def operations():
    """{snake_case name: (service, OperationName)} of the services' operations;
    a name two services share maps to None (a call of it is ambiguous)."""
    session = botocore.session.get_session()
    by_name = {}
    for service in SERVICES:
        for op in session.get_service_model(service).operation_names:
            name = xform_name(op)
            by_name[name] = None if name in by_name else (service, op)
    return by_name


def production_code(text):
    """The file without comments and without its `#[cfg(test)] mod tests`."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip().startswith("#[cfg(test)]") and i + 1 < len(lines) and lines[i + 1].strip().startswith("mod tests"):
            break
        out.append(line.split("//")[0])
    return "\n".join(out)


def sdk_calls(paths):
    """{(service, OperationName): sorted files calling it} in the Rust files
    under `paths` (relative to the repository), test code left out."""
    ops = operations()
    calls = {}
    for base in paths:
        root = ROOT / base
        files = [root] if root.is_file() else sorted(root.rglob("*.rs"))
        for f in files:
            rel = str(f.relative_to(ROOT))
            if f.name.endswith("tests.rs") or "/testkit/" in rel:
                continue
            for name in re.findall(r"\.([a-z][a-z0-9_]*)\(\)", production_code(f.read_text())):
                if name not in ops:
                    continue
                assert ops[name] is not None, f"{rel}: `.{name}()` is an operation of more than one service: say which in test_iam.py"
                calls.setdefault(ops[name], set()).add(rel)
    return {op: sorted(files) for op, files in calls.items()}


def actions_of(calls):
    """{IAM action: [(service, operation), ...]} for these calls."""
    out = {}
    for service, op in calls:
        for action in ACTIONS.get((service, op), {f"{SERVICES[service]}:{op}"}):
            out.setdefault(action, []).append((service, op))
    return out


def consumer_calls():
    calls = sdk_calls(["src"])
    setup = sdk_calls(sorted(SETUP_FILES))
    return {op: files for op, files in calls.items() if set(files) - SETUP_FILES}, setup


def operator_calls():
    calls = sdk_calls(["cli/src"])
    for op, files in consumer_calls()[1].items():
        calls.setdefault(op, []).extend(files)
    return calls


def statements_granting(template, role):
    """The Allow statements of `role`'s inline policies and of every
    AWS::IAM::RolePolicy attached to it, with every condition true (each
    optional policy included)."""
    conditions = {name: True for name in template.get("Conditions", {})}
    resources = resolve(template["Resources"], conditions, {})
    statements = []
    for policy in resources[role]["Properties"].get("Policies", []):
        statements += policy["PolicyDocument"]["Statement"]
    for res in resources.values():
        if res["Type"] == "AWS::IAM::RolePolicy" and res["Properties"]["RoleName"] == {"Ref": role}:
            statements += res["Properties"]["PolicyDocument"]["Statement"]
    return statements


def granted(statements):
    actions = set()
    for st in statements:
        assert st["Effect"] == "Allow", st
        listed = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        for action in listed:
            assert "*" not in action, f"a wildcard action: {action}"
            actions.add(action)
    return actions


def role_grants():
    """{where: actions granted} for each role a consumer runs with."""
    return {
        "template.yaml": granted(statements_granting(load("template.yaml"), "LedgerRole")),
        "infra/ecs.yaml": granted(statements_granting(load("infra/ecs.yaml"), "TaskRole")),
        "docs/iam/poller-policy.json": granted(json.loads((ROOT / "docs/iam/poller-policy.json").read_text())["Statement"]),
        "docs/iam/lambda-policy.json": granted(json.loads((ROOT / "docs/iam/lambda-policy.json").read_text())["Statement"]),
    }


class Permissions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.consumer, cls.setup = consumer_calls()
        cls.needed = actions_of(cls.consumer)
        cls.grants = role_grants()

    def test_the_scan_finds_the_calls_the_code_is_known_to_make(self):
        # If these go, the scan is broken, not the code.
        for op in [("dynamodb", "TransactWriteItems"), ("dynamodb", "DescribeTable"), ("sqs", "ReceiveMessage"), ("sqs", "ChangeMessageVisibilityBatch"), ("s3", "GetObject")]:
            self.assertIn(op, self.consumer)
        self.assertIn(("dynamodb", "CreateTable"), self.setup)
        self.assertNotIn(("dynamodb", "CreateTable"), self.consumer)

    def test_every_call_is_granted(self):
        for where, grants in self.grants.items():
            with self.subTest(where):
                exempt = CALLS_NOT_GRANTED[where]
                missing = {a: ops for a, ops in self.needed.items() if a not in grants and a not in exempt}
                self.assertEqual(missing, {}, f"{where} does not grant what the code calls (grant it, or list it in CALLS_NOT_GRANTED with a reason)")

    def test_every_grant_is_called(self):
        for where, grants in self.grants.items():
            with self.subTest(where):
                exempt = GRANTS_NOT_CALLED[where]
                extra = sorted(a for a in grants if a not in self.needed and a not in exempt)
                self.assertEqual(extra, [], f"{where} grants what no call of the code needs (remove it, or list it in GRANTS_NOT_CALLED with a reason)")

    def test_every_exemption_is_still_needed(self):
        for where, grants in self.grants.items():
            with self.subTest(where):
                for action in CALLS_NOT_GRANTED[where]:
                    self.assertIn(action, self.needed, f"{where}: {action} is no longer called")
                    self.assertNotIn(action, grants, f"{where}: {action} is granted now")
                for action in GRANTS_NOT_CALLED[where]:
                    self.assertIn(action, grants, f"{where}: {action} is no longer granted")
                    self.assertNotIn(action, self.needed, f"{where}: {action} is called now")

    def test_the_consumer_is_not_granted_the_setup_calls(self):
        setup_only = set(actions_of(self.setup)) - set(self.needed)
        for where, grants in self.grants.items():
            with self.subTest(where):
                self.assertEqual(grants & setup_only, set())

    def test_the_policy_blocks_use_placeholders(self):
        for name in ["poller-policy.json", "lambda-policy.json"]:
            text = (ROOT / "docs/iam" / name).read_text()
            with self.subTest(name):
                self.assertNotRegex(text, r"\d{12}", "an account id")
                for placeholder in ["REGION", "ACCOUNT", "QUEUE", "DLQ", "DEDUP_TABLE", "CONSUMER#*"]:
                    self.assertIn(placeholder, text)

    def test_the_operator_tools_actions_are_documented(self):
        doc = (ROOT / "docs/permissions.md").read_text()
        for action in actions_of(operator_calls()):
            self.assertIn(f"`{action}`", doc, "docs/permissions.md does not name an action the operator tool calls")
        for action in self.needed:
            self.assertIn(f"`{action}`", doc, "docs/permissions.md does not name an action a consumer calls")


def report():
    consumer, _ = consumer_calls()
    for title, calls in [("consumer (src/, not setup)", consumer), ("operator tool (cli/src/ and src/aws/setup.rs)", operator_calls())]:
        print(f"{title}:")
        for (service, op), files in sorted(calls.items()):
            actions = ", ".join(sorted(ACTIONS.get((service, op), {f"{SERVICES[service]}:{op}"})))
            print(f"  {service}.{op:32} -> {actions:40} {' '.join(files)}")
    for where, grants in role_grants().items():
        print(f"{where}: {', '.join(sorted(grants))}")


if __name__ == "__main__":
    if "--list" in sys.argv:
        report()
    else:
        unittest.main()
