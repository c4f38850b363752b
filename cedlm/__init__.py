"""cedlm: DeepSeek-V4.1-Flash (causal encoder-decoder, CSA2, FP4 global KV) in PyTorch."""
from cedlm.config import ConfigError, ModelConfig
from cedlm.model import CEDModel

__all__ = ["ModelConfig", "ConfigError", "CEDModel"]
__version__ = "0.1.0"
