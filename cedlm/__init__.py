"""cedlm: DeepSeek-V4.1-Flash (causal encoder-decoder, CSA2, FP4 global KV) in PyTorch."""
from cedlm.config import ConfigError, ModelConfig
from cedlm.model import CEDModel


def __getattr__(name):                 # the engine is imported on first use
    if name == "LLM":
        from cedlm.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from cedlm.engine.sampler import SamplingParams
        return SamplingParams
    raise AttributeError(name)


__all__ = ["ModelConfig", "ConfigError", "CEDModel", "LLM", "SamplingParams"]
__version__ = "0.1.0"
