"""Large payloads in the templates: the S3 permissions exist only when large
payloads are on (GetObject and ListBucket), DeleteObject only when deletion is
on too, and the function or task is told the same through its environment.

Each variant is the template as CloudFormation would deploy it for some
parameter values: conditions evaluated, resources of a false condition left
out, `Fn::If` decided.

Run with the tools venv: `scripts/check-templates`.
"""

import re
import unittest

from cfn import load, resolve
from test_data_protection import WIDENING


def conditions(template, params):
    """Every condition's value for these parameter values (others: defaults)."""
    values = {k: v.get("Default") for k, v in template["Parameters"].items()}
    values.update(params)
    decided = {}

    def value(node):
        if isinstance(node, dict) and set(node) == {"Ref"}:
            return str(values[node["Ref"]])
        assert not isinstance(node, (dict, list)), f"not a plain value: {node}"
        return str(node)

    def evaluate(node):
        ((fn, args),) = node.items()
        if fn == "Fn::Equals":
            return value(args[0]) == value(args[1])
        if fn == "Fn::Not":
            return not evaluate(args[0])
        if fn == "Fn::And":
            return all(evaluate(a) for a in args)
        if fn == "Fn::Or":
            return any(evaluate(a) for a in args)
        if fn == "Condition":
            return condition(args)
        raise AssertionError(f"unknown condition function {fn}")

    def condition(name):
        if name not in decided:
            decided[name] = evaluate(template["Conditions"][name])
        return decided[name]

    for name in template["Conditions"]:
        condition(name)
    return decided


def deployed(template, params):
    conds = conditions(template, params)
    kept = dict(template)
    for section in ("Resources", "Outputs"):
        kept[section] = {k: v for k, v in template[section].items() if conds.get(v.get("Condition"), True)}
    return resolve(kept, conds, {})


def grants(template, role):
    """{action: [resource, ...]} over the role's inline policies and the
    policy resources attached to it."""
    documents = [p["PolicyDocument"] for p in template["Resources"][role]["Properties"].get("Policies", [])]
    for res in template["Resources"].values():
        if res["Type"] in ("AWS::IAM::RolePolicy", "AWS::IAM::Policy"):
            props = res["Properties"]
            if props.get("RoleName") == {"Ref": role} or {"Ref": role} in props.get("Roles", []):
                documents.append(props["PolicyDocument"])
    out = {}
    for doc in documents:
        for st in doc["Statement"]:
            assert st["Effect"] == "Allow"
            for action in st["Action"]:
                out.setdefault(action, []).append(st["Resource"])
    return out


def s3_grants(template, role):
    return {a: r for a, r in grants(template, role).items() if a.startswith("s3:")}


class SamLargePayloads(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.raw = load("template.yaml")

    def variant(self, large, delete):
        return deployed(self.raw, {"LargePayloads": large, "DeleteLargePayloads": delete})

    def env(self, t):
        return t["Resources"]["LedgerFunction"]["Properties"]["Environment"]["Variables"]

    def test_off_by_default_no_bucket_and_no_s3_permission(self):
        for delete in ("false", "true"):
            t = self.variant("false", delete)
            self.assertNotIn("LargePayloadBucket", t["Resources"])
            self.assertNotIn("LargePayloadBucketName", t["Outputs"])
            self.assertEqual(s3_grants(t, "LedgerRole"), {}, delete)
            self.assertEqual(
                (self.env(t)["SQS_ONCE_LARGE_PAYLOADS"], self.env(t)["SQS_ONCE_DELETE_PAYLOADS"]), ("off", "off")
            )
        defaults = deployed(self.raw, {})
        self.assertEqual(s3_grants(defaults, "LedgerRole"), {})

    def test_on_reads_and_lists_the_payload_bucket_only(self):
        t = self.variant("true", "false")
        objects = {"Fn::Sub": "${LargePayloadBucket.Arn}/*"}
        bucket = {"Fn::GetAtt": ["LargePayloadBucket", "Arn"]}
        self.assertEqual(s3_grants(t, "LedgerRole"), {"s3:GetObject": [objects], "s3:ListBucket": [bucket]})
        self.assertEqual((self.env(t)["SQS_ONCE_LARGE_PAYLOADS"], self.env(t)["SQS_ONCE_DELETE_PAYLOADS"]), ("on", "off"))
        self.assertEqual(t["Outputs"]["LargePayloadBucketName"]["Value"], {"Ref": "LargePayloadBucket"})

    def test_deletion_adds_delete_object_on_the_payloads_only(self):
        t = self.variant("true", "true")
        objects = {"Fn::Sub": "${LargePayloadBucket.Arn}/*"}
        self.assertEqual(s3_grants(t, "LedgerRole")["s3:DeleteObject"], [objects])
        self.assertEqual(set(s3_grants(t, "LedgerRole")), {"s3:GetObject", "s3:ListBucket", "s3:DeleteObject"})
        self.assertEqual((self.env(t)["SQS_ONCE_LARGE_PAYLOADS"], self.env(t)["SQS_ONCE_DELETE_PAYLOADS"]), ("on", "on"))

    def test_the_bucket_outlives_the_messages_that_point_into_it(self):
        bucket = self.variant("true", "false")["Resources"]["LargePayloadBucket"]
        self.assertEqual((bucket.get("DeletionPolicy"), bucket.get("UpdateReplacePolicy")), ("Retain", "Retain"))
        props = bucket["Properties"]
        (rule,) = props["LifecycleConfiguration"]["Rules"]
        self.assertEqual(rule["Status"], "Enabled")
        self.assertGreaterEqual(rule["ExpirationInDays"], 28, "14 days in the queue, then 14 in a FIFO DLQ")
        self.assertTrue(all(props["PublicAccessBlockConfiguration"].values()))
        self.assertIn("ServerSideEncryptionConfiguration", props["BucketEncryption"])


class EcsLargePayloads(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.raw = load("infra/ecs.yaml")

    def variant(self, bucket, delete):
        return deployed(self.raw, {"LargePayloadBucketName": bucket, "DeleteLargePayloads": delete})

    def env(self, t):
        (container,) = t["Resources"]["TaskDefinition"]["Properties"]["ContainerDefinitions"]
        env = {e["Name"]: e["Value"] for e in container["Environment"]}
        return env["SQS_ONCE_LARGE_PAYLOADS"], env["SQS_ONCE_DELETE_PAYLOADS"]

    def test_off_by_default_no_s3_permission(self):
        for delete in ("false", "true"):
            t = self.variant("", delete)
            self.assertEqual(s3_grants(t, "TaskRole"), {})
            self.assertEqual(self.env(t), ("off", "off"))

    def test_on_reads_and_lists_the_named_bucket_and_deletes_only_when_asked(self):
        objects = {"Fn::Sub": "arn:${AWS::Partition}:s3:::${LargePayloadBucketName}/*"}
        bucket = {"Fn::Sub": "arn:${AWS::Partition}:s3:::${LargePayloadBucketName}"}
        t = self.variant("payloads", "false")
        self.assertEqual(s3_grants(t, "TaskRole"), {"s3:GetObject": [objects], "s3:ListBucket": [bucket]})
        self.assertEqual(self.env(t), ("on", "off"))
        t = self.variant("payloads", "true")
        self.assertEqual(
            s3_grants(t, "TaskRole"),
            {"s3:GetObject": [objects], "s3:ListBucket": [bucket], "s3:DeleteObject": [objects]},
        )
        self.assertEqual(self.env(t), ("on", "on"))

    def test_the_bucket_name_cannot_widen_the_grants(self):
        param = self.raw["Parameters"]["LargePayloadBucketName"]
        pattern = param["AllowedPattern"]
        self.assertEqual(param["Default"], "", "off unless a bucket is named")
        for bad in WIDENING:
            if bad:  # the empty name is the off switch: no policy at all
                self.assertIsNone(re.search(pattern, bad), bad)
        for good in ("payloads", "my-org.sqs-payloads", "a1b"):
            self.assertRegex(good, pattern)


if __name__ == "__main__":
    unittest.main()
