"""torchtitan 0.2.2's own trainer (``torchtitan.train``) with moe-echo's extra flavours registered
(e.g. ``v2lite_1b``), so the same model can be trained by both for a throughput comparison.

    torchrun --nproc_per_node N benchmarks/torchtitan_main.py --job.config_file titan.toml
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan.models import deepseek_v3, qwen3  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402

from components.moe_echo.models import FLAVORS  # noqa: E402

for module, table, name in ((deepseek_v3, "deepseekv3_args", "deepseek_v3"), (qwen3, "qwen3_args", "qwen3")):
    getattr(module, table).update({k: v for k, v in FLAVORS[name].items() if k not in getattr(module, table)})

if __name__ == "__main__":
    main(Trainer)
