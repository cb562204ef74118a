"""[model] converters = ["float8"]: torchao's FP8 linear layers (emulated on CPU), the keys it reads, and one-line
errors where it cannot run."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from components.errors import UserError
from components.train import float8
from components.train.config import load_config
from conftest import ROOT
from run_env import run_env

pytest.importorskip("torchao.float8")

EMULATED = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]


def test_config_keys_are_read_and_the_others_refused():
    cfg = load_config([*EMULATED, "--quantize.linear.float8.recipe_name", "rowwise",
                       "--quantize.linear.float8.filter_fqns", "output,attention.wo"])
    assert float8.requested(cfg) and cfg.quantize.linear.float8.filter_fqns == ["output", "attention.wo"]
    assert not float8.requested(load_config([]))
    # the routed experts follow the switch unless their key is set (or FP8 is emulated: they have no emulation)
    assert load_config(["--model.converters", "float8"]).moe_echo.expert_precision == "fp8"
    assert load_config(["--model.converters", "float8", "--moe_echo.expert_precision", "bf16"]
                       ).moe_echo.expert_precision == "bf16"
    assert cfg.moe_echo.expert_precision == "bf16" and load_config([]).moe_echo.expert_precision == "bf16"
    with pytest.raises(UserError, match=r"not supported by this recipe: \[quantize.grouped_mm.float8\] "
                                        r"fqns = \['experts'\]"):
        load_config([*EMULATED, "--quantize.grouped_mm.float8.fqns", "experts"])
    with pytest.raises(UserError, match=r"'mx' is not applied by this recipe; the one it applies is \"float8\""):
        float8.requested(load_config(["--model.converters", "mx"]))


def test_where_it_cannot_run_is_one_line(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(UserError, match=r"needs a CUDA GPU of compute capability 8.9 or newer \(this run is on cpu\); "
                                        r"remove it, or set \[quantize.linear.float8\] emulate = true"):
        float8.check_float8(load_config(["--model.converters", "float8"]), cpu)
    with pytest.raises(UserError, match=r"emulate = true does not work with torch.compile"):
        float8.check_float8(load_config([*EMULATED, "--compile.enable"]), cpu)
    float8.check_float8(load_config(EMULATED), cpu)
    assert "set [compile] enable = true" in float8.uncompiled_note(load_config(["--model.converters", "float8"]))
    assert float8.uncompiled_note(load_config(["--model.converters", "float8", "--compile.enable"])) is None
    assert float8.uncompiled_note(load_config(EMULATED)) is None
    # the converter turns the experts to FP8 too: on CPU its own error comes first, then the experts' if kept
    from components.train.setup import check_device
    with pytest.raises(UserError, match=r'^\[model\] converters = \["float8"\] needs a CUDA GPU'):
        check_device(load_config(["--model.converters", "float8"]), cpu)
    with pytest.raises(UserError, match=r'^\[moe_echo\] expert_precision = "fp8" needs a CUDA GPU'):
        check_device(load_config([*EMULATED, "--moe_echo.expert_precision", "fp8"]), cpu)
    check_device(load_config(EMULATED), cpu)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UserError, match=r'needs torchao: pip install "moe-echo\[float8\]"'):
        float8.check_float8(load_config(EMULATED), cpu)


def test_dense_linears_go_fp8_the_head_and_router_gates_stay():
    from torchao.float8.float8_linear import Float8Linear

    from components.moe_echo.models import build_model

    cfg = load_config(EMULATED)
    # 16 experts: the router gates' dimensions are multiples of 16 too, so only the rule keeps them
    model = build_model("deepseek_v3", "tiny", cfg.moe_echo, seq_len=32, device=torch.device("cpu"), seed=0,
                        overrides={"num_experts": 16})
    ref = copy.deepcopy(model)
    swapped = float8.convert_float8(model, cfg)
    kinds = {fqn: type(m) for fqn, m in model.named_modules()}
    assert swapped and all(kinds[f] is Float8Linear for f in swapped)
    assert kinds["output"] is torch.nn.Linear and float8.head_note(swapped, model.output) is None
    assert any(f.endswith("attention.wo") for f in swapped) and any("shared_experts" in f for f in swapped)
    gates = [f for f in kinds if f.endswith("router.gate")]
    assert gates and all(kinds[f] is torch.nn.Linear for f in gates)
    # same parameters and names (checkpoints load either way)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out, want = model(tokens), ref(tokens)
    rel = ((out - want).norm() / want.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # quantised (not the same numbers), close to the unconverted model
    out.float().square().mean().backward()
    assert all(model.get_submodule(f).weight.grad is not None for f in swapped)
    # filter_fqns naming only the gates converts the head too, and the run is told what that cost in loss
    head_cfg = load_config([*EMULATED, "--quantize.linear.float8.filter_fqns", "router.gate"])
    head_model = copy.deepcopy(ref)
    head_swapped = float8.convert_float8(head_model, head_cfg)
    assert "output" in head_swapped and type(head_model.output) is Float8Linear  # emulated: torchao's head
    assert 'keep it in bf16 with "output" in [quantize.linear.float8] filter_fqns' in float8.head_note(
        head_swapped, head_model.output)


def test_recipe_trains_with_emulated_float8(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "pretrain.py"), "--job.config_file",
           os.path.join(ROOT, "train_configs", "debug_cpu.toml"), "--job.dump_folder", str(tmp_path),
           "--training.max_corpus_mb", "1", "--training.seq_len", "64", "--training.local_batch_size", "4",
           "--training.steps", "3", "--metrics.log_freq", "1", "--checkpoint.enable", "false", *EMULATED]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=run_env(cmd, OMP_NUM_THREADS="2"))
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith("float8:"))
    assert "linear layers in FP8 (tensorwise, emulated); kept: router gates, output" in line, line
    assert "loss" in p.stdout


def test_recipe_trains_with_the_dense_layers_on_the_fp8_experts_kernels(tmp_path):
    """Emulated on CPU, the recipe end to end with the dense feed-forwards and the attention projections on the FP8
    experts' kernels (two processes, experts split): the run says so, and its loss over a few steps stays within
    FP8's error of the same run in bf16."""
    def run(name, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "recipes", "pretrain.py"), "--job.config_file",
               os.path.join(ROOT, "train_configs", "debug_cpu.toml"), "--job.dump_folder", str(tmp_path / name),
               "--training.max_corpus_mb", "1", "--training.seq_len", "64", "--training.local_batch_size", "4",
               "--training.steps", "4", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
               "--parallelism.expert_parallel_degree", "2", *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=run_env(cmd, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        with open(tmp_path / name / "metrics.jsonl") as f:
            losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
        return p.stdout, losses

    out, fp8 = run("fp8", *EMULATED, "--moe_echo.dense_ffn_kernels", "experts", "--moe_echo.dense_linear_kernels",
                   "experts")
    assert "dense feed-forwards (shared experts, dense layers) through the FP8 experts' kernels" in out, out[-2000:]
    assert "linear layers (attention projections) through the FP8 experts' kernels (Fp8RowsLinear)" in out
    _, bf16 = run("bf16")
    assert len(fp8) == len(bf16) == 4
    assert all(abs(a - b) < 0.03 * b for a, b in zip(fp8, bf16)), (fp8, bf16)


def test_fp8_all_gather_keys_need_tensorwise_and_each_other():
    with pytest.raises(UserError, match=r"enable_fsdp_float8_all_gather = true needs recipe_name = \"tensorwise\""):
        load_config([*EMULATED, "--quantize.linear.float8.recipe_name", "rowwise",
                     "--quantize.linear.float8.enable_fsdp_float8_all_gather"])
    with pytest.raises(UserError, match=r"precompute_float8_dynamic_scale_for_fsdp = true needs "
                                        r"enable_fsdp_float8_all_gather = true"):
        load_config([*EMULATED, "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"])
    cfg = load_config([*EMULATED, "--quantize.linear.float8.enable_fsdp_float8_all_gather"])
    assert float8.fp8_all_gather(cfg, fsdp=True) and not float8.fp8_all_gather(cfg, fsdp=False)
    assert float8.torchao_config(cfg, fsdp=True).enable_fsdp_float8_all_gather
    assert not float8.torchao_config(cfg, fsdp=False).enable_fsdp_float8_all_gather


def test_precomputed_fsdp_scales_are_written_in_place():
    """One FSDP rank (gloo): the scales precomputed for the FP8 all-gather are 448 / amax of each weight, and a
    second precompute writes the new values into the first one's tensors (what a captured step reads on replay)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.float8_linear import Float8Linear

    from components.moe_echo.models import build_model
    from emulated_hosts import free_port

    cfg = load_config([*EMULATED, "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                       "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"])
    model = build_model("deepseek_v3", "tiny", cfg.moe_echo, seq_len=32, device=torch.device("cpu"), seed=0,
                        overrides={"num_experts": 16})
    swapped = float8.convert_float8(model, cfg, fsdp=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert float8.precompute_scales_(model) == len(swapped)
        linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
        first = [m.weight._local_tensor._precomputed_scale for m in linears]
        with torch.no_grad():
            for i, m in enumerate(linears):
                m.weight.mul_(1.0 + i)
        float8.precompute_scales_(model)
        for m, s in zip(linears, first):
            now = m.weight._local_tensor._precomputed_scale
            assert now is s
            want = torch.finfo(torch.float8_e4m3fn).max / m.weight.to_local().detach().float().abs().max()
            torch.testing.assert_close(now, want.reshape(now.shape), rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()


def _small(recipe: str, n_in: int, n_out: int) -> bool:
    """torchao's documented size thresholds below which FP8 does not pay (H100 measurements), written out here."""
    if recipe == "tensorwise":
        return n_in <= 4096 and n_out <= 1024
    return n_out <= 2048 or n_in <= 1024 or (n_out <= 4096 and n_in <= 2048)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_filter_keeps_the_layers_too_small_for_fp8_to_pay(recipe):
    """torchtitan's flag ``filter_fqns = ["auto_filter_small_kn"]``: the layers torchao's thresholds rule out stay
    bf16 beside those named, the others convert; without "output" in the list the head converts too."""
    from torchao.float8.float8_linear import Float8Linear

    shapes = {"attention.wkv_a": (2048, 576), "attention.wkv_b": (512, 4096), "attention.wq": (2048, 3072),
              "attention.wo": (2048, 2048), "feed_forward.w1": (2048, 10944), "feed_forward.w2": (10944, 2048),
              "shared.w1": (2048, 1536), "router.gate": (2048, 8192), "output": (2048, 32768)}
    for names, head_kept in ((["output", "auto_filter_small_kn"], True), (["auto_filter_small_kn"], False)):
        with torch.device("meta"):
            model = torch.nn.Module()
            for fqn, (i, o) in shapes.items():
                parent = model
                for part in fqn.split(".")[:-1]:
                    if not hasattr(parent, part):
                        parent.add_module(part, torch.nn.Module())
                    parent = getattr(parent, part)
                parent.add_module(fqn.split(".")[-1], torch.nn.Linear(i, o, bias=False))
        cfg = load_config([*EMULATED, "--quantize.linear.float8.recipe_name", recipe,
                           "--quantize.linear.float8.filter_fqns", ",".join(names)])
        swapped = float8.convert_float8(model, cfg)
        want = sorted(f for f, (i, o) in shapes.items()
                      if f != "router.gate" and not (f == "output" and head_kept) and not _small(recipe, i, o))
        assert sorted(swapped) == want, (recipe, names)
        assert all(isinstance(model.get_submodule(f), Float8Linear) == (f in want) for f in shapes)
        assert float8.kept_names(cfg.quantize.linear.float8)[-1] == "layers too small to pay (auto_filter_small_kn)"
    assert "attention.wkv_a" not in want and "feed_forward.w1" in want  # each rule both keeps and converts here
    with pytest.raises(UserError, match=r'filter_fqns = \["auto_filter_small_kn"\] has size thresholds for '
                                        r'recipe_name "tensorwise" and "rowwise" only'):
        load_config([*EMULATED, "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp",
                     "--quantize.linear.float8.filter_fqns", "auto_filter_small_kn"])


def test_auto_filter_without_torchao_thresholds_is_one_line(monkeypatch):
    import torchao.float8

    monkeypatch.delattr(torchao.float8, "_auto_filter_for_recipe")
    cfg = load_config([*EMULATED, "--quantize.linear.float8.filter_fqns", "output,auto_filter_small_kn"])
    with pytest.raises(UserError, match=r"needs a torchao with its size thresholds") as err:
        float8.keep_rule(cfg.quantize.linear.float8)
    assert "\n" not in str(err.value)


def test_dense_ffns_through_the_fp8_experts_kernels():
    """``[moe_echo] dense_ffn_kernels = "experts"``: the shared experts and the dense layer's feed-forward keep
    their linear layers (same names), run the FP8 experts' kernels (emulated off CUDA) uncompiled, within FP8's error
    of fp64 with one row 1000x the others and a zero row, and their weights get gradients; the other dense layers go
    to torchao as before. The key without float8 is a one-line error."""
    from torchao.float8.float8_linear import Float8Linear

    from components.moe_echo.models import build_model

    cfg = load_config(["--model.converters", "float8", "--moe_echo.dense_ffn_kernels", "experts",
                       "--moe_echo.expert_precision", "bf16"])
    model = build_model("deepseek_v3", "tiny", cfg.moe_echo, seq_len=32, device=torch.device("cpu"), seed=0)
    ref = copy.deepcopy(model)
    swapped = float8.convert_float8(model, cfg)
    ffns = float8.dense_ffns(model)
    assert any(f.endswith("moe.shared_experts") for f in ffns) and any(f.endswith("feed_forward") for f in ffns)
    assert not any(s.startswith(f + ".") for s in swapped for f in ffns)
    assert any(s.endswith("attention.wo") for s in swapped)
    assert all(type(model.get_submodule(s)) is Float8Linear for s in swapped)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for fqn in ffns:
        ffn, want_ffn = model.get_submodule(fqn), ref.get_submodule(fqn).double()
        assert ffn.eager_only and all(type(getattr(ffn, w)) is torch.nn.Linear for w in ("w1", "w2", "w3"))
        ffn.bfloat16()
        x = torch.randn(2, 24, 128, generator=torch.Generator().manual_seed(1))
        x[0, 3] *= 1000
        x[1, 5] = 0
        dy = torch.randn(2, 24, 128, generator=torch.Generator().manual_seed(2))
        xb = x.bfloat16().requires_grad_()
        y = ffn(xb)
        y.backward(dy.bfloat16())
        x64 = xb.detach().double().requires_grad_()
        want = want_ffn(x64)
        want.backward(dy.double())
        assert y.shape == x.shape and y.dtype == torch.bfloat16 and not y[1, 5].any()
        for got, exact in ((y, want), (xb.grad, x64.grad), *((getattr(ffn, w).weight.grad, getattr(want_ffn, w)
                                                              .weight.grad) for w in ("w1", "w2", "w3"))):
            for r in range(2):  # each sequence alone: the 1000x row would hide the other's error in one norm
                g, e = (got[r], exact[r]) if got.dim() == 3 else (got, exact)
                assert float((g.detach().double() - e).norm() / e.norm()) < 0.12, fqn
    _experts_key_refused("dense_ffn_kernels", "feed-forwards")


def _experts_key_refused(key: str, layers: str) -> None:
    """``[moe_echo] <key> = "experts"`` is one line naming the fix without float8, and with emulate on a GPU."""
    with pytest.raises(UserError, match=rf'{key} = "experts" chooses how FP8 runs the dense {layers} and needs '
                                        r'\[model\] converters = \["float8"\]; set both'):
        load_config([f"--moe_echo.{key}", "experts"])
    with pytest.raises(UserError, match=rf'{key} = "experts" runs the FP8 experts\' kernels, emulated on CPU only; '
                                        r'on a GPU set \[quantize.linear.float8\] emulate = false'):
        float8.check_float8(load_config([*EMULATED, f"--moe_echo.{key}", "experts"]), torch.device("cuda"))


@pytest.mark.parametrize("ffn_kernels", ["torchao", "experts"])
def test_dense_linears_through_the_fp8_experts_kernels(ffn_kernels):
    """``[moe_echo] dense_linear_kernels = "experts"``: the attention projections become ``Fp8RowsLinear`` (same
    names and parameters), left out of torchao's conversion; the feed-forwards follow ``dense_ffn_kernels`` and the
    router gates and the head stay bf16; each converted projection runs within FP8's error of fp64 (emulated off
    CUDA). The key without float8 and with emulate is a one-line error."""
    from torchao.float8.float8_linear import Float8Linear

    from components.moe_echo.models import build_model
    from components.train.fp8_linear import Fp8RowsLinear

    cfg = load_config(["--model.converters", "float8", "--moe_echo.dense_linear_kernels", "experts",
                       "--moe_echo.dense_ffn_kernels", ffn_kernels, "--moe_echo.expert_precision", "bf16"])
    model = build_model("deepseek_v3", "tiny", cfg.moe_echo, seq_len=32, device=torch.device("cpu"), seed=0)
    ref = copy.deepcopy(model)
    swapped = float8.convert_float8(model, cfg)
    rows = float8.rows_linears(model)
    assert rows and all(".attention." in r for r in rows)
    assert {r.rsplit(".", 1)[1] for r in rows} == {"wq", "wkv_a", "wkv_b", "wo"}
    assert not set(rows) & set(swapped) and type(model.output) is torch.nn.Linear
    in_ffn = [s for s in swapped if any(f in s for f in float8.FFN_NAMES)]
    assert bool(in_ffn) == (ffn_kernels == "torchao")  # the feed-forwards: torchao's, or the experts' kernels
    assert all(type(model.get_submodule(s)) is Float8Linear for s in swapped)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    g = torch.Generator().manual_seed(3)
    for fqn in rows:
        lin, want_lin = model.get_submodule(fqn), ref.get_submodule(fqn).double()
        assert type(lin) is Fp8RowsLinear
        x = torch.randn(2, 24, lin.in_features, generator=g).bfloat16().requires_grad_()
        y = lin(x)
        y.float().sum().backward()
        x64 = x.detach().double().requires_grad_()
        want = want_lin(x64)
        want.sum().backward()
        for got, exact in ((y, want), (x.grad, x64.grad), (lin.weight.grad, want_lin.weight.grad)):
            assert float((got.detach().double() - exact).norm() / exact.norm()) < 0.08, fqn
    _experts_key_refused("dense_linear_kernels", "linear layers")
