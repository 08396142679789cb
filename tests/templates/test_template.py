"""Checks of template.yaml that `sam validate --lint` does not make.

Run with the tools venv (it has cfn-lint, whose loader understands the short
intrinsic forms): `scripts/check-templates`.
"""

import re
import tomllib
import unittest

from cfn import ROOT, load, resolve

NO_LARGE_PAYLOADS = {"HasLargePayloads": False, "DeletesLargePayloads": False}


class SamTemplate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.raw = load("template.yaml")
        defaults = {k: v.get("Default") for k, v in cls.raw["Parameters"].items()}
        cls.variants = {
            fifo: resolve(
                cls.raw,
                {"IsFifo": fifo, "HasConcurrencyLimit": False, "HasRecordRetention": False, "HasAlarmTopicArn": False, "HasKmsKey": False, "RedactsHandlerErrors": True, **NO_LARGE_PAYLOADS},
                defaults,
            )
            for fifo in (False, True)
        }

    def res(self, fifo, name):
        return self.variants[fifo]["Resources"][name]

    def function(self, fifo=False):
        return self.res(fifo, "LedgerFunction")

    def event(self, fifo):
        (event,) = self.function(fifo)["Properties"]["Events"].values()
        self.assertEqual(event["Type"], "SQS")
        return event["Properties"]

    def test_partial_batch_responses_are_on(self):
        for fifo in (False, True):
            self.assertEqual(self.event(fifo)["FunctionResponseTypes"], ["ReportBatchItemFailures"])
            self.assertEqual(self.event(fifo)["Queue"], {"Fn::GetAtt": ["Queue", "Arn"]})

    def test_batching_window_only_on_standard_queues(self):
        self.assertIn("MaximumBatchingWindowInSeconds", self.event(False))
        self.assertNotIn("MaximumBatchingWindowInSeconds", self.event(True))
        self.assertLessEqual(self.raw["Parameters"]["BatchSize"]["MaxValue"], 10, "FIFO sources take at most 10")

    def test_fifo_variant_is_fifo_end_to_end(self):
        for name in ("Queue", "DeadLetterQueue"):
            props = self.res(True, name)["Properties"]
            self.assertIs(props["FifoQueue"], True)
            self.assertTrue(props["QueueName"]["Fn::Sub"].endswith(".fifo"))
            self.assertNotIn("FifoQueue", self.res(False, name)["Properties"])

    def test_failures_end_in_the_dlq(self):
        for fifo in (False, True):
            redrive = self.res(fifo, "Queue")["Properties"]["RedrivePolicy"]
            self.assertEqual(redrive["deadLetterTargetArn"], {"Fn::GetAtt": ["DeadLetterQueue", "Arn"]})
            self.assertGreaterEqual(int(redrive["maxReceiveCount"]), 1)
            env = self.function(fifo)["Properties"]["Environment"]["Variables"]
            self.assertEqual(env["SQS_ONCE_DLQ_URL"], {"Ref": "DeadLetterQueue"})

    def test_dedup_table_has_the_key_schema_and_ttl_the_code_checks(self):
        props = self.res(False, "DedupTable")["Properties"]
        self.assertEqual(props["KeySchema"], [{"AttributeName": "pk", "KeyType": "HASH"}])
        self.assertEqual(props["AttributeDefinitions"], [{"AttributeName": "pk", "AttributeType": "S"}])
        self.assertEqual(props["TimeToLiveSpecification"], {"AttributeName": "expires_at", "Enabled": True})
        self.assertEqual(props["BillingMode"], "PAY_PER_REQUEST")
        src = (ROOT / "src/aws/dynamodb/mod.rs").read_text()
        self.assertIn('TTL_ATTRIBUTE: &str = "expires_at"', src)
        self.assertIn('KEY_ATTRIBUTE: &str = "pk"', src)

    def test_visibility_timeout_is_six_times_the_function_timeout(self):
        timeout = int(self.function()["Properties"]["Timeout"])
        visibility = int(self.res(False, "Queue")["Properties"]["VisibilityTimeout"])
        self.assertGreaterEqual(visibility, timeout, "AWS rejects a visibility timeout below the function timeout")
        self.assertGreaterEqual(visibility, 6 * timeout, "AWS recommends 6x the function timeout")

    def test_record_retention_is_fitted_to_the_queues_unless_set(self):
        params = self.raw["Parameters"]
        self.assertEqual(int(params["RecordRetentionDays"]["Default"]), 0)
        env = self.raw["Resources"]["LedgerFunction"]["Properties"]["Environment"]["Variables"]
        self.assertEqual(
            env["SQS_ONCE_TTL"],
            {"Fn::If": ["HasRecordRetention", {"Fn::Sub": "${RecordRetentionDays}d"}, {"Ref": "AWS::NoValue"}]},
        )
        # Unset by default: the function fits it (it may read both queues).
        for fifo in (False, True):
            variables = self.function(fifo)["Properties"]["Environment"]["Variables"]
            self.assertNotIn("SQS_ONCE_TTL", variables)

    def test_function_is_the_ledger_binary_on_al2023_arm64(self):
        fn = self.function()
        self.assertEqual(fn["Metadata"]["BuildMethod"], "rust-cargolambda")
        binary = fn["Metadata"]["BuildProperties"]["Binary"]
        # cargo lambda builds in CodeUri: a crate of the workspace naming that binary.
        code_uri = fn["Properties"]["CodeUri"]
        members = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["members"]
        self.assertIn(code_uri, members, "CodeUri is not a member of the Cargo workspace")
        manifest = tomllib.loads((ROOT / code_uri / "Cargo.toml").read_text())
        bins = {b["name"]: ROOT / code_uri / b["path"] for b in manifest.get("bin", [])}
        self.assertIn(binary, bins, f"{code_uri}/Cargo.toml has no binary {binary}")
        self.assertTrue(bins[binary].exists(), bins[binary])
        props = fn["Properties"]
        self.assertEqual(props["Runtime"], "provided.al2023")
        self.assertEqual(props["Architectures"], ["arm64"])
        self.assertEqual(props["Handler"], "bootstrap")

    def test_every_environment_variable_is_one_the_binary_reads(self):
        known = set(re.findall(r'env = "([A-Z_]+)"', (ROOT / "src/settings.rs").read_text()))
        known |= set(re.findall(r'env = "([A-Z_]+)"', (ROOT / "examples/ledger/src/main.rs").read_text()))
        env = self.function()["Properties"]["Environment"]["Variables"]
        self.assertLessEqual(set(env), known, f"unknown: {set(env) - known}")
        for required in ("SQS_ONCE_TABLE", "SQS_ONCE_CONSUMER", "SQS_ONCE_DEDUP_KEY", "LEDGER_TABLE"):
            self.assertIn(required, env)

    def test_role_is_least_privilege(self):
        role = self.res(False, "LedgerRole")["Properties"]
        self.assertNotIn("ManagedPolicyArns", role)
        self.assertEqual(
            self.function()["Properties"]["Role"], {"Fn::GetAtt": ["LedgerRole", "Arn"]},
            "an explicit role, so SAM adds no managed policies with Resource *",
        )
        granted = {}
        for policy in role["Policies"]:
            for st in policy["PolicyDocument"]["Statement"]:
                self.assertEqual(st["Effect"], "Allow")
                self.assertNotEqual(st["Resource"], "*")
                self.assertNotIn("*", str(st["Resource"]))
                target = st["Resource"].get("Fn::GetAtt", [None])[0] or st["Resource"].get("Fn::Sub")
                for action in st["Action"]:
                    self.assertNotIn("*", action)
                    granted.setdefault(str(target), set()).add(action)
        self.assertEqual(
            granted,
            {
                "${LedgerLogGroup.Arn}": {"logs:CreateLogStream", "logs:PutLogEvents"},
                # SendMessage: a copy of a key in flight sent again.
                "Queue": {
                    "sqs:ReceiveMessage",
                    "sqs:DeleteMessage",
                    "sqs:GetQueueAttributes",
                    "sqs:GetQueueUrl",
                    "sqs:ChangeMessageVisibility",
                    "sqs:SendMessage",
                },
                # Parking reads the DLQ's MaximumMessageSize; start-up its retention.
                "DeadLetterQueue": {"sqs:SendMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl"},
                # GetItem: a completed key whose large payload is gone.
                "DedupTable": {
                    "dynamodb:UpdateItem",
                    "dynamodb:PutItem",
                    "dynamodb:GetItem",
                    "dynamodb:DescribeTable",
                    "dynamodb:DescribeTimeToLive",
                },
                "LedgerTable": {"dynamodb:UpdateItem"},
            },
        )

    def test_carried_keys_are_sealed_and_key_reuse_is_parked(self):
        env = self.function()["Properties"]["Environment"]["Variables"]
        self.assertEqual(env["SQS_ONCE_PAYLOAD_MISMATCH"], "park")
        # The secret kept in the table, read at run time: never in the
        # function's configuration.
        self.assertNotIn("SQS_ONCE_CARRY_SECRET", env)
        self.assertNotIn("CarrySecret", self.raw["Resources"])
        [policy] = self.res(False, "LedgerRole")["Properties"]["Policies"]
        [st] = [s for s in policy["PolicyDocument"]["Statement"] if s["Sid"] == "TableCarrySecret"]
        self.assertEqual(st["Action"], ["dynamodb:GetItem", "dynamodb:PutItem"])
        self.assertEqual(
            st["Condition"],
            {"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": [
                "sqs-once:carry-secret",
                {"Fn::Sub": "sqs-once:stamp:${ConsumerName}"},
            ]}},
        )

    def test_handler_error_text_is_redacted_by_default(self):
        env = self.function()["Properties"]["Environment"]["Variables"]
        self.assertEqual(env["SQS_ONCE_REDACT_REASONS"], "on")
        self.assertEqual(self.raw["Parameters"]["RedactHandlerErrors"]["Default"], "true")
        # Keys stay plain, and the parameter says why (hashing re-keys).
        self.assertNotIn("SQS_ONCE_HASH_KEYS", env)
        self.assertIn("SQS_ONCE_HASH_KEYS", self.raw["Parameters"]["RedactHandlerErrors"]["Description"])

    def test_the_consumer_writes_only_its_own_records(self):
        [policy] = self.res(False, "LedgerRole")["Properties"]["Policies"]
        [st] = [s for s in policy["PolicyDocument"]["Statement"] if s["Sid"] == "DedupRecords"]
        self.assertEqual(
            st["Condition"],
            {"ForAllValues:StringLike": {"dynamodb:LeadingKeys": [{"Fn::Sub": "${ConsumerName}#*"}]}},
        )

    def test_queues_refuse_requests_without_tls(self):
        policy = self.res(False, "QueueTlsOnly")["Properties"]
        self.assertEqual(policy["Queues"], [{"Ref": "Queue"}, {"Ref": "DeadLetterQueue"}])
        [st] = policy["PolicyDocument"]["Statement"]
        self.assertEqual((st["Effect"], st["Action"]), ("Deny", "sqs:*"))
        self.assertEqual(st["Condition"], {"Bool": {"aws:SecureTransport": "false"}})

    def test_log_group_is_the_functions(self):
        name = self.function()["Properties"]["FunctionName"]["Fn::Sub"]
        group = self.res(False, "LedgerLogGroup")["Properties"]["LogGroupName"]["Fn::Sub"]
        self.assertEqual(group, f"/aws/lambda/{name}")


if __name__ == "__main__":
    unittest.main()
