"""torchtitan 0.2.2's own trainer (``torchtitan.train``) on CPU, for tests.

torchtitan picks its device type when ``torchtitan.tools.utils`` is imported and falls back to
"cuda" when there is no accelerator. This launcher points it at the CPU (gloo process groups, a
stand-in for the memory-statistics calls of ``torch.cuda``) before the trainer is imported, then
runs ``torchtitan.train.main`` unchanged. On a GPU machine use ``python -m torchtitan.train``.

    torchrun --nproc_per_node 2 tests/torchtitan_cpu_main.py --job.config_file ... [torchtitan args]
"""

import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
import torchtitan.tools.utils as tt_utils  # noqa: E402

cpu_module = types.SimpleNamespace(
    set_device=lambda device: None,
    current_device=lambda: 0,
    device_count=lambda: 1,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 40),
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
    memory_stats=lambda device=None: {},
    synchronize=lambda device=None: None,
    is_available=lambda: True,
)
tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
for name in ("torchtitan.distributed.utils", "torchtitan.distributed.parallel_dims", "torchtitan.components.metrics",
             "torchtitan.tools.profiling"):
    if name in sys.modules:  # already imported with the CUDA default: repoint
        for attr, value in (("device_type", "cpu"), ("device_module", cpu_module)):
            if hasattr(sys.modules[name], attr):
                setattr(sys.modules[name], attr, value)

from torchtitan.train import Trainer, main  # noqa: E402

if __name__ == "__main__":
    assert not torch.cuda.is_available(), "on a GPU machine run python -m torchtitan.train"
    main(Trainer)
