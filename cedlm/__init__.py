"""cedlm: DeepSeek-V4.1-Flash (causal encoder-decoder, CSA2, FP4 global KV) in PyTorch."""
from cedlm.config import ConfigError, ModelConfig


def __getattr__(name):                 # the model and the engine (torch) are imported on first use
    if name == "CEDModel":
        from cedlm.model import CEDModel
        return CEDModel
    if name == "LLM":
        from cedlm.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from cedlm.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)


__all__ = ["ModelConfig", "ConfigError", "CEDModel", "LLM", "SamplingParams"]
__version__ = "0.1.0"
