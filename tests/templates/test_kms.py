"""A customer-managed KMS key (parameter KmsKeyArn) in both templates: empty,
everything is as before (AWS managed keys, no KMS grant); set, the SAM
template encrypts its queues, tables and payload bucket with it, and each
role may use it exactly as the code's calls need, only through the service
holding the data: kms:Decrypt for what it reads (messages, items, payloads)
and kms:GenerateDataKey for what it writes (parked messages, records, ledger
entries). The ECS stack's queues and tables exist already: it grants only.

Run with the tools venv: `scripts/check-templates`.
"""

import re
import unittest

from cfn import load
from test_data_protection import KEY_ARN, WIDENING
from test_large_payloads import deployed

SERVICES = {"sqs", "dynamodb"}


def via(service):
    return {"Fn::Sub": f"{service}.${{AWS::Region}}.${{AWS::URLSuffix}}"}


def kms_grants(template, role):
    """{action: (resource, {service, ...})} of the kms: statements of the
    policies attached to `role` (inline ones included)."""
    documents = [p["PolicyDocument"] for p in template["Resources"][role]["Properties"].get("Policies", [])]
    for res in template["Resources"].values():
        if res["Type"] == "AWS::IAM::RolePolicy" and res["Properties"]["RoleName"] == {"Ref": role}:
            documents.append(res["Properties"]["PolicyDocument"])
    out = {}
    for doc in documents:
        for st in doc["Statement"]:
            for action in st["Action"]:
                if not action.startswith("kms:"):
                    continue
                assert action not in out, f"{action} granted twice"
                assert st["Effect"] == "Allow" and set(st["Condition"]) == {"StringEquals"}, st
                services = st["Condition"]["StringEquals"]["kms:ViaService"]
                names = set()
                for s in services:
                    m = re.fullmatch(r"([a-z0-9]+)\.\$\{AWS::Region\}\.\$\{AWS::URLSuffix\}", s["Fn::Sub"])
                    assert m, s
                    names.add(m.group(1))
                out[action] = (st["Resource"], names)
    return out


class SamKms(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.raw = load("template.yaml")

    def variant(self, key, large="false"):
        return deployed(self.raw, {"KmsKeyArn": key, "LargePayloads": large})

    def test_without_a_key_aws_managed_keys_and_no_kms_grant(self):
        for large in ("false", "true"):
            t = self.variant("", large)
            self.assertEqual(kms_grants(t, "LedgerRole"), {}, large)
            self.assertNotIn("KmsKeyUse", t["Resources"])
        bucket = self.variant("", "true")["Resources"]["LargePayloadBucket"]["Properties"]
        (rule,) = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
        self.assertEqual(rule, {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}})

    def test_with_a_key_the_queues_tables_and_bucket_are_encrypted_with_it(self):
        res = self.variant(KEY_ARN, "true")["Resources"]
        key = {"Ref": "KmsKeyArn"}
        for queue in ("Queue", "DeadLetterQueue"):
            self.assertEqual(res[queue]["Properties"]["KmsMasterKeyId"], key, queue)
        for table in ("DedupTable", "LedgerTable"):
            self.assertEqual(res[table]["Properties"]["SSESpecification"]["KMSMasterKeyId"], key, table)
        (rule,) = res["LargePayloadBucket"]["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"]
        self.assertEqual(
            rule,
            {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": key}, "BucketKeyEnabled": True},
        )

    def test_with_a_key_the_role_decrypts_what_it_reads_and_makes_data_keys_for_what_it_writes(self):
        key = {"Ref": "KmsKeyArn"}
        self.assertEqual(
            kms_grants(self.variant(KEY_ARN), "LedgerRole"),
            {"kms:Decrypt": (key, SERVICES), "kms:GenerateDataKey": (key, SERVICES)},
        )
        # Payloads are read from S3, never written.
        self.assertEqual(
            kms_grants(self.variant(KEY_ARN, "true"), "LedgerRole"),
            {"kms:Decrypt": (key, SERVICES | {"s3"}), "kms:GenerateDataKey": (key, SERVICES)},
        )


class EcsKms(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.raw = load("infra/ecs.yaml")

    def variant(self, key, bucket=""):
        return deployed(self.raw, {"KmsKeyArn": key, "LargePayloadBucketName": bucket})

    def test_without_a_key_no_kms_grant(self):
        for bucket in ("", "payloads"):
            t = self.variant("", bucket)
            self.assertEqual(kms_grants(t, "TaskRole"), {}, bucket)
            self.assertEqual(kms_grants(t, "ExecutionRole"), {}, bucket)

    def test_with_a_key_the_task_decrypts_what_it_reads_and_makes_data_keys_for_what_it_writes(self):
        key = {"Ref": "KmsKeyArn"}
        self.assertEqual(
            kms_grants(self.variant(KEY_ARN), "TaskRole"),
            {"kms:Decrypt": (key, SERVICES), "kms:GenerateDataKey": (key, SERVICES)},
        )
        self.assertEqual(
            kms_grants(self.variant(KEY_ARN, "payloads"), "TaskRole"),
            {"kms:Decrypt": (key, SERVICES | {"s3"}), "kms:GenerateDataKey": (key, SERVICES)},
        )


class KeyParameter(unittest.TestCase):
    def test_the_key_arn_names_one_key_and_cannot_widen_the_grant(self):
        for path in ("template.yaml", "infra/ecs.yaml"):
            param = load(path)["Parameters"]["KmsKeyArn"]
            self.assertEqual(param["Default"], "", f"{path}: AWS managed keys unless a key is named")
            pattern = param["AllowedPattern"]
            for good in (KEY_ARN, "arn:aws-cn:kms:cn-north-1:123456789012:key/mrk-1234abcd12ab34cd56ef1234567890ab"):
                self.assertRegex(good, pattern, path)
            for bad in WIDENING + (
                "arn:aws:kms:eu-west-1:123456789012:key/*",
                "arn:aws:kms:eu-west-1:123456789012:alias/ledger",
                "arn:aws:kms:*:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",
                KEY_ARN + "*",
            ):
                if bad:  # the empty value is the off switch: no grant at all
                    self.assertIsNone(re.search(pattern, bad), f"{path} accepts {bad!r}")


if __name__ == "__main__":
    unittest.main()
