"""End-to-end training throughput: moe-echo's recipe vs torchtitan 0.2.2's own trainer, same run.

Runs, each a fresh process tree in a fresh folder (``<work>/<config>_<gpus>gpu_<run>_<random>``):

    torchtitan          torchtitan's trainer (benchmarks/torchtitan_main.py), its own MoE, no compile
    torchtitan_compile  the same with ``--compile.enable`` (components model + loss)
    ours_eager          recipes/pretrain.py
    ours_graph          recipes/pretrain.py --training.cuda_graph true (the whole step one CUDA graph)
    ours_compile_graph  ours_graph with ``--compile.enable true`` (components model + loss, inductor):
                        each block's dense submodules and the loss compiled, the routed MoE eager,
                        all inside the step's CUDA graph

All five run by default (``--runs`` picks some). "torchtitan best" is the faster of its two runs;
``graph_vs_eager`` = ours_graph / ours_eager, ``compile_vs_graph`` = ours_compile_graph / ours_graph.
``--variants "torch=--moe_echo.experts_gemm torch;quack=--moe_echo.experts_gemm quack"`` runs each of our
runs once per variant (its arguments after ``--ours``), so variants and torchtitan share one invocation and
one baseline; rows carry ``variant``. A variant whose arguments start with ``@DIR`` runs the recipe of the
source tree at DIR (another revision, e.g. ``git archive``'s, with its own config of the same name), so a code
change and the code before it are timed in one invocation: ``--variants "before=@/tmp/base;after="``.
Every run trains the same model flavour on the same text (Python stdlib source as .jsonl) with the
same byte-level HF tokenizer, batch, sequence length, AdamW (fused, same lr / warmup) and bf16
compute with fp32 master weights; no checkpoints, no activation checkpointing.

tokens/s per GPU is the median of the logged windows after the first half of the run (the
steady state), leaving out our windows that replayed an overflowed step and the window after each (its
eager warm-up and re-capture): those time the recovery, not the step, and where they fall differs between
otherwise equal runs. ``replays`` counts the overflowed steps replayed after the first half; ``windows`` the
windows the median is over. MFU uses one formula for every run, torchtitan's:

    flops_per_token = 6 · (active parameters − embedding) + 6 · layers · heads · (d_qk + d_v) · seq_len
                      (torchtitan's ``get_moe_model_nparams_and_flops``: active = dense + router + shared
                      experts + routed experts · top_k / num_experts; the attention term counts QKᵀ and
                      AV forward and backward over the full square, not the causal half)
    mfu = tokens_per_s_per_gpu · flops_per_token / peak   (peak: torchtitan's dense bf16 table,
                      989 TFLOP/s on H100 / H200 SXM)

    python benchmarks/e2e.py --configs debug_gpu,v2lite_1b_gpu --nproc 1 [--runs ...] [--out DIR]
    python benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 2 --ours "--parallelism.expert_parallel_degree 2" \
        --titan "--parallelism.expert_parallel_degree 2" --label ep2
    python benchmarks/e2e.py --configs v2lite_1b_gpu --nproc 1,2,4 --runs ours_compile_graph --label scaling \
        --ours "--parallelism.expert_parallel_degree {nproc}"

Several GPU counts (``--nproc 1,2,4``) run in one invocation, ``{nproc}`` in the run arguments standing for each;
rows of 2+ GPUs then get ``scaling``: their tokens/s per GPU over the 1-GPU row of the same config, label, run and
variant (the per-GPU efficiency of expert parallelism, measured in the same invocation); a variant that cannot run on
one GPU (ECHO) is set against the invocation's first variant's 1-GPU row, and the table names it.

``--repeats N`` runs every run N times, in turn (A B A B ...), and reports the median of the N figures with
``spread_pct`` = 100 · (max − min) / median: one run of a baseline varies by up to ~15% between invocations, so a ratio
resting on one run of each carries that.

Writes ``e2e_<N>x<GPU>.json`` / ``.md``, one table per GPU count N (``--nproc``) and GPU kind (rows {config,
gpus, run, tokens_per_s_per_gpu, step_ms, mfu_pct, vs_torchtitan_best, graph_vs_eager, compile_vs_graph, variant,
rank_load: the busiest EP rank's load over the mean in the steady window, moe: what the MoE layers ran, from the run
summary, e.g. "nvlink+echo, 2 chunks"}); a file already there gets the new rows
merged in (same config/gpus/label/run/variant replaced), so several invocations build one table. ``--table NAME`` writes
``e2e_<NAME>_<N>x<GPU>`` instead. ``--merge FILE`` merges the rows of another invocation's file (e.g. copied back from
the GPU machine that ran it), ``--labels`` / ``--runs`` picking which:

    python benchmarks/e2e.py --merge gpu_out/e2e_2xH200.json                  # into benchmarks/results/e2e_2xH200
    python benchmarks/e2e.py --merge OLD.json --labels=-,ep2_rows --runs ours_compile_graph,torchtitan_compile
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))  # tests/emulated_hosts.py: one torchrun agent per emulated host

from benchmarks.common import environment, markdown_table, results_stem  # noqa: E402

RUNS = ("torchtitan", "torchtitan_compile", "ours_eager", "ours_graph", "ours_compile_graph")


def make_assets(folder: str, mb: int = 16) -> tuple[str, str]:
    """(tokenizer dir, data .jsonl): byte-level BPE without merges (256 bytes + BOS/EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from components.train.data import stdlib_documents

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


def titan_toml(cfg: dict, steps: int, dump: str, tok_dir: str, data_dir: str, compile: bool) -> str:
    """torchtitan's config for the recipe config ``cfg`` (same model, data, batch, optimizer)."""
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
weight_decay = {o.get('weight_decay', 0.1)}
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
enable = {str(compile).lower()}
components = ["model", "loss"]
"""
    path = os.path.join(dump, "titan.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def _run_shape_keys() -> tuple[str, ...]:
    """The keys that change a run's step time and FLOPs: batch shape, flavour, and the ``[model]`` size keys."""
    from components.moe_echo.models import SHAPE_KEYS as MODEL_SIZE_KEYS

    return ("training.local_batch_size", "training.seq_len", "model.flavor", *(f"model.{k}" for k in MODEL_SIZE_KEYS))


def model_args_of(cfg: dict):
    """The model args a run built: its flavour with the ``[model]`` size keys it set."""
    from components.moe_echo.models import SHAPE_KEYS as MODEL_SIZE_KEYS, model_args_for

    m = cfg["model"]
    return model_args_for(m["name"], m["flavor"], {k: int(m[k]) for k in MODEL_SIZE_KEYS if k in m})


def arg_value(args: str, key: str, default=None):
    """The value ``--key value`` (or ``--key=value``) takes last in ``args``."""
    words, value = shlex.split(args), default
    for i, w in enumerate(words):
        k, eq, v = w[2:].partition("=")
        if w.startswith("--") and k == key:
            value = v if eq else (words[i + 1] if i + 1 < len(words) else "")
    return value


def with_overrides(cfg: dict, args: str) -> dict:
    """``cfg`` with the batch shape, model flavour and ``[model]`` sizes that command-line ``args`` set
    (``--section.key value`` or ``=value``), so each run's step time and MFU use what it actually trained."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
    for key in _run_shape_keys():
        value = arg_value(args, key)
        if value is not None:
            section, name = key.split(".")
            out.setdefault(section, {})[name] = value if name == "flavor" else int(value)
    return out


def flops_per_token(cfg: dict) -> float:
    """torchtitan's FLOPs per token of the config's model at its sequence length."""
    import torch

    from components.moe_echo.models import MODEL_CLASSES

    args = model_args_of(cfg)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg["model"]["name"]](args)
    return float(args.get_nparams_and_flops(model, cfg["training"]["seq_len"])[1])


def steady(values: list[tuple[int, float]], steps: int, skip: set[int] = frozenset()) -> float | None:
    """Median of the windows logged after the first half of the run, but those ending at a step in ``skip``."""
    late = [v for s, v in values if s > steps // 2 and s not in skip]
    return statistics.median(late) if late else None


def no_steady_window(values: list[tuple[int, float]], steps: int, skip: set[int]) -> str:
    """The error of a run ``steady`` found no window in: which logged windows of the second half a replay
    disturbed, and a step count whose second half starts after the last of them."""
    late = sorted(s for s in skip if s > steps // 2)
    if not late:
        return f"no window logged after step {steps // 2}: run more steps (--steps) or log more often"
    return (f"no logged window after step {steps // 2} free of replays and re-captures (disturbed: windows ending "
            f"at steps {', '.join(map(str, late))}): run --steps {2 * (late[-1] + 5)} or more, or a larger "
            f"capacity_factor")


def disturbed_windows(rows: list[dict]) -> set[int]:
    """Logged steps whose window replayed an overflowed step (``moe/replayed_steps``, cumulative, grew) or follows
    one that did: a replay is followed by eager warm-up steps and a re-capture, so both windows time those, not
    the graphed step (at 5 steps a window and ``cuda_graph_warmup`` < 5)."""
    total = [(r["step"], r["moe/replayed_steps"]) for r in rows if "moe/replayed_steps" in r]
    grew = [b > a for (_, a), (_, b) in zip([(0, 0)] + total[:-1], total)]
    return {s for i, (s, _) in enumerate(total) if grew[i] or (i > 0 and grew[i - 1])}


def replays_in_steady(rows: list[dict], steps: int) -> int:
    """Overflowed steps replayed inside the steady window (``moe/replayed_steps`` is cumulative): a
    non-zero count means that window also paid for replays and re-captures, not only the step."""
    total = [(r["step"], r["moe/replayed_steps"]) for r in rows if "moe/replayed_steps" in r]
    before = [v for s, v in total if s <= steps // 2]
    return int(total[-1][1] - (before[-1] if before else 0)) if total else 0


def rank_load_in_steady(rows: list[dict], steps: int) -> float | None:
    """Mean over the steady window's logged steps and the MoE layers of the busiest EP rank's load over the
    mean (``moe/<layer>/rank_load_max_over_mean``; with ECHO, after its clones): how long the other ranks
    wait. None at EP=1 or where nothing was logged."""
    vals = [v for r in rows if r.get("step", 0) > steps // 2
            for k, v in r.items() if k.endswith("/rank_load_max_over_mean")]
    return sum(vals) / len(vals) if vals else None


def parse_variants(spec: str) -> list[tuple[str, str]]:
    """``"a=ARGS;b=ARGS"`` -> [(name, args)]; empty -> one unnamed variant."""
    if not spec.strip():
        return [("", "")]
    out = []
    for part in spec.split(";"):
        name, sep, args = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--variants: {part!r} is not NAME=ARGS (e.g. \"quack=--moe_echo.experts_gemm quack\")")
        out.append((name.strip(), args.strip()))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"--variants: a name repeats in {spec!r}")
    return out


def source_tree(extra: str) -> tuple[str, str]:
    """(root of the source tree the run uses, the recipe arguments): ``"@DIR ARGS"`` -> (DIR, ARGS)."""
    if not extra.startswith("@"):
        return ROOT, extra
    tree, _, rest = extra[1:].partition(" ")
    tree = os.path.abspath(tree)
    if not os.path.isfile(os.path.join(tree, "recipes", "pretrain.py")):
        raise ValueError(f"--variants: @{tree} is not a moe-echo source tree (no recipes/pretrain.py); "
                         "unpack one there, e.g. git archive REV | tar -x -C DIR")
    return tree, rest.strip()


def failure_line(log: str) -> str:
    """The line that says why a run failed: the recipe's one-line ``error: ...`` if printed, else the
    last line that is not a launcher banner or warning."""
    lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith(("W1", "I1", "  warnings"))]
    errors = [ln.strip() for ln in lines if ln.lstrip().startswith("error:")]
    if errors:
        return errors[-1][:200]
    lines = [ln for ln in lines if set(ln.strip()) - set("=-")]  # not a separator rule
    return lines[-1][:160] if lines else ""


def combine_repeats(rs: list[dict]) -> dict:
    """One row from the repeats of a run (same run, variant and arguments): tokens/s per GPU is their median, and
    ``spread_pct`` = 100 · (max − min) / median of the repeats' figures; the other columns come from the repeat
    nearest the median (peak memory: the largest; replays and windows: summed). A repeat that failed makes the
    row its error."""
    failed = [r for r in rs if not r.get("tokens_per_s_per_gpu")]
    if failed:
        return dict(failed[0], error=f"repeat {rs.index(failed[0]) + 1} of {len(rs)}: {failed[0].get('error', '')}")
    if len(rs) == 1:
        return rs[0]
    tps = [r["tokens_per_s_per_gpu"] for r in rs]
    mid = statistics.median(tps)
    row = dict(min(rs, key=lambda r: abs(r["tokens_per_s_per_gpu"] - mid)))
    peaks = [r["peak_gib"] for r in rs if r.get("peak_gib") is not None]
    row.update(tokens_per_s_per_gpu=mid, repeats=len(rs), repeat_tokens_per_s=tps,
               spread_pct=100 * (max(tps) - min(tps)) / mid, peak_gib=max(peaks) if peaks else None,
               folder=[r["folder"] for r in rs])
    for col in ("replays", "windows"):
        if all(r.get(col) is not None for r in rs):
            row[col] = sum(r[col] for r in rs)
    return row


def compare(group: list[dict]) -> None:
    """Ratios inside one invocation's rows: vs the faster torchtitan run, graphed vs eager and compiled vs
    graphed (the latter two within one variant)."""
    best = max((r.get("tokens_per_s_per_gpu") or 0 for r in group if r["run"].startswith("torchtitan")), default=0)
    tps = {(r["run"], r.get("variant", "")): r.get("tokens_per_s_per_gpu") for r in group}
    for r in group:
        if r.get("tokens_per_s_per_gpu") and best:
            r["vs_torchtitan_best"] = r["tokens_per_s_per_gpu"] / best
        for run, over, col in (("ours_graph", "ours_eager", "graph_vs_eager"),
                               ("ours_compile_graph", "ours_graph", "compile_vs_graph")):
            base = tps.get((over, r.get("variant", "")))
            if r["run"] == run and base and r.get("tokens_per_s_per_gpu"):
                r[col] = r["tokens_per_s_per_gpu"] / base


def command(run: str, a, cfg_path: str, cfg: dict, dump: str, tok_dir: str, data: str, extra: str = "") -> list[str]:
    """The run's command line after ``torchrun``'s own arguments (``launch`` adds them)."""
    launcher = []
    if run.startswith("torchtitan"):
        toml = titan_toml(cfg, a.steps, dump, tok_dir, os.path.dirname(data), run == "torchtitan_compile")
        return launcher + [os.path.join(ROOT, "benchmarks", "torchtitan_main.py"), "--job.config_file", toml,
                           "--metrics.disable_color_printing"] + shlex.split(a.titan)
    root, extra = source_tree(extra)
    own = os.path.join(root, "train_configs", os.path.basename(cfg_path))  # the tree's own config of that name
    cmd = launcher + [os.path.join(root, "recipes", "pretrain.py"), "--job.config_file",
                      own if os.path.isfile(own) else cfg_path,
                      "--job.dump_folder", dump, "--training.steps", str(a.steps), "--metrics.log_freq", "5",
                      "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
                      "--training.dataset", "local", "--training.dataset_path", data,
                      "--model.hf_assets_path", tok_dir, "--training.cuda_graph", str(run.endswith("graph")).lower(),
                      "--compile.enable", str(run == "ours_compile_graph").lower()]
    return cmd + shlex.split(a.ours) + shlex.split(extra)


def launch(script: list[str], a, cwd: str) -> tuple[str, int | str]:
    """Run ``script`` under torchrun on ``a.nproc`` GPUs: one agent, or with ``a.hosts`` > 1 one agent per
    emulated host (its GPUs and its own NCCL_HOSTID: NCCL's network transport between them). (log, exit code)."""
    if getattr(a, "hosts", 1) > 1:
        from emulated_hosts import start_hosts, wait_hosts

        try:
            results = wait_hosts(start_hosts(script, a.hosts, a.nproc // a.hosts, gpus=True, cwd=cwd), a.timeout)
        except AssertionError as e:
            return str(e), "timeout"
        rc = next((r.returncode for r in results if r.returncode != 0), 0)
        return "".join(r.stdout + r.stderr for r in results), rc
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc),
                "--master_port", str(29500 + os.getpid() % 1000)]
    try:
        p = subprocess.run(launcher + script, capture_output=True, text=True, cwd=cwd, timeout=a.timeout)
        return p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        return (e.stdout or b"").decode() + (e.stderr or b"").decode(), "timeout"


def measure(run: str, a, cfg_path: str, cfg: dict, tok_dir: str, data: str, work: str, variant: str = "",
            extra: str = "") -> dict:
    name = os.path.basename(cfg_path).split(".")[0]
    tag = f"_{variant}" if variant else ""
    dump = tempfile.mkdtemp(prefix=f"{name}_{a.nproc}gpu{a.label}_{run}{tag}_", dir=work)  # always a fresh folder
    cmd = command(run, a, cfg_path, cfg, dump, tok_dir, data, extra)
    log, rc = launch(cmd, a, source_tree(extra)[0])
    cmd = ["torchrun", *(["--nnodes", str(a.hosts)] if getattr(a, "hosts", 1) > 1 else []), *cmd]
    with open(os.path.join(dump, "run.log"), "w") as f:
        f.write(" ".join(map(shlex.quote, cmd)) + "\n" + log)
    if rc != 0:
        lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith(("W1", "I1", "  warnings"))]
        print(f"--- {run} failed (rc {rc}); last lines:\n" + "\n".join(lines[-25:]), flush=True)
        return {"run": run, "error": f"rc {rc}: {failure_line(log)}", "folder": dump}
    if run.startswith("torchtitan"):  # "step: 25  loss: ...  tps: 12,345 ..." per device
        vals = [(int(s), float(v.replace(",", ""))) for s, v in re.findall(r"step:\s*(\d+).*?tps:\s*([\d,]+)", log)]
    else:
        rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
        vals = [(r["step"], r["tokens_per_s"] / a.nproc) for r in rows if "tokens_per_s" in r]  # untimed: replayed
    replays = None if run.startswith("torchtitan") else replays_in_steady(rows, a.steps)
    rank_load = None if run.startswith("torchtitan") else rank_load_in_steady(rows, a.steps)
    skip = set() if run.startswith("torchtitan") else disturbed_windows(rows)
    tps = steady(vals, a.steps, skip)
    if tps is None:
        return {"run": run, "error": no_steady_window(vals, a.steps, skip), "folder": dump}
    graph = re.search(r"cuda graph\s+(.*)", log)
    windows = len([s for s, _ in vals if s > a.steps // 2 and s not in skip])
    return {"run": run, "tokens_per_s_per_gpu": tps, "windows": windows,
            "graph": graph.group(1).strip() if graph else "", "replays": replays, "rank_load": rank_load,
            "moe": moe_setup(log), "peak_gib": peak_gib(run, log, dump), "folder": dump}


def moe_setup(log: str) -> str:
    """What the MoE layers ran, from the run summary's ``dispatcher`` line: the backend, ``+echo`` where ECHO ran
    (set, or turned on by ``echo = "auto"``) and the token chunks per layer where more than one ("nvlink+echo,
    2 chunks"); "" where the log has no such line (torchtitan's runs)."""
    m = re.search(r"^dispatcher\s+(\w+?)Dispatcher(.*)$", log, re.M)
    if not m:
        return ""
    chunks = re.search(r"(\d+) token chunks", m.group(2))
    return (m.group(1).lower() + ("+echo" if "ECHO on" in m.group(2) else "")
            + (f", {chunks.group(1)} chunks" if chunks else ""))


def peak_gib(run: str, log: str, dump: str) -> float | None:
    """Peak GPU memory of rank 0: torchtitan's logged "memory: X GiB" (max reserved); ours: the
    allocator's peak plus the symmetric-memory buffers it does not count."""
    if run.startswith("torchtitan"):
        seen = [float(v) for v in re.findall(r"memory:\s*([\d.]+)\s*GiB", log)]
        return max(seen) if seen else None
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    peaks = [r["memory/peak_gib"] + r.get("memory/peer_gib", 0.0) for r in rows if "memory/peak_gib" in r]
    return max(peaks) if peaks else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="debug_gpu,v2lite_1b_gpu,qwen3_30b_a3b_small_gpu",
                    help="train_configs/<name>.toml, comma-separated")
    ap.add_argument("--nproc", default="1", help="GPUs in all; several (1,2,4) run every run at each count in one "
                                                "invocation, {nproc} in --ours / --titan / --variants standing for it, "
                                                "and rows of 2+ GPUs get scaling = their tokens/s per GPU over the "
                                                "1-GPU row of the same run")
    ap.add_argument("--hosts", type=int, default=1,
                    help="emulate this many hosts on this machine (our runs only): one torchrun agent per host, "
                         "nproc / hosts GPUs each, each its own NCCL_HOSTID")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", default=None, help=f"comma-separated, some of {','.join(RUNS)} (default: all)")
    ap.add_argument("--ours", default="", help="extra recipe arguments")
    ap.add_argument("--titan", default="", help="extra torchtitan arguments")
    ap.add_argument("--variants", default="", help='our runs once per "NAME=ARGS;NAME=ARGS" (after --ours)')
    ap.add_argument("--label", default="", help="names this invocation's rows (e.g. ep2)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every run this many times, in turn (ABAB), and report the median and the spread")
    ap.add_argument("--work", default=None, help="parent of the run folders (default: a new temp folder)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--render", default=None, metavar="JSON", help="only rewrite the markdown table of this file")
    ap.add_argument("--merge", default=None, metavar="JSON",
                    help="merge the rows of another invocation's e2e JSON (e.g. copied back from the GPU host that ran "
                         "it) into --out's e2e_<N>x<GPU> files, as if this invocation had measured them, and rewrite their "
                         "tables (--labels and --runs pick the rows)")
    ap.add_argument("--labels", default=None,
                    help="--merge: only rows with these labels, comma-separated; - for unlabelled rows (--labels=-,ep2)")
    ap.add_argument("--table", default="", metavar="NAME",
                    help="write e2e_<NAME>_<N>x<GPU> instead of e2e_<N>x<GPU> (a table of its own)")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: give 1 or more")
    if a.render:
        print(render(a.render))
        return
    if a.merge:
        try:
            with open(a.merge) as f:
                src = json.load(f)
            rows, env, peak = src["rows"], src["env"], src["peak_tflops"] * 1e12
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--merge {a.merge}: not an e2e results file ({type(e).__name__}: {e}); pass e2e_<N>x<GPU>.json")
        runs = None if a.runs is None else set(a.runs.split(","))
        labels = None if a.labels is None else {"" if w.strip() == "-" else w.strip() for w in a.labels.split(",")}
        rows = [r for r in rows if (runs is None or r.get("run") in runs)
                and (labels is None or r.get("label", "") in labels)]
        if not rows:
            ap.error(f"--merge {a.merge}: no row with those --labels and --runs")
        write(rows, env, peak, a.out, stamp=False, table=a.table)
        return
    a.runs = a.runs or ",".join(RUNS)
    try:
        counts = gpu_counts(a.nproc)
        variants = parse_variants(a.variants)
        for _, extra in variants:
            source_tree(extra.replace("{nproc}", "1"))
    except ValueError as e:
        ap.error(str(e))
    a.label = f"_{a.label}" if a.label and not a.label.startswith("_") else a.label
    for run in a.runs.split(","):
        if run not in RUNS:
            ap.error(f"--runs: unknown run {run!r}; expected some of {','.join(RUNS)}")
        if a.hosts > 1 and not run.startswith("ours"):
            ap.error(f"--hosts {a.hosts}: emulated hosts run our recipe only; drop {run!r} from --runs")
    if a.hosts < 1 or any(n % a.hosts for n in counts):
        ap.error(f"--hosts {a.hosts} must divide --nproc {a.nproc}")
    work = a.work or tempfile.mkdtemp(prefix="moe_echo_e2e_")
    os.makedirs(work, exist_ok=True)
    tok_dir, data = make_assets(os.path.join(work, "assets"))
    env = environment()
    from torchtitan.tools.utils import get_peak_flops

    peak = float(get_peak_flops(env["gpu"]))
    rows = []
    for n in counts:
        rows += measure_configs(at_gpu_count(a, n), [(v, extra.replace("{nproc}", str(n))) for v, extra in variants],
                                tok_dir, data, work, peak)
    add_scaling(rows)
    write(rows, env, peak, a.out, table=a.table)


def gpu_counts(nproc: str) -> list[int]:
    """``--nproc``: one GPU count or several, comma-separated (each ≥ 1, no repeats)."""
    try:
        counts = [int(w) for w in nproc.split(",")]
    except ValueError:
        raise ValueError(f"--nproc {nproc!r}: give GPU counts such as 2 or 1,2,4") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise ValueError(f"--nproc {nproc!r}: give GPU counts such as 2 or 1,2,4 (each at least 1, once)")
    return counts


def at_gpu_count(a, n: int):
    """The arguments of one GPU count: ``nproc`` = n, {nproc} in --ours and --titan replaced by n."""
    out = argparse.Namespace(**vars(a))
    out.nproc, out.ours, out.titan = n, a.ours.replace("{nproc}", str(n)), a.titan.replace("{nproc}", str(n))
    return out


def add_scaling(rows: list[dict]) -> None:
    """Per-GPU scaling of one invocation's rows: a row of 2+ GPUs gets ``scaling`` = its tokens/s per GPU over the
    1-GPU row of the same config, label, run and variant. A variant with no such row (ECHO needs EP > 1; or its
    1-GPU run failed) is measured against the 1-GPU row of the invocation's first variant that has one, named in
    ``scaling_vs``; nothing where no 1-GPU row of that config, label and run succeeded."""
    one, first = {}, {}
    for r in rows:
        if r.get("gpus") == 1 and r.get("tokens_per_s_per_gpu"):
            key = (r["config"], r.get("label", ""), r["run"])
            one[key + (r.get("variant", ""),)] = r["tokens_per_s_per_gpu"]
            first.setdefault(key, r.get("variant", ""))
    for r in rows:
        if r.get("gpus", 1) <= 1 or not r.get("tokens_per_s_per_gpu"):
            continue
        key, variant = (r["config"], r.get("label", ""), r["run"]), r.get("variant", "")
        if key + (variant,) not in one and key in first:
            variant = r["scaling_vs"] = first[key]
        if key + (variant,) in one:
            r["scaling"] = r["tokens_per_s_per_gpu"] / one[key + (variant,)]


def measure_configs(a, variants, tok_dir: str, data: str, work: str, peak: float) -> list[dict]:
    """Every config × run (× variant for ours) at ``a.nproc`` GPUs, ``a.repeats`` times in turn: the rows."""
    rows = []
    for name in a.configs.split(","):
        cfg_path = os.path.join(ROOT, "train_configs", f"{name}.toml")
        with open(cfg_path, "rb") as f:
            cfg = tomllib.load(f)
        group = []
        plan = [(run, v) for run in a.runs.split(",") for v in (variants if run.startswith("ours") else [("", "")])]
        repeats: dict = {}
        for _ in range(a.repeats):  # in turn, so drift over the invocation touches every run alike
            for run, (variant, extra) in plan:
                r = measure(run, a, cfg_path, cfg, tok_dir, data, work, variant, extra)
                repeats.setdefault((run, variant), []).append(r)
                print(f"{name} {run} {variant} repeat {len(repeats[(run, variant)])}/{a.repeats}: "
                      f"{r.get('tokens_per_s_per_gpu') or r.get('error')}", flush=True)
        for run, (variant, extra) in plan:
            r = combine_repeats(repeats[(run, variant)])
            r.update({"config": name, "gpus": a.nproc, "label": a.label.lstrip("_")})
            if a.hosts > 1:
                r["hosts"] = a.hosts
            if run.startswith("ours"):
                r["args"] = f"{a.ours} {source_tree(extra)[1]}".strip()
            if variant:
                r["variant"] = variant
            ran = with_overrides(cfg, a.titan if run.startswith("torchtitan") else f"{a.ours} {source_tree(extra)[1]}")
            fpt, tokens = flops_per_token(ran), ran["training"]["local_batch_size"] * ran["training"]["seq_len"]
            if r.get("tokens_per_s_per_gpu"):
                r["step_ms"] = 1e3 * tokens / r["tokens_per_s_per_gpu"]
                r["mfu_pct"] = 100 * r["tokens_per_s_per_gpu"] * fpt / peak
            group.append(r)
            print(json.dumps(r), flush=True)
        compare(group)
        rows += group
    return rows


def table_stem(out: str, gpu: str, gpus: int, table: str = "") -> str:
    """``<out>/e2e[_<table>]_<N>x<GPU>``: the file of the rows measured on ``gpus`` GPUs of kind ``gpu``."""
    return os.path.join(out, results_stem("e2e" + (f"_{table}" if table else ""), gpu, gpus))


def write(rows: list[dict], env: dict, peak: float, out: str, stamp: bool = True, table: str = "") -> None:
    """Merge ``rows`` into ``<out>/e2e[_<table>]_<N>x<GPU>.json``, one file per GPU count N of the rows (a row
    replaces the one of the same config, gpus, label, run and variant), and rewrite each markdown table.
    ``stamp``: give the rows this invocation's date and torch (rows merged from another invocation's file keep theirs); a
    file's env carries its newest row's date."""
    os.makedirs(out, exist_ok=True)
    key = lambda r: (r["config"], r["gpus"], r.get("label", ""), r["run"], r.get("variant", ""))  # noqa: E731
    fresh = [dict(r, date=env["date"], torch=env["torch"]) if stamp else r for r in rows]
    for gpus in sorted({r["gpus"] for r in fresh}):
        stem = table_stem(out, env["gpu"], gpus, table)
        old = []
        if os.path.exists(stem + ".json"):
            with open(stem + ".json") as f:
                old = json.load(f)["rows"]
        mine = [r for r in fresh if r["gpus"] == gpus]
        new = {key(r) for r in mine}
        merged = [r for r in old if key(r) not in new] + mine
        dates = [r["date"] for r in merged if r.get("date")]
        file_env = {**env, "gpus": gpus, **({"date": max(dates)} if dates else {})}
        with open(stem + ".json", "w") as f:
            json.dump({"env": file_env, "peak_tflops": peak / 1e12, "script": "benchmarks/e2e.py", "rows": merged}, f,
                      indent=1)
        print(render(stem + ".json"), flush=True)
        write_hosts(merged, env, out)


def host_row(r: dict) -> dict:
    """An emulated-hosts row in the step model's terms (benchmarks/step_sim.py calibrate_hosts): dispatcher,
    hosts, GPUs per host, tokens per rank, the flavour's hidden size, top-k and experts, capacity, routing."""
    with open(os.path.join(ROOT, "train_configs", f"{r['config']}.toml"), "rb") as f:
        cfg = with_overrides(tomllib.load(f), r["args"])
    m = model_args_of(cfg)
    me = cfg.get("moe_echo", {})
    hot = int(arg_value(r["args"], "moe_echo.debug_hot_experts", me.get("debug_hot_experts", 0)))
    echo = ("+echo" in r["moe"]) if r.get("moe") else (  # what ran; rows measured without it: the arguments
        arg_value(r["args"], "moe_echo.echo", str(me.get("echo", False))).lower() == "true")
    return {"dispatcher": arg_value(r["args"], "moe_echo.dispatcher", me.get("dispatcher", "auto")),
            "echo": echo, "slots": int(arg_value(r["args"], "moe_echo.echo_slots_per_rank", 2)) if echo else 0,
            "hosts": r["hosts"], "gpus_per_host": r["gpus"] // r["hosts"],
            "tokens_per_rank": cfg["training"]["local_batch_size"] * cfg["training"]["seq_len"],
            "hidden": m.dim, "top_k": m.moe_args.top_k, "experts": m.moe_args.num_experts,
            "capacity_factor": float(arg_value(r["args"], "moe_echo.capacity_factor", me.get("capacity_factor", 1.25))),
            "routing": f"hot{hot}" if hot else "natural",
            "overlap_chunks": int(arg_value(r["args"], "moe_echo.overlap_chunks", me.get("overlap_chunks", 1))),
            "step_ms": r["step_ms"],
            "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "variant": r.get("variant", ""),
            "label": r.get("label", ""), "rank_load": r.get("rank_load"), "replays": r.get("replays"),
            "graph": r.get("graph", ""), "date": r.get("date")}


def write_hosts(rows: list[dict], env: dict, out: str) -> None:
    """The emulated-hosts rows (``--hosts`` > 1, with the arguments they ran with) also as
    ``e2e_hosts_<N>x<GPU>.{json,md}``, in the step model's terms, one file per GPU count."""
    done = [r for r in rows if r.get("hosts", 1) > 1 and r.get("args") is not None and r.get("step_ms")]
    for gpus in sorted({r["gpus"] for r in done}):
        hrows = [host_row(r) for r in done if r["gpus"] == gpus]
        stem = os.path.join(out, results_stem("e2e_hosts", env["gpu"], gpus))
        with open(stem + ".json", "w") as f:
            json.dump({"env": env, "script": "benchmarks/e2e.py --hosts", "rows": hrows}, f, indent=1)
        cols = ["variant", "dispatcher", "echo", "routing", "hosts", "gpus_per_host", "capacity_factor",
                "overlap_chunks", "tokens_per_s_per_gpu", "step_ms", "rank_load", "replays", "graph"]
        with open(stem + ".md", "w") as f:
            f.write(f"e2e on {gpus} {env['gpu']} as emulated hosts (benchmarks/e2e.py --hosts; one torchrun agent "
                    f"per host, each its own NCCL_HOSTID)\n\n{markdown_table([shown(r) for r in hrows], cols)}\n")


def shown(r: dict) -> dict:
    """A row with its throughput and times as table cells (thousands separators, 1 decimal)."""
    fmt = {"tokens_per_s_per_gpu": "{:,.0f}", "step_ms": "{:.1f}", "rank_load": "{:.2f}"}
    return {k: fmt[k].format(v) if k in fmt and isinstance(v, (int, float)) else v for k, v in r.items()}


def render(path: str) -> str:
    """Write the markdown table of an e2e JSON file beside it; returns the table."""
    with open(path) as f:
        d = json.load(f)

    def cell(r, c):
        v = r.get(c, "")
        if v is None:
            return ""
        if c == "tokens_per_s_per_gpu" and v != "":
            return f"{v:,.0f}"
        if c in ("vs_torchtitan_best", "graph_vs_eager", "compile_vs_graph") and v != "":
            return f"{v:.2f}x"
        if c == "scaling" and v != "":
            return f"{100 * v:.1f}%" + (f" (vs {r['scaling_vs'] or 'no variant'})" if "scaling_vs" in r else "")
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    cols = ["config", "gpus", "label", "run", "variant", "tokens_per_s_per_gpu", "step_ms", "mfu_pct", "peak_gib", "vs_torchtitan_best",
            "graph_vs_eager", "compile_vs_graph", "replays", "windows", "repeats", "spread_pct", "rank_load", "graph",
            "error"]
    if any(r.get("scaling") for r in d["rows"]):  # rows of a --nproc 1,2,... invocation
        cols.insert(cols.index("vs_torchtitan_best"), "scaling")
    if any(r.get("moe") for r in d["rows"]):  # rows that say what their MoE layers ran
        cols.insert(cols.index("variant") + 1, "moe")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in d["rows"]]
    gpus = sorted({r.get("gpus") for r in d["rows"] if r.get("gpus")})
    where = f"{'/'.join(map(str, gpus))}× {d['env']['gpu']}" if gpus else d["env"]["gpu"]
    text = (f"End-to-end training throughput on {where} (benchmarks/e2e.py; torch {d['env']['torch']}; "
            f"MFU against {d['peak_tflops']:.0f} TFLOP/s dense bf16; tokens/s per GPU: the median of a run's "
            "``windows`` of 5 steps in its second half, leaving out our windows that replayed an overflowed step and "
            "the window after each)\n\n"
            + "\n".join(lines) + "\n")
    with open(path[: -len(".json")] + ".md", "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
