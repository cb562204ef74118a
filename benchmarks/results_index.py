"""Writes benchmarks/results/README.md: one line per results file, with its benchmark, label, GPUs, date and torch
(from the JSON's env), the script that wrote it and the documentation sections that cite it.

    python benchmarks/results_index.py            # rewrite the index
    python benchmarks/results_index.py --check    # exit 1 where the committed index is not what this writes

Results files are named ``<benchmark>[_<label>]_<N>x<GPU>.{json,md}`` (N GPUs of one kind, GPU spelled ``H100``,
``H200``; ``_cpu`` for what ran on CPU alone: benchmarks/common.py ``NAME``). The benchmark is the longest name in
``BENCHMARKS`` the file name starts with; the rest before the machine part is its label.
"""

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
INDEX = os.path.join(RESULTS, "README.md")
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

# The machine part of a results name: <N>x<GPU> or cpu (the same pattern as benchmarks/common.py NAME, kept here so
# the index needs no torch).
NAME = re.compile(r"^(?P<stem>[a-z0-9][A-Za-z0-9_.]*?)_(?P<machine>(?P<gpus>\d+)x(?P<gpu>[A-Z][A-Za-z0-9]*)|cpu)"
                  r"\.(?P<ext>json|md)$")

# benchmark -> what writes its files: a script, or the GPU suite whose logs its table was written from
BENCHMARKS = {
    "copy_engine": "benchmarks/copy_engine.py",
    "fp8_operand_layout": "benchmarks/fp8_operand_layout.py",
    "cross_entropy_fp8": "benchmarks/cross_entropy_fp8.py",
    "dispatch": "benchmarks/dispatch.py",
    "dispatch_hosts": "benchmarks/dispatch_hosts.py",
    "e2e": "benchmarks/e2e.py",
    "e2e_hosts": "benchmarks/e2e.py --hosts",
    "echo_e2e": "benchmarks/gpu/run.sh echo, echo_e2e",
    "echo_recompute": "benchmarks/echo_recompute.py",
    "echo_sim": "benchmarks/echo_sim.py",
    "ep4_nvlink_training": "benchmarks/gpu/run.sh ep4",
    "ep4_training": "benchmarks/gpu/run.sh ep4_padded",
    "ep4_v2lite_6b": "benchmarks/gpu/run.sh ep4_6b",
    "ep_scaling_cpu": "benchmarks/ep_scaling_cpu.py",
    "fp8_bound": "benchmarks/fp8_bound.py",
    "fp8_experts": "benchmarks/gpu/run.sh fp8",
    "fp8_ffn": "benchmarks/fp8_ffn.py",
    "fp8_linear": "benchmarks/fp8_linear.py",
    "fp8_head": "benchmarks/fp8_head.py",
    "fp8_requant": "benchmarks/fp8_requant.py",
    "fp8_rows": "benchmarks/fp8_rows.py",
    "gate_up_gemm": "benchmarks/gate_up_gemm.py",
    "gather_gemm": "benchmarks/gather_gemm.py",
    "gpu_tests": "benchmarks/gpu/run.sh graph",
    "grouped_gemm_fp8": "benchmarks/grouped_gemm_fp8.py",
    "grouped_gemm_fp8_wgrad": "benchmarks/grouped_gemm_fp8.py --wgrad",
    "grouped_wgrad_fp8": "benchmarks/grouped_gemm_fp8.py --wgrad-only",
    "moe_layer": "benchmarks/moe_layer.py",
    "nonfinite_guard": "benchmarks/gpu/run.sh guard",
    "nvlink_bound": "benchmarks/nvlink_bound.py",
    "optimizer_pass": "benchmarks/optimizer_pass.py",
    "planner_quality": "benchmarks/planner.py",
    "planner_time": "benchmarks/planner.py --time",
    "recapture": "benchmarks/gpu/run.sh recapture",
    "route_layout": "benchmarks/route_layout.py",
    "router": "benchmarks/router.py",
    "row_kernels": "benchmarks/row_kernels.py",
    "sanitizer": "benchmarks/gpu/run.sh sanitize",
    "scaling": "benchmarks/gpu/run.sh scaling",
    "step_breakdown": "benchmarks/step_breakdown.py",
    "step_sim": "benchmarks/step_sim.py",
    "step_sim_hosts": "benchmarks/step_sim.py --hosts-only",
}

# a results file's name as the documentation writes it (linked or in backticks)
MENTION = re.compile(r"[A-Za-z0-9_.]+\.(?:md|json)\b")


def split_name(filename: str) -> dict | None:
    """{benchmark, label, machine, gpus, gpu, stem, ext} of a results file name; None where it does not follow the
    scheme or names no known benchmark."""
    m = NAME.match(filename)
    if not m:
        return None
    stem = m.group("stem")
    known = [b for b in BENCHMARKS if stem == b or stem.startswith(b + "_")]
    if not known:
        return None
    bench = max(known, key=len)
    return {"benchmark": bench, "label": stem[len(bench) + 1:], "machine": m.group("machine"),
            "gpus": m.group("gpus"), "gpu": m.group("gpu"), "stem": filename.rsplit(".", 1)[0], "ext": m.group("ext")}


def results_files(results: str = RESULTS) -> list[str]:
    """Every file in the results folder but the index."""
    return sorted(f for f in os.listdir(results) if f != os.path.basename(INDEX) and not f.startswith("."))


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def citations(root: str = ROOT, docs: list[str] = DOCS) -> dict[str, list[tuple[str, str]]]:
    """results file name -> [(doc, section heading)] of README.md and docs/*.md that name it."""
    out: dict[str, list[tuple[str, str]]] = {}
    for doc in docs:
        section = ""
        with open(os.path.join(root, doc)) as f:
            for line in f:
                if line.startswith("#"):
                    section = line.lstrip("#").strip()
                    continue
                for name in MENTION.findall(line):
                    name = os.path.basename(name)
                    if (doc, section) not in out.setdefault(name, []):
                        out[name].append((doc, section))
    return out


def env_of(path_json: str | None, path_md: str | None) -> tuple[str, str, str]:
    """(date, torch, script) from a results JSON (``env``, ``script``), else what its markdown header says."""
    date = torch = script = ""
    if path_json:
        with open(path_json) as f:
            data = json.load(f)
        if isinstance(data, dict):
            env = data.get("env") if isinstance(data.get("env"), dict) else {}
            date, torch, script = str(env.get("date", ""))[:10], str(env.get("torch", "")), data.get("script", "")
    if path_md and not (date and torch):
        with open(path_md) as f:
            head = "".join(f.readline() for _ in range(3))
        d = re.search(r"\d{4}-\d{2}-\d{2}", head)
        t = re.search(r"torch (\d+\.\d+(?:\.\d+)?(?:\+\w+)?)", head)
        date = date or (d.group(0) if d else "")
        torch = torch or (t.group(1) if t else "")
    return date, torch, script or ""


def index(results: str = RESULTS, root: str = ROOT) -> str:
    """The text of benchmarks/results/README.md."""
    cited = citations(root)
    stems: dict[str, dict] = {}
    for f in results_files(results):
        parts = split_name(f)
        if parts is None:
            raise ValueError(f"benchmarks/results/{f}: not <benchmark>[_<label>]_<N>x<GPU>.{{json,md}} of a benchmark "
                             "in benchmarks/results_index.py BENCHMARKS")
        stems.setdefault(parts["stem"], parts)[parts["ext"]] = f
    rel = os.path.relpath(root, results)
    lines = [
        "# Results",
        "",
        "Written by `python benchmarks/results_index.py`: one line per results file. Files are named",
        "`<benchmark>[_<label>]_<N>x<GPU>.{json,md}`: N GPUs of one kind (`H100`, `H200`) the figures ran on, or",
        "`_cpu` for what ran on CPU alone. A `.json` holds `env` (GPU, torch, date), `script` and `rows`; the `.md`",
        "beside it the table. What each figure means and the command behind it:",
        f"[docs/performance.md]({rel}/docs/performance.md); the GPU suites: [benchmarks/gpu/README.md](../gpu/README.md).",
        "",
        "| file | benchmark | label | GPUs | date | torch | written by | cited in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stem in sorted(stems):
        p = stems[stem]
        js = os.path.join(results, p["json"]) if "json" in p else None
        md = os.path.join(results, p["md"]) if "md" in p else None
        date, torch, script = env_of(js, md)
        files = ", ".join(f"[{p[e]}]({p[e]})" for e in ("md", "json") if e in p)
        gpus = "CPU" if p["machine"] == "cpu" else f"{p['gpus']}×{p['gpu']}"
        docs = []
        for e in ("md", "json"):
            for doc, section in cited.get(p.get(e, ""), []):
                link = f"[{doc}{' § ' + section if section else ''}]({rel}/{doc}{'#' + anchor(section) if section else ''})"
                if link not in docs:
                    docs.append(link)
        lines.append(f"| {files} | {p['benchmark']} | {p['label'] or '–'} | {gpus} | {date or '–'} | {torch or '–'} | "
                     f"`{script or BENCHMARKS[p['benchmark']]}` | {'; '.join(docs) or '–'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare with the committed index (exit 1 if stale)")
    a = ap.parse_args()
    try:
        text = index()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        with open(INDEX) as f:
            if f.read() != text:
                print("error: benchmarks/results/README.md is stale: run python benchmarks/results_index.py",
                      file=sys.stderr)
                return 1
        return 0
    with open(INDEX, "w") as f:
        f.write(text)
    print(f"{os.path.relpath(INDEX)}: {text.count(chr(10) + '| [')} results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
