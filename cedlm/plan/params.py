"""Parameters: every tensor of a config (no model built), totals, active per token.

The arithmetic lives in `cedlm.config.params` (below the model, so the engine's loader can size a
preset without the planner); this module re-exports it for `cedlm.plan`.
"""
from __future__ import annotations

from cedlm.config.params import Tensor, param_counts, param_inventory, vision_config

__all__ = ["Tensor", "param_counts", "param_inventory", "vision_config"]
