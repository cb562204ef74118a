"""A position's logits depend on no later token. Every path a token takes (attention, router, dropless
dispatch, grouped experts in bf16 or FP8, combine) computes each row from its own row and the earlier ones,
so replacing the second half of each sequence leaves the first half's logits equal to the bit, with every
FP8 scale per row (the experts' FP8 GEMMs; torchao's rowwise dense layers and output head). A leak (a GEMM
tile storing rows of another expert or token, a buffer or scale shared across rows) moves them.
torchao's tensorwise scaling is left out: its one amax over the whole batch makes every position's rounding
depend on every token, by design."""

import pytest
import torch

from components.moe_echo.models import build_model
from components.train import float8
from components.train.config import load_config
from conftest import ROOT

S = 128  # tokens per sequence; the second half is replaced


def _model(config: str, device: str, *args):
    cfg = load_config(["--job.config_file", f"{ROOT}/train_configs/{config}", *args])
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.moe_echo, seq_len=S, device=device, seed=0)
    if float8.requested(cfg):
        float8.convert_float8(model, cfg)
    return model.eval(), model.model_args.vocab_size


def _first_and_second_half_change(model, vocab: int, device: str) -> tuple[float, float]:
    """Largest |Δ logit| over the first half and over the second half when the second half's tokens change."""
    g = torch.Generator().manual_seed(0)
    x_BS = torch.randint(0, vocab, (2, S), generator=g)
    y_BS = x_BS.clone()
    y_BS[:, S // 2:] = torch.randint(0, vocab, (2, S // 2), generator=g)
    with torch.no_grad():
        a_BSV, b_BSV = (model(t.to(device)).float() for t in (x_BS, y_BS))
    d_BSV = (a_BSV - b_BSV).abs()
    return d_BSV[:, :S // 2].max().item(), d_BSV[:, S // 2:].max().item()


def test_logits_do_not_depend_on_later_tokens_cpu():
    model, vocab = _model("debug_cpu.toml", "cpu")
    first, second = _first_and_second_half_change(model, vocab, "cpu")
    assert second > 1e-2, second  # the change reached the logits at all
    assert first <= 1e-5 * second, (first, second)  # fp32: at most a different summation order


GPU_CASES = {
    "bf16": [],
    "fp8_experts": ["--moe_echo.expert_precision", "fp8"],
    "fp8_experts_rowwise_dense": ["--moe_echo.expert_precision", "fp8", "--model.converters", "float8",
                                  "--quantize.linear.float8.recipe_name", "rowwise"],
    "fp8_experts_rowwise_dense_and_head": ["--moe_echo.expert_precision", "fp8", "--model.converters", "float8",
                                           "--quantize.linear.float8.recipe_name", "rowwise",
                                           "--quantize.linear.float8.filter_fqns", "router.gate"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_logits_do_not_depend_on_later_tokens_gpu(case):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU (FP8 experts)")
    model, vocab = _model("debug_gpu.toml", "cuda", *GPU_CASES[case])
    model.to(torch.bfloat16)
    first, second = _first_and_second_half_change(model, vocab, "cuda")
    print(f"{case}: max |change| first half {first:.3g}, second half {second:.3g}")
    assert second > 1e-1, second
    assert first == 0.0, (first, second)
