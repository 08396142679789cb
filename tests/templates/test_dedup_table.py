"""The dedup table as a piece of its own (infra/dedup-table.yaml): the same
table as template.yaml's, the key schema and TTL the code checks at start-up,
and the throttling alarm.

Run with the tools venv: `scripts/check-templates`.
"""

import pathlib
import re
import unittest

from cfnlint.decode import cfn_yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def plain(node):
    """The template's node as plain dicts and lists (cfn-lint's own types
    compare by value once copied)."""
    if isinstance(node, dict):
        return {str(k): plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [plain(v) for v in node]
    return node


class DedupTablePiece(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.piece = cfn_yaml.load(str(ROOT / "infra/dedup-table.yaml"))
        cls.sam = cfn_yaml.load(str(ROOT / "template.yaml"))

    def test_the_table_is_the_one_template_yaml_deploys(self):
        ours = plain(self.piece["Resources"]["DedupTable"])
        sams = plain(self.sam["Resources"]["DedupTable"])
        self.assertEqual(ours, sams)

    def test_key_schema_and_ttl_are_those_the_code_checks(self):
        props = self.piece["Resources"]["DedupTable"]["Properties"]
        self.assertEqual(plain(props["KeySchema"]), [{"AttributeName": "pk", "KeyType": "HASH"}])
        self.assertEqual(plain(props["TimeToLiveSpecification"]), {"AttributeName": "expires_at", "Enabled": True})
        table_rs = (ROOT / "src/aws/dynamodb/mod.rs").read_text()
        self.assertIn('pub const TTL_ATTRIBUTE: &str = "expires_at";', table_rs)
        self.assertTrue(props["DeletionProtectionEnabled"])
        self.assertEqual(self.piece["Resources"]["DedupTable"]["DeletionPolicy"], "Retain")

    def test_the_throttling_alarm_is_the_one_template_yaml_makes(self):
        ours = plain(self.piece["Resources"]["DedupThrottlingAlarm"]["Properties"])
        sams = plain(self.sam["Resources"]["DedupThrottlingAlarm"]["Properties"])
        for field in ["Namespace", "MetricName", "Dimensions", "Statistic", "Period", "EvaluationPeriods",
                      "ComparisonOperator", "TreatMissingData", "AlarmDescription"]:
            self.assertEqual(ours[field], sams[field], field)

    def test_outputs_name_the_table_for_the_consumer(self):
        self.assertEqual(plain(self.piece["Outputs"]["TableName"]["Value"]), {"Ref": "DedupTable"})
        self.assertIn("DedupTableName", self.piece["Outputs"]["TableName"]["Description"])
        ecs = (ROOT / "infra/ecs.yaml").read_text()
        self.assertRegex(ecs, re.compile(r"^  DedupTableName:", re.M))


if __name__ == "__main__":
    unittest.main()
