"""benchmarks/results/: every file named ``<benchmark>[_<label>]_<N>x<GPU>.{json,md}``, the index that
benchmarks/results_index.py writes is the committed one, every results file the documentation names exists, and
the writers name new files by the scheme."""

import json
import os
import re

import pytest

from benchmarks import results_index as ri

ROOT = ri.ROOT
DOC_FILES = ri.DOCS + ["benchmarks/gpu/README.md", "benchmarks/results/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
OLD_NAME = re.compile(r"[A-Za-z0-9_.]*_(?:NVIDIA_[A-Za-z0-9_]+|H100|H200)\.(?:md|json)\b")  # GPU without N, or spelled out


def test_index_is_what_the_script_writes():
    with open(ri.INDEX) as f:
        committed = f.read()
    assert committed == ri.index(), "benchmarks/results/README.md is stale: run python benchmarks/results_index.py"


def test_every_results_file_follows_the_scheme():
    files = ri.results_files()
    assert files
    bad = [f for f in files if ri.split_name(f) is None]
    assert not bad, f"not <benchmark>[_<label>]_<N>x<GPU>.{{json,md}} of a known benchmark: {bad}"
    for f in files:
        parts = ri.split_name(f)
        if parts["ext"] != "json" or parts["machine"] == "cpu":
            continue
        with open(os.path.join(ri.RESULTS, f)) as fh:
            data = json.load(fh)
        env = data.get("env", {}) if isinstance(data, dict) else {}
        gpu = env.get("gpu_name") or env.get("gpu")
        if gpu:  # the name's GPU is the one the figures ran on
            assert parts["gpu"] in gpu.replace(" ", ""), (f, gpu)
        if env.get("gpus"):
            assert int(parts["gpus"]) == env["gpus"], (f, env["gpus"])


def test_e2e_tables_hold_one_gpu_count_each():
    for f in ri.results_files():
        parts = ri.split_name(f)
        if parts["benchmark"] == "e2e" and parts["ext"] == "json":
            with open(os.path.join(ri.RESULTS, f)) as fh:
                rows = json.load(fh)["rows"]
            assert rows and {r["gpus"] for r in rows} == {int(parts["gpus"])}, f


def _mentions(doc: str):
    with open(os.path.join(ROOT, doc)) as f:
        text = f.read()
    for target in LINK.findall(text):
        if not target.startswith(("http:", "https:", "#", "mailto:")):
            yield "link", target.split("#")[0]
    for name in ri.MENTION.findall(text):
        yield "name", name


@pytest.mark.parametrize("doc", DOC_FILES)
def test_results_the_docs_name_exist(doc):
    """Links into benchmarks/results/ resolve; a results file named in the text (in backticks or a link) exists;
    no old-style name (GPU spelled out, or without its count) is left."""
    results = set(ri.results_files()) | {"README.md"}
    here = os.path.dirname(os.path.join(ROOT, doc))
    missing = []
    for kind, target in _mentions(doc):
        if kind == "link":
            path = os.path.normpath(os.path.join(here, target))
            if os.path.relpath(path, ROOT).startswith("benchmarks/results") and not os.path.exists(path):
                missing.append(target)
        elif ri.split_name(os.path.basename(target)) and os.path.basename(target) not in results:
            missing.append(target)
    with open(os.path.join(ROOT, doc)) as f:
        old = OLD_NAME.findall(f.read())
    assert not missing and not old, (missing, old)


def test_split_name():
    assert ri.split_name("dispatch_ep2_copy_engine_2xH200.json") == {
        "benchmark": "dispatch", "label": "ep2_copy_engine", "machine": "2xH200", "gpus": "2", "gpu": "H200",
        "stem": "dispatch_ep2_copy_engine_2xH200", "ext": "json"}
    assert ri.split_name("dispatch_hosts_emulated_2xH100.md")["benchmark"] == "dispatch_hosts"
    assert ri.split_name("planner_quality_cpu.md")["machine"] == "cpu"
    assert ri.split_name("e2e_torchtitan_spread_2xH200.md")["label"] == "torchtitan_spread"
    for bad in ("e2e_NVIDIA_H200.json", "scaling_H200.md", "step_breakdown_v2lite_1b_gpu_ep2.json",
                "moe_layer_1xh200.json", "nothing_known_1xH100.json", "e2e_2xH200.txt"):
        assert ri.split_name(bad) is None, bad


def test_writers_name_files_by_the_scheme(tmp_path):
    from benchmarks.common import gpu_short, machine, write_results

    assert [gpu_short(g) for g in ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3", "NVIDIA H200", "H200", "cpu")] \
        == ["H100", "H100", "H200", "H200", "cpu"]
    assert machine("NVIDIA H200", 4) == "4xH200" and machine("cpu", 4) == "cpu"
    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "t", "date": "d"}
    stem = write_results("dispatch_ep2", env, [{"a": 1}], "| a |", str(tmp_path), gpus=2, script="benchmarks/x.py")
    assert os.path.basename(stem) == "dispatch_ep2_2xH100"
    data = json.loads((tmp_path / "dispatch_ep2_2xH100.json").read_text())
    assert data["env"]["gpus"] == 2 and data["script"] == "benchmarks/x.py" and data["rows"] == [{"a": 1}]
    assert ri.split_name("dispatch_ep2_2xH100.md")
    stem = write_results("planner_quality", dict(env, gpu="cpu"), [], "", str(tmp_path))
    assert os.path.basename(stem) == "planner_quality_cpu"


def test_step_breakdown_names_its_file_from_the_traces(tmp_path, monkeypatch):
    """The profiled runs' device and world size (the trace's ``deviceProperties`` and ``distributedInfo``) make
    the machine part; ``--gpus`` overrides the count."""
    import sys

    from benchmarks import step_breakdown

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "tid": 1},
              {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 50, "tid": 7, "args": {}}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"name": "NVIDIA H200"}],
                                 "distributedInfo": {"world_size": 2}}))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["step_breakdown.py", f"ep2={trace}", "--name", "x", "--out", str(out)])
    step_breakdown.main()
    data = json.loads((out / "step_breakdown_x_2xH200.json").read_text())
    assert data["env"]["gpus"] == 2 and data["rows"][0]["label"] == "ep2"
    monkeypatch.setattr(sys, "argv", ["step_breakdown.py", str(trace), "--name", "x", "--gpus", "1", "--out", str(out)])
    step_breakdown.main()
    assert (out / "step_breakdown_x_1xH200.md").exists()
