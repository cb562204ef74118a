"""Import this module to register moe-echo TrainSpecs with torchtitan's own trainer:

    python -m torchtitan.train --experimental.custom_import components.moe_echo.torchtitan_spec \\
        --model.name moe_echo_deepseek_v3 --model.flavor tiny ...
"""

from .models import register_train_specs

TRAIN_SPECS = register_train_specs()
