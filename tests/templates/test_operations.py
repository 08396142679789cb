"""What operators look at, in both templates: the alarms, their SNS topic, the
dashboard and the runbook they link to. The sqs-once metrics are checked
against src/protocol/metrics.rs (namespace, dimension, names), read from the source.

Run with the tools venv: `scripts/check-templates`.
"""

import json
import logging
import os
import re
import unittest

from cfn import ROOT, alarm_metric, alarms, anchors, code_metrics, dashboard_body, dashboard_metrics, load, resolve

NAMESPACE, DIMENSION, METRIC_NAMES = code_metrics()
RUNBOOK = "docs/OPERATIONS.md"
NOTIFY = [{"Fn::If": ["HasAlarmTopicArn", {"Ref": "AlarmTopicArn"}, {"Ref": "AlarmTopic"}]}]


def placeholder(value):
    """An alarm's dimension value in the dashboard's `<X>` / `<X.Attr>` form."""
    if isinstance(value, dict) and set(value) == {"Ref"}:
        return f"<{value['Ref']}>"
    if isinstance(value, dict) and set(value) == {"Fn::GetAtt"}:
        return "<{}.{}>".format(*value["Fn::GetAtt"])
    raise AssertionError(f"dimension value neither Ref nor GetAtt: {value!r}")


class OperationsChecks:
    """Shared by both runtimes; subclasses say where the resources are."""

    path = ""
    consumer_env = None  # the SQS_ONCE_CONSUMER value the runtime gets
    scaling_alarms = set()  # alarms that drive scaling, not people
    queue = dlq = table = ""  # dimension values, in `<X>` form
    runtime_alarms = {}  # runtime-specific alarms: name -> (namespace, metric, dims)
    runtime_graphs = set()  # runtime-specific dashboard metrics

    @classmethod
    def setUpClass(cls):
        cls.t = load(cls.path)
        cls.alarms = {k: v for k, v in alarms(cls.t).items() if k not in cls.scaling_alarms}
        cls.body = dashboard_body(cls.t)
        cls.graphs = dashboard_metrics(cls.body)

    def consumer(self):
        """The runtime's consumer name, which is the metrics' dimension value."""
        value = self.consumer_env(self.t)
        self.assertEqual(value, {"Ref": "ConsumerName"})
        return value

    def used_metrics(self):
        """(where, namespace, name, dims in `<X>` form) of every alarm and graph."""
        out = [
            (f"alarm {k}", ns, name, {d: placeholder(v) for d, v in dims.items()})
            for k, (ns, name, dims) in ((k, alarm_metric(a)) for k, a in self.alarms.items())
        ]
        out += [("dashboard", ns, name, dims) for ns, name, dims, _ in self.graphs]
        return out

    def test_every_sqs_once_metric_used_is_one_the_code_emits(self):
        consumer = placeholder(self.consumer())
        ours = 0
        for where, ns, name, dims in self.used_metrics():
            if ns.startswith("AWS/"):
                continue
            ours += 1
            self.assertEqual(ns, NAMESPACE, f"{where}: {name} in namespace {ns!r}, the code emits {NAMESPACE!r}")
            self.assertIn(name, METRIC_NAMES, f"{where}: src/protocol/metrics.rs emits no metric {name!r}")
            self.assertEqual(dims, {DIMENSION: consumer}, f"{where}: {name} must carry exactly the {DIMENSION} dimension")
        self.assertGreater(ours, 0, "no sqs-once metric is used at all")

    def test_the_alarms_operators_need_exist(self):
        consumer = placeholder(self.consumer())
        want = {
            "DlqNotEmptyAlarm": ("AWS/SQS", "ApproximateNumberOfMessagesVisible", {"QueueName": self.dlq}),
            "OldestMessageAgeAlarm": ("AWS/SQS", "ApproximateAgeOfOldestMessage", {"QueueName": self.queue}),
            "PermanentFailuresAlarm": (NAMESPACE, "PermanentFailures", {DIMENSION: consumer}),
            "LeaseLostAlarm": (NAMESPACE, "LeaseLost", {DIMENSION: consumer}),
            "DedupThrottlingAlarm": ("AWS/DynamoDB", "WriteThrottleEvents", {"TableName": self.table}),
            **self.runtime_alarms,
        }
        got = {}
        for k, a in self.alarms.items():
            ns, name, dims = alarm_metric(a)
            got[k] = (ns, name, {d: placeholder(v) for d, v in dims.items()})
        self.assertEqual(got, want)

    def test_every_alarm_fires_above_a_tunable_threshold(self):
        params = self.t["Parameters"]
        for k, a in self.alarms.items():
            props = a["Properties"]
            self.assertEqual(props["ComparisonOperator"], "GreaterThanThreshold", k)
            param = props["Threshold"].get("Ref")
            self.assertIn(param, params, f"{k}: threshold is not a parameter")
            self.assertEqual(params[param]["Type"], "Number", k)
            self.assertIn("Default", params[param], k)
            self.assertGreaterEqual(int(params[param]["Default"]), 0, k)

    def test_alarms_fire_on_the_first_event(self):
        params = self.t["Parameters"]
        for k in ("DlqNotEmptyAlarm", "PermanentFailuresAlarm", "LeaseLostAlarm", "DedupThrottlingAlarm"):
            param = self.alarms[k]["Properties"]["Threshold"]["Ref"]
            self.assertEqual(int(params[param]["Default"]), 0, f"{k}: one parked message/failure/lost lease is news")

    def test_a_quiet_dlq_keeps_its_alarm_and_no_metric_line_counts_as_zero(self):
        self.assertEqual(self.alarms["DlqNotEmptyAlarm"]["Properties"]["TreatMissingData"], "ignore")
        for k, a in self.alarms.items():
            if k != "DlqNotEmptyAlarm":
                self.assertEqual(a["Properties"]["TreatMissingData"], "notBreaching", k)

    def test_every_alarm_notifies_the_topic_when_raised_and_cleared(self):
        for k, a in self.alarms.items():
            self.assertEqual(a["Properties"]["AlarmActions"], NOTIFY, k)
            self.assertEqual(a["Properties"]["OKActions"], NOTIFY, k)

    def test_topic_is_created_unless_an_existing_one_is_given(self):
        cond = self.t["Conditions"]
        self.assertEqual(cond["HasAlarmTopicArn"], {"Fn::Not": [{"Fn::Equals": [{"Ref": "AlarmTopicArn"}, ""]}]})
        self.assertEqual(cond["CreateAlarmTopic"], {"Fn::Not": [{"Condition": "HasAlarmTopicArn"}]})
        res = self.t["Resources"]
        self.assertEqual(res["AlarmTopic"]["Type"], "AWS::SNS::Topic")
        self.assertEqual(res["AlarmTopic"]["Condition"], "CreateAlarmTopic")
        sub = res["AlarmEmailSubscription"]
        self.assertEqual(sub["Condition"], "SubscribeAlarmEmail")
        self.assertEqual(sub["Properties"]["TopicArn"], {"Ref": "AlarmTopic"})
        self.assertEqual(self.t["Parameters"]["AlarmTopicArn"]["Default"], "")
        for given in (True, False):
            out = resolve(self.t["Outputs"]["AlarmTopicArn"], {"HasAlarmTopicArn": given}, {})
            self.assertEqual(out["Value"], {"Ref": "AlarmTopicArn" if given else "AlarmTopic"})

    def test_every_alarm_links_to_its_runbook_section(self):
        runbook = (ROOT / RUNBOOK).read_text()
        sections = anchors(runbook)
        for k, a in self.alarms.items():
            m = re.search(rf"{re.escape(RUNBOOK)}#([a-z0-9-]+)", a["Properties"]["AlarmDescription"])
            self.assertTrue(m, f"{k}: AlarmDescription names no runbook section")
            self.assertIn(m.group(1), sections, f"{k}: {RUNBOOK} has no section #{m.group(1)}")

    def test_dashboard_shows_what_operators_look_at(self):
        consumer = placeholder(self.consumer())
        want = {
            (NAMESPACE, "Processed", "Sum"),
            (NAMESPACE, "DuplicatesSkipped", "Sum"),
            (NAMESPACE, "InFlightDuplicates", "Sum"),
            (NAMESPACE, "Retries", "Sum"),
            (NAMESPACE, "PermanentFailures", "Sum"),
            (NAMESPACE, "HandlerLatency", "p50"),
            (NAMESPACE, "HandlerLatency", "p99"),
            ("AWS/SQS", "ApproximateNumberOfMessagesVisible", "Maximum", self.queue),
            ("AWS/SQS", "ApproximateAgeOfOldestMessage", "Maximum", self.queue),
            ("AWS/SQS", "ApproximateNumberOfMessagesVisible", "Maximum", self.dlq),
            ("AWS/DynamoDB", "ConsumedWriteCapacityUnits", "Sum", self.table),
            ("AWS/DynamoDB", "ConsumedReadCapacityUnits", "Sum", self.table),
            ("AWS/DynamoDB", "WriteThrottleEvents", "Sum", self.table),
            ("AWS/DynamoDB", "ReadThrottleEvents", "Sum", self.table),
        } | self.runtime_graphs
        got = set()
        for ns, name, dims, stat in self.graphs:
            if ns == NAMESPACE:
                self.assertEqual(dims, {DIMENSION: consumer})
                got.add((ns, name, stat))
            else:
                target = next(iter(dims.values())) if len(dims) == 1 else tuple(sorted(dims.items()))
                got.add((ns, name, stat, target))
        self.assertLessEqual(want, got, f"missing from the dashboard: {want - got}")

    def test_dashboard_shows_every_alarm(self):
        shown = set()
        for widget in self.body["widgets"]:
            if widget["type"] == "alarm":
                shown |= set(widget["properties"]["alarms"])
        self.assertEqual(shown, {f"<{k}.Arn>" for k in self.alarms})

    def test_dashboard_graphs_are_in_the_stack_region(self):
        for widget in self.body["widgets"]:
            if widget["type"] == "metric":
                self.assertEqual(widget["properties"]["region"], "<AWS::Region>", widget["properties"]["title"])


class SamOperations(OperationsChecks, unittest.TestCase):
    path = "template.yaml"
    queue, dlq, table = "<Queue.QueueName>", "<DeadLetterQueue.QueueName>", "<DedupTable>"
    runtime_alarms = {
        "FunctionErrorsAlarm": ("AWS/Lambda", "Errors", {"FunctionName": "<LedgerFunction>"}),
        "FunctionThrottlesAlarm": ("AWS/Lambda", "Throttles", {"FunctionName": "<LedgerFunction>"}),
    }
    runtime_graphs = {
        ("AWS/Lambda", "ConcurrentExecutions", "Maximum", "<LedgerFunction>"),
        ("AWS/Lambda", "Duration", "p50", "<LedgerFunction>"),
        ("AWS/Lambda", "Duration", "p99", "<LedgerFunction>"),
    }

    @staticmethod
    def consumer_env(t):
        return t["Resources"]["LedgerFunction"]["Properties"]["Environment"]["Variables"]["SQS_ONCE_CONSUMER"]


class EcsOperations(OperationsChecks, unittest.TestCase):
    path = "infra/ecs.yaml"
    # Scaling is target tracking: its alarms are Application Auto Scaling's
    # own, so every alarm in the template is one for people.
    queue, dlq, table = "<QueueName>", "<DeadLetterQueueName>", "<DedupTableName>"

    @staticmethod
    def consumer_env(t):
        (container,) = t["Resources"]["TaskDefinition"]["Properties"]["ContainerDefinitions"]
        return {e["Name"]: e["Value"] for e in container["Environment"]}["SQS_ONCE_CONSUMER"]


class LambdaConcurrency(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.t = load("template.yaml")

    def event_source_mapping(self, maximum_concurrency):
        """The AWS::Lambda::EventSourceMapping SAM generates, resolved for one value."""
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        from samtranslator.translator.transform import transform

        # SAM's translator warns that its own usage metrics were not published.
        logging.getLogger("samtranslator.metrics.metrics").setLevel(logging.ERROR)

        class NoManagedPolicies:
            def load(self):
                return {}

        t = json.loads(json.dumps(self.t))
        t["Resources"]["LedgerFunction"]["Properties"]["CodeUri"] = "s3://bucket/ledger.zip"
        out = transform(t, {}, NoManagedPolicies())
        (esm,) = [r for r in out["Resources"].values() if r["Type"] == "AWS::Lambda::EventSourceMapping"]
        conditions = {"IsFifo": False, "HasConcurrencyLimit": maximum_concurrency != "0"}
        return resolve(esm, conditions, {"MaximumConcurrency": maximum_concurrency})["Properties"]

    def test_maximum_concurrency_reaches_the_event_source_mapping(self):
        self.assertEqual(self.event_source_mapping("50")["ScalingConfig"], {"MaximumConcurrency": "50"})

    def test_zero_leaves_the_event_source_mapping_unlimited(self):
        # Bounded by default; 0 is the explicit choice of no limit.
        self.assertEqual(self.t["Parameters"]["MaximumConcurrency"]["Default"], "10")
        self.assertEqual(self.event_source_mapping("10")["ScalingConfig"], {"MaximumConcurrency": "10"})
        self.assertEqual(
            self.t["Conditions"]["HasConcurrencyLimit"],
            {"Fn::Not": [{"Fn::Equals": [{"Ref": "MaximumConcurrency"}, "0"]}]},
        )
        self.assertNotIn("ScalingConfig", self.event_source_mapping("0"))

    def test_maximum_concurrency_takes_only_what_lambda_accepts(self):
        pattern = self.t["Parameters"]["MaximumConcurrency"]["AllowedPattern"]
        for ok in ("0", "2", "9", "10", "99", "100", "999", "1000"):
            self.assertRegex(ok, pattern)
        for bad in ("", "1", "01", "1001", "2000", "-1", "1.5", "*"):
            self.assertIsNone(re.search(pattern, bad), bad)


if __name__ == "__main__":
    unittest.main()
