"""The names of the run-time modes that engine options and CLI flags choose between, kept apart
from the modules that implement them so that parsing a command line imports no torch."""

# how a prompt's decoder rows are made (model/replay.py)
PREFILL_MODES = ("full", "exact", "bounded")
# how a window is rebuilt after a prefix-cache hit (model/replay.py)
REPLAY_MODES = ("exact", "bounded")
# the decode step (model/compiled_step.py)
DECODE_STEPS = ("compiled", "cudagraph", "static", "eager")
# speculative decoding methods (engine/speculative.py) and when to draft (engine/spec_policy.py)
SPEC_METHODS = ("dspark",)
SPEC_POLICIES = ("adaptive", "always")
