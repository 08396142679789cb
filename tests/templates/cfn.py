"""Helpers the template tests share: loading, resolving conditions, reading the
metric contract from src/protocol/metrics.rs, and listing the metrics that alarms and
dashboards use."""

import json
import pathlib
import re

from cfnlint.decode import cfn_yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
NO_VALUE = object()


def load(relative):
    return cfn_yaml.load(str(ROOT / relative))


def resolve(node, conditions, params):
    """The template with Fn::If decided by `conditions`, AWS::NoValue removed
    and parameter Refs replaced by `params` (others kept)."""
    if isinstance(node, dict):
        if set(node) == {"Fn::If"}:
            cond, yes, no = node["Fn::If"]
            return resolve(yes if conditions[cond] else no, conditions, params)
        if set(node) == {"Ref"}:
            if node["Ref"] == "AWS::NoValue":
                return NO_VALUE
            if node["Ref"] in params:
                return params[node["Ref"]]
        out = {}
        for k, v in node.items():
            r = resolve(v, conditions, params)
            if r is not NO_VALUE:
                out[str(k)] = r
        return out
    if isinstance(node, list):
        return [r for r in (resolve(v, conditions, params) for v in node) if r is not NO_VALUE]
    return node


def code_metrics():
    """(namespace, dimension, metric names) as src/protocol/metrics.rs declares them."""
    src = (ROOT / "src/protocol/metrics.rs").read_text()

    def const(name):
        m = re.search(rf'pub const {name}: &str = "([^"]+)";', src)
        assert m, f"src/protocol/metrics.rs declares no `pub const {name}: &str`"
        return m.group(1)

    block = re.search(r"pub const METRIC_NAMES: &\[&str\] = &\[(.*?)\];", src, re.S)
    assert block, "src/protocol/metrics.rs declares no `pub const METRIC_NAMES`"
    names = re.findall(r'"([^"]+)"', block.group(1))
    assert names, "METRIC_NAMES is empty"
    return const("NAMESPACE"), const("DIMENSION"), set(names)


def alarms(template):
    return {k: v for k, v in template["Resources"].items() if v["Type"] == "AWS::CloudWatch::Alarm"}


def alarm_metric(alarm):
    """(namespace, name, {dimension: value}) of a single-metric alarm."""
    props = alarm["Properties"]
    assert "Metrics" not in props, "metric math alarms are not checked here; use a single metric"
    dims = {d["Name"]: d["Value"] for d in props.get("Dimensions", [])}
    return props["Namespace"], props["MetricName"], dims


def dashboard_body(template, name="Dashboard"):
    """The dashboard's JSON, each `${X}` or `${X.Attr}` of its Fn::Sub replaced
    by the string `<X>` or `<X.Attr>`."""
    body = template["Resources"][name]["Properties"]["DashboardBody"]["Fn::Sub"]
    assert isinstance(body, str), "DashboardBody: Fn::Sub of a plain string"
    return json.loads(re.sub(r"\$\{([A-Za-z0-9:.]+)\}", r"<\1>", body))


def dashboard_metrics(body):
    """(namespace, name, {dimension: value}, stat) of every metric graphed."""
    out = []
    for widget in body["widgets"]:
        if widget["type"] != "metric":
            continue
        for row in widget["properties"]["metrics"]:
            options = row[-1] if isinstance(row[-1], dict) else {}
            fields = row[:-1] if options else row
            assert "..." not in fields and "." not in fields, f"spell out every metric: {row}"
            namespace, name, *pairs = fields
            assert len(pairs) % 2 == 0, f"dimension without a value: {row}"
            dims = dict(zip(pairs[::2], pairs[1::2]))
            out.append((namespace, name, dims, options.get("stat", widget["properties"].get("stat"))))
    return out


def slug(heading):
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown):
    return {slug(h) for h in re.findall(r"^#+ (.+)$", markdown, re.M)}
