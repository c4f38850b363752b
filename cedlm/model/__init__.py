"""The V4.1 CED model (see model.py for the stack, one module per mechanism)."""
from cedlm.model.model import CEDModel
from cedlm.model.replay import PREFILL_MODES
from cedlm.model.state import SequenceState
from cedlm.model.twin import TwinModel


def build_model(cfg):
    """The stack a config asks for (`arch`): CEDModel or its decoder-only TwinModel."""
    return TwinModel(cfg) if cfg.arch == "twin" else CEDModel(cfg)


__all__ = ["CEDModel", "TwinModel", "SequenceState", "PREFILL_MODES", "build_model"]
