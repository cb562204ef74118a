"""Pretrain with the FP8 output head's GEMMs chosen one by one: which of them moves the loss.

    torchrun --nproc_per_node 1 benchmarks/fp8_head_gemms.py --head-fp8 grad_input,grad_weight \\
        --job.config_file train_configs/v2lite_1b_gpu.toml --model.converters float8 \\
        --quantize.linear.float8.filter_fqns router.gate ...

``--head-fp8`` names the head's GEMMs that run in FP8 (``output``: the logits, ``grad_input``: the gradient into
the network, ``grad_weight``: the head's weight gradient); the others run in bf16 on unquantised operands
(``Fp8Head.fp8_gemms``). The rest of the command line is ``recipes/pretrain.py``'s. It applies where the head is
converted (``filter_fqns`` not naming "output", tensorwise). ``benchmarks/gpu/run.sh fp8_step PART=k`` runs the
variants side by side and compares their losses with ``benchmarks/loss_match.py``.
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from components.train.fp8_head import GEMMS, Fp8Head  # noqa: E402


def parse_gemms(text: str) -> tuple[str, ...]:
    """"output,grad_weight" -> the named GEMMs in GEMMS's order; "" or "none" -> none; a one-line error otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in GEMMS]
    if unknown:
        raise SystemExit(f"error: --head-fp8 {text!r}: {unknown[0]!r} is not one of the head's GEMMs "
                         f"({', '.join(GEMMS)}); name those to run in FP8, comma-separated")
    return tuple(g for g in GEMMS if g in names)


def main(argv: list[str]) -> None:
    if "--head-fp8" not in argv or argv.index("--head-fp8") + 1 >= len(argv):
        raise SystemExit("error: --head-fp8 GEMMS is missing: name the output head's GEMMs to run in FP8 "
                         f"({', '.join(GEMMS)}), comma-separated")
    i = argv.index("--head-fp8")
    Fp8Head.fp8_gemms = parse_gemms(argv[i + 1])
    sys.argv = [os.path.join(ROOT, "recipes", "pretrain.py"), *argv[:i], *argv[i + 2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
