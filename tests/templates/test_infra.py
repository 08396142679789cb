"""Checks of infra/ecs.yaml and infra/Dockerfile that cfn-lint does not make.

Run with the tools venv: `scripts/check-templates`.
"""

import pathlib
import re
import unittest

from cfnlint.decode import cfn_yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]


def seconds(value):
    m = re.fullmatch(r"(\d+)s", value)
    assert m, f"expected a duration in seconds, got {value!r}"
    return int(m.group(1))


class EcsTemplate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.t = cfn_yaml.load(str(ROOT / "infra/ecs.yaml"))
        cls.res = cls.t["Resources"]
        (cls.container,) = cls.res["TaskDefinition"]["Properties"]["ContainerDefinitions"]
        cls.env = {e["Name"]: e["Value"] for e in cls.container["Environment"]}

    def test_handler_error_text_is_redacted_by_default(self):
        self.assertEqual(
            self.env["SQS_ONCE_REDACT_REASONS"],
            {"Fn::If": ["RedactsHandlerErrors", "on", "off"]},
        )
        self.assertEqual(self.t["Parameters"]["RedactHandlerErrors"]["Default"], "true")

    def test_fargate_task_in_awsvpc(self):
        props = self.res["TaskDefinition"]["Properties"]
        self.assertEqual(props["RequiresCompatibilities"], ["FARGATE"])
        self.assertEqual(props["NetworkMode"], "awsvpc")
        self.assertEqual(props["TaskRoleArn"], {"Fn::GetAtt": ["TaskRole", "Arn"]})

    def test_stop_timeout_leaves_time_for_the_drain(self):
        drain = seconds(self.env["SQS_ONCE_DRAIN"])
        cleanup = int(re.search(r"CLEANUP: Duration = Duration::from_secs\((\d+)\)", (ROOT / "src/runtime/poller/mod.rs").read_text()).group(1))
        stop = int(self.container["StopTimeout"])
        self.assertLess(drain + cleanup, stop, "the poller must exit before ECS sends SIGKILL")
        self.assertLessEqual(stop, 120, "Fargate allows at most 120 s")

    def test_every_environment_variable_is_one_the_binary_reads(self):
        known = set(re.findall(r'env = "([A-Z_]+)"', (ROOT / "src/settings.rs").read_text()))
        known |= set(re.findall(r'env = "([A-Z_]+)"', (ROOT / "examples/ledger/src/main.rs").read_text()))
        known.add("SQS_ONCE_LOG_FORMAT")  # read by cli::init_logging
        self.assertLessEqual(set(self.env), known, f"unknown: {set(self.env) - known}")
        for required in ("SQS_ONCE_QUEUE_URL", "SQS_ONCE_TABLE", "SQS_ONCE_CONSUMER", "LEDGER_TABLE"):
            self.assertIn(required, self.env)
        self.assertEqual(self.env["SQS_ONCE_LOG_FORMAT"], "json")

    def test_logs_go_to_the_stack_log_group(self):
        logs = self.container["LogConfiguration"]
        self.assertEqual(logs["LogDriver"], "awslogs")
        self.assertEqual(logs["Options"]["awslogs-group"], {"Ref": "LogGroup"})

    def test_task_role_is_least_privilege(self):
        granted = {}
        for policy in self.res["TaskRole"]["Properties"]["Policies"]:
            for st in policy["PolicyDocument"]["Statement"]:
                self.assertEqual(st["Effect"], "Allow")
                resource = st["Resource"]["Fn::Sub"]
                self.assertNotIn("*", resource)
                for action in st["Action"]:
                    self.assertNotIn("*", action)
                    granted.setdefault(resource.rsplit(":", 1)[-1], set()).add(action)
        self.assertEqual(
            granted,
            {
                "${QueueName}": {
                    "sqs:ReceiveMessage",
                    "sqs:DeleteMessage",
                    "sqs:ChangeMessageVisibility",
                    "sqs:GetQueueAttributes",
                    "sqs:GetQueueUrl",
                },
                "${DeadLetterQueueName}": {"sqs:SendMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl"},
                "table/${DedupTableName}": {
                    "dynamodb:UpdateItem",
                    "dynamodb:PutItem",
                    "dynamodb:GetItem",
                    "dynamodb:DescribeTable",
                    "dynamodb:DescribeTimeToLive",
                },
                "table/${LedgerTableName}": {"dynamodb:UpdateItem"},
            },
        )

    def test_carry_secret_comes_from_secrets_manager_through_the_execution_role(self):
        self.assertEqual(
            self.container["Secrets"],
            {"Fn::If": ["HasCarrySecret", [{"Name": "SQS_ONCE_CARRY_SECRET", "ValueFrom": {"Ref": "CarrySecretArn"}}], {"Ref": "AWS::NoValue"}]},
        )
        self.assertNotIn("SQS_ONCE_CARRY_SECRET", self.env)
        read = self.res["CarrySecretRead"]
        self.assertEqual(read["Condition"], "HasCarrySecret")
        self.assertEqual(read["Properties"]["RoleName"], {"Ref": "ExecutionRole"})
        [st] = read["Properties"]["PolicyDocument"]["Statement"]
        self.assertEqual((st["Action"], st["Resource"]), (["secretsmanager:GetSecretValue"], {"Ref": "CarrySecretArn"}))
        self.assertEqual(self.env["SQS_ONCE_PAYLOAD_MISMATCH"], "park")
        # Without one, the secret kept in the table.
        [policy] = self.res["TaskRole"]["Properties"]["Policies"]
        [st] = [s for s in policy["PolicyDocument"]["Statement"] if s["Sid"] == "TableCarrySecret"]
        self.assertEqual(st["Action"], ["dynamodb:GetItem", "dynamodb:PutItem"])
        self.assertEqual(
            st["Condition"],
            {"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": [
                "sqs-once:carry-secret",
                {"Fn::Sub": "sqs-once:stamp:${ConsumerName}"},
            ]}},
        )

    def test_the_consumer_writes_only_its_own_records(self):
        [policy] = self.res["TaskRole"]["Properties"]["Policies"]
        [st] = [s for s in policy["PolicyDocument"]["Statement"] if s["Sid"] == "DedupRecords"]
        self.assertEqual(
            st["Condition"],
            {"ForAllValues:StringLike": {"dynamodb:LeadingKeys": [{"Fn::Sub": "${ConsumerName}#*"}]}},
        )

    def test_only_ecs_for_this_account_assumes_the_roles(self):
        for name in ("ExecutionRole", "TaskRole"):
            [st] = self.res[name]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
            self.assertEqual(st["Condition"]["StringEquals"], {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}, name)
            self.assertIn("aws:SourceArn", st["Condition"]["ArnLike"], name)

    def test_scaling_tracks_the_backlog_per_running_task(self):
        target = self.res["ScalableTarget"]["Properties"]
        self.assertEqual(target["ScalableDimension"], "ecs:service:DesiredCount")
        self.assertEqual(target["MinCapacity"], {"Ref": "MinTasks"})
        # At zero tasks the ratio has no value: the service must keep one.
        self.assertGreaterEqual(self.t["Parameters"]["MinTasks"]["MinValue"], 1)
        policies = [r for r in self.res.values() if r["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"]
        self.assertEqual(len(policies), 1, "one target tracking policy, no step policies beside it")
        props = policies[0]["Properties"]
        self.assertEqual(props["PolicyType"], "TargetTrackingScaling")
        self.assertEqual(props["ScalingTargetId"], {"Ref": "ScalableTarget"})
        config = props["TargetTrackingScalingPolicyConfiguration"]
        self.assertEqual(config["TargetValue"], {"Ref": "BacklogPerTask"})
        self.assertLess(config["ScaleOutCooldown"], config["ScaleInCooldown"])
        queries = {q["Id"]: q for q in config["CustomizedMetricSpecification"]["Metrics"]}
        [returned] = [q for q in queries.values() if q["ReturnData"]]
        numerator, denominator = [s.strip() for s in returned["Expression"].split("/")]
        visible = queries[numerator]["MetricStat"]
        self.assertEqual(
            (visible["Metric"]["Namespace"], visible["Metric"]["MetricName"]),
            ("AWS/SQS", "ApproximateNumberOfMessagesVisible"),
        )
        self.assertEqual(visible["Metric"]["Dimensions"], [{"Name": "QueueName", "Value": {"Ref": "QueueName"}}])
        tasks = queries[denominator]["MetricStat"]
        self.assertEqual(
            (tasks["Metric"]["Namespace"], tasks["Metric"]["MetricName"]),
            ("ECS/ContainerInsights", "RunningTaskCount"),
        )
        self.assertEqual(
            tasks["Metric"]["Dimensions"],
            [
                {"Name": "ClusterName", "Value": {"Ref": "Cluster"}},
                {"Name": "ServiceName", "Value": {"Fn::GetAtt": ["Service", "Name"]}},
            ],
        )

    def test_the_health_check_asks_the_binary_without_a_shell(self):
        check = self.container["HealthCheck"]
        self.assertEqual(check["Command"], ["CMD", "/usr/local/bin/ledger", "--health"])
        self.assertIn("SQS_ONCE_HEALTH_PORT", self.env)
        max_age = seconds(self.env["SQS_ONCE_HEALTH_MAX_AGE"])
        poller = "".join(p.read_text() for p in sorted((ROOT / "src/runtime/poller").glob("*.rs")))
        wait = int(re.search(r"wait_time: Duration::from_secs\((\d+)\)", poller).group(1))
        slack = int(re.search(r"SQS_SLACK: Duration = Duration::from_secs\((\d+)\)", (ROOT / "src/app.rs").read_text()).group(1))
        backoff = int(re.search(r"error_backoff \* 2\)\.min\(Duration::from_secs\((\d+)\)\)", poller).group(1))
        # A healthy loop turns within a long poll, its slack and the longest
        # back-off after a failed receive.
        self.assertGreater(max_age, wait + slack + backoff)
        self.assertGreater(check["Timeout"], 2 * 3, "connect and answer may take 3 s each")
        self.assertGreater(check["StartPeriod"], 60, "the start-up checks retry for up to 60 s")

class Dockerfile(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        text = (ROOT / "infra/Dockerfile").read_text()
        stages = re.split(r"^FROM ", text, flags=re.M)[1:]
        cls.build, cls.final = "".join(stages[:-1]), stages[-1]

    def test_builds_the_ledger_binary_in_release(self):
        self.assertIn("cargo build --release --locked -p sqs-once-example-ledger --bin ledger", self.build)
        self.assertTrue((ROOT / "examples/ledger/src/main.rs").exists())

    def test_dependencies_cook_from_a_pinned_cargo_chef_recipe(self):
        # No hand-written list of the workspace's targets: cargo-chef's recipe
        # (scripts/check-image checks it names every target) builds the
        # dependency layer.
        self.assertRegex(self.build, r"cargo install cargo-chef --locked --version \d+\.\d+\.\d+")
        self.assertIn("cargo chef prepare --recipe-path recipe.json", self.build)
        self.assertIn("cargo chef cook --release --locked --recipe-path recipe.json", self.build)
        self.assertNotIn("fn main() {}", self.build)

    def test_runtime_image_is_small_non_root_and_shell_free(self):
        self.assertTrue(self.final.startswith("gcr.io/distroless/"), self.final.splitlines()[0])
        self.assertIn(":nonroot", self.final.splitlines()[0])
        self.assertRegex(self.final, r"(?m)^USER nonroot")
        self.assertNotRegex(self.final, r"(?m)^RUN ", "a distroless stage has no shell to RUN in")

    def test_stops_with_sigterm_and_runs_the_poller(self):
        self.assertRegex(self.final, r"(?m)^STOPSIGNAL SIGTERM$")
        self.assertRegex(self.final, r'(?m)^ENTRYPOINT \["/usr/local/bin/ledger"\]$')


if __name__ == "__main__":
    unittest.main()
