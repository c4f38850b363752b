"""The V4.1 CED model (see model.py for the stack, one module per mechanism)."""
from cedlm.model.model import CEDModel
from cedlm.model.replay import PREFILL_MODES
from cedlm.model.state import SequenceState
from cedlm.model.decoder_only import DecoderOnlyModel


def build_model(cfg, dspark: bool = False):
    """The stack a config asks for (`arch`): CEDModel or the decoder-only baseline; dspark=True
    adds the DSpark drafter (`mtp.*`, cedlm/model/dspark.py)."""
    if cfg.arch == "decoder_only":
        if dspark:
            from cedlm.config import ConfigError
            raise ConfigError("arch: the decoder-only baseline has no DSpark drafter (mtp.*)")
        return DecoderOnlyModel(cfg)
    return CEDModel(cfg, dspark=dspark)


__all__ = ["CEDModel", "DecoderOnlyModel", "SequenceState", "PREFILL_MODES", "build_model"]
