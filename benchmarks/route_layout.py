"""Slot ranks (``kernels.route_layout.slot_ranks``: each routed slot's rank among the slots of its id, and the
counts per id) at training sizes, captured in a CUDA graph, against the torch version (stable argsort; eager: its
bincount reads a size on the host) and,
with ``--base DIR``, the same function of another source tree in the same run.

    python benchmarks/route_layout.py [--base /tmp/base] [--out DIR]

N = T·K slots of one rank, X ids, Zipf(1.2) popularity (the skew of real routing); every result is checked
against the torch version before it is timed.
"""

import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.common import environment, graphed, markdown_table, time_ms, write_results
from kernels.route_layout import slot_ranks, slot_ranks_torch


def load_base(root: str):
    """``kernels.route_layout`` of the tree at ``root`` (its own package-relative imports resolved there)."""
    spec = importlib.util.spec_from_file_location("base_kernels", os.path.join(root, "kernels", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(root, "kernels")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["base_kernels"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("base_kernels.route_layout")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--ids", default="64,256")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--base", default="", help="another tree's root: its slot_ranks timed beside this one")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base = load_base(a.base) if a.base else None
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for X in map(int, a.ids.split(",")):
        zipf = 1.0 / torch.arange(1, X + 1, device="cuda", dtype=torch.float64) ** 1.2
        for T in map(int, a.tokens.split(",")):
            N = T * a.top_k
            ids = torch.multinomial(zipf, N, replacement=True, generator=g)
            want = slot_ranks_torch(ids, X)
            fns = {"ours": lambda: slot_ranks(ids, X), "torch": lambda: slot_ranks_torch(ids, X)}
            if base is not None:
                fns["base"] = lambda: base.slot_ranks(ids, X)
            row = {"T": T, "K": a.top_k, "N": N, "X": X}
            for name, fn in fns.items():
                got = fn()
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, T, X)
                # torch's bincount reads its size on the host: not capturable, timed eagerly
                row[f"{name}_graph_ms" if name != "torch" else "torch_ms"] = time_ms(graphed(fn) if name != "torch" else fn)
            row["vs_torch"] = row["torch_ms"] / row["ours_graph_ms"]
            if base is not None:
                row["vs_base"] = row["base_graph_ms"] / row["ours_graph_ms"]
            rows.append(row)
            print(row, flush=True)
    env = environment()
    cols = ["T", "K", "N", "X", "ours_graph_ms", "torch_ms"] + (["base_graph_ms", "vs_base"] if base else [])
    table = (f"slot_ranks on {env['gpu']} (benchmarks/route_layout.py; torch {env['torch']}, {env['date']}; graphed; "
             f"Zipf(1.2) ids)\n\n" + markdown_table(rows, cols + ["vs_torch"]))
    print(table)
    write_results("route_layout", env, rows, table, a.out)


if __name__ == "__main__":
    main()
