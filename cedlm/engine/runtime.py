"""`SequenceRuntime`: the engine's objects for one request, held by request id.

The `Request` is plain data the scheduler plans with; what it takes to actually run the sequence
(the model's `SequenceState`, the `PrefillRun` in progress, the stop checker, the random
generator, the incremental detokenizer, the samples waiting on its prefill, the drafter's state)
lives here, written by the engine (and the draft state by the speculator), never by the
scheduler. `reset()` drops the model-side objects when the request's KV is freed (preemption,
finish): a preempted request is recomputed from its token ids with a fresh state."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from cedlm.engine.prompt_scoring import PromptScorer
    from cedlm.engine.request import Request
    from cedlm.engine.stop import StopChecker
    from cedlm.model.dspark import DraftState
    from cedlm.model.replay import PrefillRun
    from cedlm.model.state import SequenceState
    from cedlm.text.tokenizer import StreamDecoder


@dataclass(eq=False)
class SequenceRuntime:
    stop: StopChecker
    generator: torch.Generator | None
    detok: StreamDecoder | None
    state: SequenceState | None = None          # the model's per-sequence caches (None: not admitted)
    prefill: PrefillRun | None = None           # the prompt's prefill in progress
    scorer: PromptScorer | None = None          # prompt scoring of that prefill (prompt_logprobs)
    draft: DraftState | None = None             # the DSpark drafter's context (speculator-written)
    forks: list[Request] = field(default_factory=list)   # samples waiting to start from this prefill
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_logprobs_sent: bool = False          # the scored prompt went out in a StepOutput
    held: torch.Tensor | None = None            # next-token logits waiting for a processor's work
    # this step's output so far (Engine.step turns them into the StepOutput, then clears them)
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top: list[tuple[tuple[int, ...], tuple[float, ...]]] = field(default_factory=list)
    new_text: str = ""

    def clear_step(self) -> None:
        self.new_ids, self.new_logprobs, self.new_top, self.new_text = [], [], [], ""

    def reset(self) -> None:
        """The KV went away (preempted / finished): drop everything built on it."""
        self.state = self.prefill = self.draft = self.scorer = self.held = None
