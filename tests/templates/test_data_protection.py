"""The state the templates create outlives mistakes: the dedup records (without
them every redelivery applies twice), the ledger's balances and the parked
messages. And the names that go into IAM policies cannot widen them.

Run with the tools venv: `scripts/check-templates`.
"""

import re
import unittest

from cfn import load

STATEFUL = ("DedupTable", "LedgerTable", "DeadLetterQueue")
TABLES = ("DedupTable", "LedgerTable")
QUEUES = ("Queue", "DeadLetterQueue")
# What a `*` or `?` in a name would make of an IAM resource ARN.
WIDENING = ("*", "ledger*", "*-dedup", "led?er", "*.fifo", "ledger/*", "a:b", "")
# A customer-managed key, as a KmsKeyArn parameter value.
KEY_ARN = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def sub_variables(resource):
    """The `${X}` names of a Fn::Sub resource string (pseudo parameters left out)."""
    if isinstance(resource, dict) and "Fn::Sub" in resource:
        return {v for v in re.findall(r"\$\{([^}!]+)\}", resource["Fn::Sub"]) if not v.startswith("AWS::")}
    return set()


def policy_resources(role):
    for policy in role["Properties"]["Policies"]:
        for st in policy["PolicyDocument"]["Statement"]:
            resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
            yield from resources


class SamDataProtection(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.t = load("template.yaml")
        cls.res = cls.t["Resources"]

    def test_stateful_resources_survive_stack_deletion_and_replacement(self):
        for name in STATEFUL:
            self.assertEqual(self.res[name].get("DeletionPolicy"), "Retain", name)
            self.assertEqual(self.res[name].get("UpdateReplacePolicy"), "Retain", name)

    def test_tables_refuse_deletion_and_keep_point_in_time_recovery(self):
        for name in TABLES:
            props = self.res[name]["Properties"]
            self.assertIs(props.get("DeletionProtectionEnabled"), True, name)
            self.assertEqual(props.get("PointInTimeRecoverySpecification"), {"PointInTimeRecoveryEnabled": True}, name)

    def variants(self):
        """The resources as deployed without and with a customer-managed key."""
        from test_large_payloads import deployed  # (it imports this module)

        return deployed(self.t, {})["Resources"], deployed(self.t, {"KmsKeyArn": KEY_ARN})["Resources"]

    def test_tables_state_their_encryption(self):
        default, with_key = self.variants()
        for name in TABLES:
            self.assertEqual(default[name]["Properties"].get("SSESpecification"), {"SSEEnabled": True, "SSEType": "KMS"}, name)
            self.assertEqual(
                with_key[name]["Properties"].get("SSESpecification"),
                {"SSEEnabled": True, "SSEType": "KMS", "KMSMasterKeyId": {"Ref": "KmsKeyArn"}},
                name,
            )

    def test_queues_state_their_encryption(self):
        default, with_key = self.variants()
        for name in QUEUES:
            props = default[name]["Properties"]
            self.assertIs(props.get("SqsManagedSseEnabled"), True, name)
            self.assertNotIn("KmsMasterKeyId", props, name)
            props = with_key[name]["Properties"]
            self.assertEqual(props.get("KmsMasterKeyId"), {"Ref": "KmsKeyArn"}, name)
            self.assertNotIn("SqsManagedSseEnabled", props, "SQS takes one kind of encryption")

    def test_role_resources_are_the_stacks_own(self):
        """No parameter reaches the role's resources: only the stack's resources."""
        params = set(self.t["Parameters"])
        for resource in policy_resources(self.res["LedgerRole"]):
            self.assertNotIn("Ref", resource, resource)
            if "Fn::GetAtt" in resource:
                self.assertIn(resource["Fn::GetAtt"][0], self.res)
            for var in sub_variables(resource):
                self.assertNotIn(var.split(".")[0], params, resource)
                self.assertIn(var.split(".")[0], self.res, resource)


class EcsNamePatterns(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.t = load("infra/ecs.yaml")

    def role_parameters(self):
        names = set()
        for resource in policy_resources(self.t["Resources"]["TaskRole"]):
            names |= sub_variables(resource)
        return names

    def test_every_name_in_the_task_role_is_a_parameter(self):
        self.assertEqual(self.role_parameters(), {"QueueName", "DeadLetterQueueName", "DedupTableName", "LedgerTableName"})

    def test_names_in_the_task_role_cannot_hold_a_wildcard(self):
        for name in self.role_parameters():
            pattern = self.t["Parameters"][name].get("AllowedPattern")
            self.assertTrue(pattern, f"{name} has no AllowedPattern")
            self.assertTrue(pattern.startswith("^") and pattern.endswith("$"), f"{name}: anchor {pattern!r}")
            for bad in WIDENING:
                self.assertIsNone(re.search(pattern, bad), f"{name} accepts {bad!r}")

    def test_names_in_the_task_role_accept_real_names(self):
        params = self.t["Parameters"]
        for name, examples in {
            "QueueName": ("ledger", "orders_v2-prod", "orders.fifo"),
            "DeadLetterQueueName": ("ledger-dlq", "orders-dlq.fifo"),
            "DedupTableName": ("ledger-dedup", "sqs.once_dedup"),
            "LedgerTableName": ("ledger",),
        }.items():
            for example in examples:
                self.assertRegex(example, params[name]["AllowedPattern"], name)


if __name__ == "__main__":
    unittest.main()
