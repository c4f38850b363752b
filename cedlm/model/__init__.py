"""The V4.1 CED model (see model.py for the stack, one module per mechanism)."""
from cedlm.model.model import PREFILL_MODES, CEDModel
from cedlm.model.state import SequenceState

__all__ = ["CEDModel", "SequenceState", "PREFILL_MODES"]
