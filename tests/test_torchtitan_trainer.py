"""torchtitan 0.2.2's own trainer running our expert parallelism (components/train/torchtitan_spec.py).

The slow test trains deepseek_v3/tiny for 6 steps on 2 CPU ranks (gloo) at EP = 2 with ECHO and the
alltoall dispatcher, once with torchtitan's trainer + our TrainSpec and once with recipes/pretrain.py,
same config, seed, data and schedule, and requires the same per-step losses.
"""

import glob
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from run_env import run_env

from components.errors import UserError
from components.moe_echo.config import MoEEchoConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
SMALL = ["--training.max_corpus_mb", "1", "--training.seq_len", "64", "--training.local_batch_size", "8"]
COMMON = [*SMALL, "--training.steps", "6", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
          "--parallelism.expert_parallel_degree", "2", "--moe_echo.dispatcher", "alltoall", "--debug.seed", "0"]
# torchtitan's CLI (tyro) spells booleans as flags, and a boolean-or-"auto" key as True / False / auto
TITAN = ["--job.custom_config_module", "components.train.job_config",
         "--experimental.custom_import", "components.train.torchtitan_spec",
         "--model.name", "moe_echo_deepseek_v3", "--checkpoint.no-enable", "--metrics.disable_color_printing",
         "--moe_echo.echo", "True"]
OURS = ["--checkpoint.enable", "false", "--moe_echo.echo", "true"]
TOLERANCE = 1e-5  # absolute, per step; observed: fp32 losses equal to 1 ulp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchtitan's trainer on CPU/gloo now and then aborts one rank while the process exits, after every
# step ran and was logged (seen once in several CI runs: all 6 losses in its TensorBoard file, then
# "terminate called without an active exception" on rank 1). Tolerated for its run only; the losses
# checked below must still all be there.
TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun(script: str, dump: str, args: list[str], teardown_abort_ok: bool = False) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           script, "--job.config_file", CONFIG, "--job.dump_folder", dump, *COMMON, *args]
    env = run_env(args, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    out = p.stdout + p.stderr
    ok = p.returncode == 0 or (teardown_abort_ok and TEARDOWN_ABORT in out and "Traceback (most recent call last)"
                               not in out.split(TEARDOWN_ABORT)[0])
    assert ok, f"exit {p.returncode}: {' '.join(cmd)}\n{out[-4000:]}"
    return out


def _titan_losses(dump: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = glob.glob(os.path.join(dump, "tb", "*"))  # torchtitan writes tb/<timestamp>/
    ea = EventAccumulator(run)
    ea.Reload()
    return [e.value for e in sorted(ea.Scalars("loss_metrics/global_avg_loss"), key=lambda e: e.step)]


def _our_losses(dump: str) -> list[float]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [r["loss"] for r in sorted(map(json.loads, f), key=lambda r: r["step"])]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) check; GPUs: benchmarks/gpu suite 'titan'")
def test_torchtitan_trainer_runs_our_ep_and_matches_the_recipe(tmp_path):
    titan_out = _torchrun(os.path.join(ROOT, "tests", "torchtitan_cpu_main.py"), str(tmp_path / "titan"), TITAN,
                          teardown_abort_ok=True)
    # our parallelize_fn ran: our dispatcher, ECHO, experts EP-sharded (8 experts, 4 per rank)
    line = next((l for l in titan_out.splitlines() if l.startswith("moe_echo parallelize_fn:")), None)
    assert line is not None, titan_out[-3000:]
    assert "dispatcher AllToAllDispatcher" in line and "ep 2" in line and "echo on" in line, line
    assert "experts 8" in line and "local expert rows 4" in line and "'ep'" in line, line

    _torchrun(os.path.join(ROOT, "recipes", "pretrain.py"), str(tmp_path / "ours"), OURS)
    titan, ours = _titan_losses(str(tmp_path / "titan")), _our_losses(str(tmp_path / "ours"))
    assert len(titan) == len(ours) == 6, (titan, ours)
    table = "\n".join(f"{i} {a:.7f} {b:.7f}" for i, (a, b) in enumerate(zip(titan, ours), 1))
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(titan, ours)), f"step torchtitan ours\n{table}"
    assert ours[-1] < ours[0] - 1.0  # it trained


def test_dispatcher_choice_is_dropless():
    from components.train.torchtitan_spec import _check_dispatcher

    cfg = MoEEchoConfig(dispatcher="auto")
    _check_dispatcher(cfg, ep=2)
    assert cfg.dispatcher == "alltoall"
    for name in ("padded", "nvlink", "fastest"):
        with pytest.raises(UserError, match="recipes/pretrain.py"):
            _check_dispatcher(MoEEchoConfig(dispatcher=name), ep=2)
    cfg = MoEEchoConfig(dispatcher="auto")
    _check_dispatcher(cfg, ep=1)
    assert cfg.dispatcher == "auto"  # EP = 1: the local backend, nothing to drop


def test_data_loader_yields_the_recipes_batches():
    from torchtitan.components.dataloader import BaseDataLoader

    from components.train.config import load_config
    from components.train.data import TokenBatchLoader, build_token_stream
    from components.train.tokenizer import build_tokenizer
    from components.train.torchtitan_spec import register_train_specs
    from torchtitan.protocols.train_spec import get_train_spec

    register_train_specs()
    cfg = load_config(["--job.config_file", CONFIG, *SMALL])
    spec = get_train_spec("moe_echo_deepseek_v3")
    tok = spec.build_tokenizer_fn(cfg)
    loader = spec.build_dataloader_fn(dp_world_size=2, dp_rank=1, tokenizer=tok, job_config=cfg)
    assert isinstance(loader, BaseDataLoader)
    t = cfg.training
    tokens = build_token_stream(t.dataset, t.dataset_path, build_tokenizer("bytes"), max_bytes=t.max_corpus_mb * 10**6)
    ref = TokenBatchLoader(tokens, t.local_batch_size, t.seq_len, rank=1, world_size=2, seed=t.seed)
    it = iter(loader)
    for _ in range(3):
        input_dict, labels = next(it)
        inputs_ref, labels_ref = ref.next_batch()
        assert torch.equal(input_dict["input"], inputs_ref) and torch.equal(labels, labels_ref)
    assert loader.state_dict() == ref.state_dict()


def test_model_size_keys_are_refused_by_torchtitans_trainer():
    """torchtitan's trainer builds the flavour as registered: a [model] size key is a one-line error there,
    not silently ignored."""
    from types import SimpleNamespace

    import pytest

    from components.errors import UserError
    from components.moe_echo.config import MoEEchoConfig
    from components.train.torchtitan_spec import parallelize_fn

    par = SimpleNamespace(tensor_parallel_degree=1, context_parallel_degree=1, pipeline_parallel_degree=1,
                          expert_tensor_parallel_degree=1)
    job = SimpleNamespace(parallelism=par, moe_echo=MoEEchoConfig(), model=SimpleNamespace(n_layers=3))
    with pytest.raises(UserError, match=r"\[model\] n_layers = 3: torchtitan's trainer"):
        parallelize_fn(None, None, job)
