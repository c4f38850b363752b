"""cedlm: DeepSeek-V4.1-Flash (causal encoder-decoder, CSA2, FP4 global KV) in PyTorch."""
import os

# OpenMP threads that spin while waiting collapse throughput on a shared machine (measured on
# this 2-core machine under load, tiny model decode: 2 spinning threads 0.4 tok/s, 1 thread
# 4.4 tok/s, 2 passive threads 4.1 tok/s). libgomp reads this when torch is first imported, so
# it is set here, before any cedlm module imports torch; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from cedlm.util import inductor_cache_dir  # noqa: E402

# torch.compile's artefacts of the compiled decode step (FX graphs, generated C++) in cedlm's
# cache folder rather than /tmp, beside the graph store: a later start of the same model loads
# them instead of compiling (set before torch's inductor reads it; a value the user set is kept).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
from cedlm.config import ConfigError, ModelConfig  # noqa: E402


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
