"""EP=4 and EP=8 over gloo on CPU (no GPUs needed): the tiny config trained with ECHO off/on,
natural routing and 2 hot experts — correctness (ECHO-on losses equal ECHO-off) and imbalance
figures only; times on a 2-core machine say nothing about GPUs.

    python benchmarks/ep_scaling_cpu.py --ep 4,8 --steps 20
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

VARIANTS = {
    "natural_off": [],
    "natural_on": ["--moe_echo.echo", "true"],
    "skewed_off": ["--moe_echo.bias_update_rate", "0", "--moe_echo.debug_hot_experts", "2"],
    "skewed_on": ["--moe_echo.bias_update_rate", "0", "--moe_echo.debug_hot_experts", "2", "--moe_echo.echo", "true"],
}


def run(ep: int, name: str, steps: int, work: str) -> dict:
    dump = os.path.join(work, f"ep{ep}_{name}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ep), os.path.join(ROOT, "recipes",
           "pretrain.py"), "--job.config_file", os.path.join(ROOT, "train_configs", "debug_cpu.toml"),
           "--job.dump_folder", dump, "--training.steps", str(steps), "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", "--training.seq_len", "64",
           "--training.local_batch_size", "4", "--training.max_corpus_mb", "1",
           "--parallelism.expert_parallel_degree", str(ep), "--moe_echo.capacity_factor", "1.5",
           *VARIANTS[name]]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        return {"ep": ep, "run": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:160]}
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    rank = re.search(r"rank load\s+max/mean ([\d.]+) without ECHO -> ([\d.]+) with ECHO", p.stdout)
    last = rows[-1]
    return {"ep": ep, "run": name, "losses": [r["loss"] for r in rows], "loss_first": rows[0]["loss"],
            "loss_last": last["loss"], "rank_load_before": float(rank.group(1)) if rank else None,
            "rank_load_after": float(rank.group(2)) if rank else None,
            "overflowed": last.get("moe/overflow_assignments", 0.0), "replayed": last.get("moe/replayed_steps", 0.0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", default="4,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = "/tmp/moe_echo_ep_cpu"
    rows = []
    for ep in map(int, a.ep.split(",")):
        for name in VARIANTS:
            rows.append(run(ep, name, a.steps, work))
            print({k: v for k, v in rows[-1].items() if k != "losses"}, flush=True)
    for r in rows:  # ECHO changes where experts run, never the math: on vs off losses agree
        off = next((o for o in rows if o["ep"] == r["ep"] and o["run"] == r["run"].replace("_on", "_off")), None)
        if r["run"].endswith("_on") and off and "losses" in r and "losses" in off:
            r["max_loss_diff_vs_off"] = max(abs(x - y) for x, y in zip(r["losses"], off["losses"]))
    table = markdown_table(rows, ["ep", "run", "loss_first", "loss_last", "rank_load_before", "rank_load_after",
                                  "overflowed", "replayed", "max_loss_diff_vs_off", "error"])
    env = {**environment(), "gpu": "cpu"}  # gloo ranks on CPU whatever the machine has
    env["machine"] = f"CPU, {os.cpu_count()} cores, gloo"
    stem = write_results("ep_scaling_cpu_gloo", env, rows, table, a.out)
    print(f"\nEP over gloo on CPU ({stem}.json)\n{table}")


if __name__ == "__main__":
    main()
