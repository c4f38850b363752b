"""`VisionConfig`: the `vision_config` object of the official DeepSeek-V4.1 config.json.

The official file nests it HF-style at the top level (V4 Vision-Exp used flat `vision_*` keys):

    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32,
      "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
      "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
      "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": null}

`ModelConfig` keeps the object verbatim in `extra["top"]` (so the file round-trips);
`vision_config_of(cfg)` reads it into this dataclass. A model builds the vision tower only when
`vision_enabled(cfg)`: a `vision_config` and an `image_token_id` (the placeholder id every
image-span position carries). Pure Python, no torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cedlm.config.validate import ConfigError


@dataclass(frozen=True)
class VisionConfig:
    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    model_type: str = "deepseek_v41_vision"

    def __post_init__(self):
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                     "patch_size", "downsample_ratio", "max_image_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"vision_config.{name}: must be a positive integer, got {v!r}")
        if self.min_pixels < 0:
            raise ConfigError(f"vision_config.min_pixels: must be >= 0, got {self.min_pixels!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"vision_config.hidden_size: {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}")
        if (self.hidden_size // self.num_attention_heads) % 4:
            raise ConfigError("vision_config: the head dim (hidden_size / num_attention_heads) must be "
                              "a multiple of 4 (2-D RoPE: half the head per axis, in pairs)")
        if self.max_image_tokens < 4:
            raise ConfigError(f"vision_config.max_image_tokens: must be >= 4 (start + one row + end), "
                              f"got {self.max_image_tokens}")
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ConfigError(f"vision_config.max_wh_ratio: must be positive or null, got {self.max_wh_ratio!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"vision_config: expected an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"model_type": d.pop("model_type"), **d}


def vision_config_of(cfg) -> VisionConfig | None:
    """The `vision_config` of a ModelConfig (kept in `extra`), or None."""
    extra = cfg.extra or {}
    d = (extra.get("top") or {}).get("vision_config") or (extra.get("flat") or {}).get("vision_config")
    return VisionConfig.from_dict(d) if d else None


def vision_enabled(cfg) -> bool:
    """Build the vision tower: a vision_config and an image placeholder id."""
    return cfg.image_token_id is not None and vision_config_of(cfg) is not None


def with_vision(cfg, vc: VisionConfig, image_token_id: int):
    """A copy of `cfg` with `vision_config` and `image_token_id` set (written into config.json)."""
    import copy
    out = cfg.replace(image_token_id=image_token_id)
    extra = copy.deepcopy(cfg.extra or {})
    extra.setdefault("top", {})["vision_config"] = vc.to_dict()
    keys = extra.get("top_keys")
    if keys is not None and "vision_config" not in keys:
        extra["top_keys"] = list(keys) + ["vision_config"]
    out.extra = extra
    return out
