"""Checks the library's declared rust-version against its dependencies' and
the toolchain's. Reads `cargo metadata` on stdin; argv[1] is `rustc --version`."""
import json
import re
import sys


def version(text):
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


meta = json.load(sys.stdin)
packages = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
root = next(p for p in meta["packages"] if p["name"] == "sqs-once" and p["source"] is None)
declared = root.get("rust_version")
if not declared:
    sys.exit("check-msrv: sqs-once declares no rust-version")

# The library's normal and build dependencies, transitively, with every
# feature the workspace resolves (a superset of any user's selection).
seen, todo = set(), [root["id"]]
while todo:
    node = nodes[todo.pop()]
    for dep in node["deps"]:
        kinds = {k["kind"] for k in dep["dep_kinds"]}
        if kinds - {"dev"} and dep["pkg"] not in seen:
            seen.add(dep["pkg"])
            todo.append(dep["pkg"])

needs = sorted(
    ((packages[i]["rust_version"], packages[i]["name"]) for i in seen if packages[i].get("rust_version")),
    key=lambda v: version(v[0]),
)
newest, by = needs[-1]
toolchain = re.search(r"(\d+\.\d+\.\d+)", sys.argv[1]).group(1)
if version(newest) > version(declared):
    sys.exit(f"check-msrv: sqs-once declares rust-version {declared}, but {by} needs {newest}")
if version(declared) > version(toolchain):
    sys.exit(f"check-msrv: sqs-once declares rust-version {declared}, newer than this toolchain ({toolchain})")
print(f"check-msrv: rust-version {declared} (dependencies need up to {newest}, from {by}; toolchain {toolchain})", file=sys.stderr)
