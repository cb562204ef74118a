"""Training throughput of whole runs, in one process tree each, same model/data/parallelism:

    ours_eager   recipes/pretrain.py
    ours_graph   recipes/pretrain.py --training.cuda_graph true   (full-iteration CUDA graph)
    torchtitan   torchtitan 0.2.2's own trainer (benchmarks/torchtitan_main.py), its own MoE

Both read the same text (Python stdlib source as .jsonl) with the same byte-level HF tokenizer.
tokens/s per GPU is the median over the logged windows of the second half of the run.

    python benchmarks/trainer_throughput.py --nproc 2 --config train_configs/v2lite_1b_gpu.toml \
        --ours "--parallelism.expert_parallel_degree 2 --moe_echo.dispatcher nvlink" \
        --titan "--parallelism.expert_parallel_degree 2" --runs torchtitan,ours_eager,ours_graph
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402


def make_assets(folder: str, mb: int = 16) -> tuple[str, str]:
    """(tokenizer dir, data .jsonl): byte-level BPE without merges (256 bytes + BOS/EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from components.train.data import stdlib_documents

    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)  # its own folder: load_dataset reads all files
    data = os.path.join(folder, "data", "stdlib.jsonl")
    if not os.path.exists(data):
        with open(data + ".tmp", "w") as f:
            for doc in stdlib_documents(mb * 1_000_000):
                f.write(json.dumps({"text": doc}) + "\n")
        os.replace(data + ".tmp", data)
    tok_dir = os.path.join(folder, "tokenizer")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        os.makedirs(tok_dir, exist_ok=True)
        vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
        tok.save(os.path.join(tok_dir, "tokenizer.json"))
        with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return tok_dir, data


def titan_toml(cfg: dict, steps: int, dump: str, tok_dir: str, data_dir: str) -> str:
    t, m, o = cfg["training"], cfg["model"], cfg["optimizer"]
    text = f"""[job]
dump_folder = "{dump}"
[model]
name = "{m['name']}"
flavor = "{m['flavor']}"
hf_assets_path = "{tok_dir}"
[optimizer]
name = "AdamW"
lr = {o['lr']}
implementation = "fused"
[lr_scheduler]
warmup_steps = {cfg.get('lr_scheduler', {}).get('warmup_steps', 10)}
[training]
dataset = "c4_test"
dataset_path = "{data_dir}"
local_batch_size = {t['local_batch_size']}
seq_len = {t['seq_len']}
steps = {steps}
max_norm = {t.get('max_norm', 1.0)}
mixed_precision_param = "bfloat16"
[metrics]
log_freq = 5
enable_tensorboard = false
[checkpoint]
enable = false
[activation_checkpoint]
mode = "none"
[compile]
enable = false
"""
    path = os.path.join(dump, "titan.toml")
    os.makedirs(dump, exist_ok=True)
    open(path, "w").write(text)
    return path


def steady(values: list[tuple[int, float]], steps: int) -> float:
    late = sorted(v for s, v in values if s > steps // 2) or sorted(v for _, v in values)
    return late[len(late) // 2]


def run(name, a, cfg_path, cfg, tok_dir, data, work):
    dump = os.path.join(work, name)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc)]
    if name == "torchtitan":
        data_dir = os.path.dirname(data)
        cmd = launcher + [os.path.join(ROOT, "benchmarks", "torchtitan_main.py"), "--job.config_file",
                          titan_toml(cfg, a.steps, dump, tok_dir, data_dir)] + shlex.split(a.titan)
    else:
        cmd = launcher + [os.path.join(ROOT, "recipes", "pretrain.py"), "--job.config_file", cfg_path,
                          "--job.dump_folder", dump, "--training.steps", str(a.steps), "--metrics.log_freq", "5",
                          "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
                          "--training.dataset", "local", "--training.dataset_path", data,
                          "--model.hf_assets_path", tok_dir] + shlex.split(a.ours)
        if name == "ours_graph":
            cmd += ["--training.cuda_graph", "true"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=a.timeout)
    log = p.stdout + p.stderr
    open(os.path.join(work, f"{name}.log"), "w").write(log)
    if p.returncode != 0:
        lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith(("W1", "I1", "  warnings"))]
        print(f"--- {name} failed (rc {p.returncode}); last lines:\n" + "\n".join(lines[-30:]), flush=True)
        return {"run": name, "error": log.strip().splitlines()[-1][:200] if log.strip() else f"rc {p.returncode}"}
    if name == "torchtitan":  # "step: 25 ... tps: 12,345" (per device)
        vals = [(int(s), float(v.replace(",", ""))) for s, v in
                re.findall(r"step:\s*(\d+).*?tps:\s*([\d,]+)", re.sub(r"\x1b\[[0-9;]*m", "", log))]
    else:
        rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
        vals = [(r["step"], r["tokens_per_s"] / a.nproc) for r in rows if "tokens_per_s" in r]  # untimed: replayed
    tps = steady(vals, a.steps)
    tokens_per_gpu_step = cfg["training"]["local_batch_size"] * cfg["training"]["seq_len"]
    graph = re.search(r"cuda graph\s+(.*)", log)
    return {"run": name, "tokens_per_s_per_gpu": tps, "step_ms": 1e3 * tokens_per_gpu_step / tps,
            "graph": graph.group(1).strip() if graph else ""}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="train_configs/v2lite_1b_gpu.toml")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", default="torchtitan,ours_eager,ours_graph")
    ap.add_argument("--ours", default="", help="extra recipe arguments")
    ap.add_argument("--titan", default="", help="extra torchtitan arguments")
    ap.add_argument("--label", default="")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg_path = os.path.join(ROOT, a.config)
    cfg = tomllib.load(open(cfg_path, "rb"))
    work = "/tmp/moe_echo_throughput"
    tok_dir, data = make_assets(os.path.join(work, "assets"))
    rows = []
    for name in a.runs.split(","):
        r = run(name, a, cfg_path, cfg, tok_dir, data, work)
        r.update({"config": os.path.basename(a.config), "gpus": a.nproc, "label": a.label})
        rows.append(r)
        print(r, flush=True)
    base = {r["run"]: r.get("tokens_per_s_per_gpu") for r in rows}
    for r in rows:
        if r.get("tokens_per_s_per_gpu") and base.get("torchtitan"):
            r["vs_torchtitan"] = r["tokens_per_s_per_gpu"] / base["torchtitan"]
        if r["run"] == "ours_graph" and base.get("ours_eager") and r.get("tokens_per_s_per_gpu"):
            r["graph_vs_eager"] = r["tokens_per_s_per_gpu"] / base["ours_eager"]
    cols = ["config", "label", "gpus", "run", "tokens_per_s_per_gpu", "step_ms", "vs_torchtitan", "graph_vs_eager",
            "graph", "error"]
    table = markdown_table(rows, cols)
    env = environment()
    stem = write_results(f"throughput_{os.path.basename(a.config).split('.')[0]}_{a.nproc}gpu{a.label}", env, rows,
                         table, a.out)
    print(f"\ntraining throughput, {env['gpu']} ({stem}.json)\n{table}")


if __name__ == "__main__":
    main()
