"""``[compile]``: the dense submodules of each block, the final norm and the output head are compiled
in place (FQNs, state_dict and DCP checkpoints unchanged), the routed MoE path stays eager, the compiled
model computes the eager model's loss and gradients (under activation checkpointing), and "loss" compiles the recipe's
cross-entropy. Compiles use the aot_eager backend: inductor on a 2-core CPU takes minutes."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from components.moe_echo.layer import MoELayer
from components.moe_echo.models import build_model, moe_layers
from components.parallel.compile import is_compiled
from components.parallel.mesh import ParallelDims
from components.parallel.parallelize import parallelize
from components.train import checkpoint
from components.train.config import load_config
from components.train.loss import build_loss, lm_loss
from conftest import ROOT

CONFIG = f"{ROOT}/train_configs/debug_cpu.toml"
COMPILE = ["--compile.enable", "true", "--compile.backend", "aot_eager"]


def _model(*args, seed=0):
    cfg = load_config(["--job.config_file", CONFIG, "--training.seq_len", "32", *args])
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.moe_echo, seq_len=32, seed=seed)
    return parallelize(model, None, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu")), cfg


def _unwrapped(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


@pytest.mark.parametrize("model_args", [
    ("--activation_checkpoint.mode", "full"),  # deepseek_v3 tiny: 1 dense block + 3 MoE blocks with a shared expert
    ("--model.name", "qwen3", "--model.flavor", "tiny_moe"),  # MoE blocks, no shared experts
], ids=["deepseek_v3_ac", "qwen3"])
def test_dense_submodules_are_compiled_and_the_routed_moe_is_not(model_args):
    model, _ = _model(*model_args, *COMPILE)
    eager, _ = _model(*model_args)
    compiled = {_unwrapped(n) for n, m in model.named_modules() if is_compiled(m)}
    want = {"norm", "output"}
    for name, block in eager.layers.items():
        want |= {f"layers.{name}.{c}" for c in ("attention", "attention_norm", "ffn_norm")}
        moe = getattr(block, "moe", None) if block.moe_enabled else None
        if moe is None:
            want.add(f"layers.{name}.feed_forward")
        elif moe.shared_experts is not None:
            want.add(f"layers.{name}.moe.shared_experts")
    assert compiled == want
    assert moe_layers(model)
    for _, moe in moe_layers(model):
        assert isinstance(moe, MoELayer)
        assert moe.forward.__func__ is MoELayer.forward and moe._compiled_call_impl is None
        for sub_name, sub in moe.named_modules():  # router, experts, dispatcher: eager
            if not sub_name.startswith("shared_experts"):
                assert not is_compiled(sub) and sub._compiled_call_impl is None, sub_name
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())
    assert list(model.state_dict()) == list(eager.state_dict())
    assert list(get_model_state_dict(model)) == list(get_model_state_dict(eager))  # what DCP saves


class _ModelState:
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        set_model_state_dict(self.model, sd)


def test_compiled_model_matches_eager_and_checkpoints_load_across_compile(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if torch.cuda.is_available():  # compiling may initialise CUDA, which a checkpointed forward refuses to do
        torch.cuda.init()
    compiled, cfg = _model("--activation_checkpoint.mode", "full", *COMPILE)
    eager, cfg0 = _model()
    x_BS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    y_BS = torch.roll(x_BS, -1, dims=1)
    losses = []
    for model, c in ((compiled, cfg), (eager, cfg0)):
        loss = build_loss(c.compile, torch.device("cpu"))(model(x_BS), y_BS)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    # attention, norm, dense FFN, shared experts, final norm, head, loss: really compiled, each one graph, no breaks
    assert counters["stats"]["unique_graphs"] >= 7 and not counters["graph_break"]

    path = checkpoint.save(str(tmp_path), 1, {"model": _ModelState(compiled)})
    fresh, _ = _model(seed=1)  # eager, other weights
    checkpoint.load(path, {"model": _ModelState(fresh)})
    for (name, p), q in zip(compiled.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), name


def test_loss_component_compiles_the_cross_entropy():
    on = load_config(["--job.config_file", CONFIG, *COMPILE]).compile  # torchtitan's default: model and loss
    assert on.components == ["model", "loss"]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert hasattr(build_loss(on, cpu), "_torchdynamo_orig_callable")
    assert build_loss(on, cuda) is lm_loss  # the fused kernels: nothing for compile to fuse
    on.components = ["model"]
    assert build_loss(on, cpu) is lm_loss
    off = load_config(["--job.config_file", CONFIG]).compile
    assert build_loss(off, cpu) is lm_loss
