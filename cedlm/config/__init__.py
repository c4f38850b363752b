"""Model configuration, the bottom layer of cedlm: it imports nothing from the model, and importing
it does not import torch (validation reads the KV formats' scale blocks from `cedlm.quant` when a
config is checked).

    schema.py        ModelConfig (the official deepseek_v41 config.json schema, derived layer
                     roles, JSON reading/writing that round-trips the official file), CONFIG_DIR
    validate.py      ConfigError and the checks that name the offending field
    presets.py       PRESETS: the official configs and the small runnable presets
    engram_sizes.py  Engram table primes and row counts
    params.py        parameter inventory and counts (no model built)
    official/        the official config.json files
"""
from cedlm.config.schema import CONFIG_DIR, RUNNABLE_FAMILIES, ModelConfig
from cedlm.config.validate import ConfigError

__all__ = ["ModelConfig", "ConfigError", "RUNNABLE_FAMILIES", "CONFIG_DIR"]
