"""The V4.1 CED model (see model.py for the stack, one module per mechanism)."""
from cedlm.model.model import CEDModel
from cedlm.model.replay import PREFILL_MODES
from cedlm.model.state import SequenceState
from cedlm.model.decoder_only import DecoderOnlyModel


def build_model(cfg):
    """The stack a config asks for (`arch`): CEDModel or the decoder-only baseline."""
    return DecoderOnlyModel(cfg) if cfg.arch == "decoder_only" else CEDModel(cfg)


__all__ = ["CEDModel", "DecoderOnlyModel", "SequenceState", "PREFILL_MODES", "build_model"]
