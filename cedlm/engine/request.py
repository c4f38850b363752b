"""A generation request: what the user asked for and what the scheduler decided (typed, plain
data). The engine's per-sequence objects (model state, prefill run, stop checker, ...) are not
here: they live in the engine's `SequenceRuntime` (engine/runtime.py), keyed by request id; the
KV block table lives in the KV cache manager, keyed by request id. docs/architecture.md lists the
one writer of every field."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from cedlm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cedlm.engine.images import RequestImage


class TokenLogprob(NamedTuple):
    """One scored prompt position (plain Python values): the actual token, its raw logprob, its
    rank under the model's distribution (1 = the most likely token; ties rank first), and the
    top-k alternatives (``SamplingParams.prompt_logprobs = k``; empty for k = 0)."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]

    def as_dict(self) -> dict[int, float]:
        """vLLM's shape: {token id: logprob} of the actual token and the top-k."""
        return {self.token_id: self.logprob, **dict(zip(self.top_ids, self.top_logprobs))}


class Status(enum.Enum):
    WAITING = "waiting"          # not admitted yet (or preempted: its KV was freed)
    PREFILLING = "prefilling"    # admitted; encoder chunks in progress
    RUNNING = "running"          # decoding one token (or one verified block) per engine step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence to generate. Three groups of fields, each with its writer:

    - asked for (set at creation, then read only): ids, prompt, params, images, sample of a group;
    - scheduled (the `Scheduler` alone writes them): status, `num_computed_tokens`,
      `num_cached_tokens`, `num_preemptions`, `first_scheduled_time`;
    - produced (the `Engine` alone writes them): `output_ids`, `cumulative_logprob`,
      `prompt_logprobs`, `finish_reason`, `error`.
    """
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    # samples of one prompt (SamplingParams.n / best_of; Engine.add_samples)
    group_id: str | None = None          # the id the caller gave the prompt (= request_id for one sample)
    sample_index: int = 0
    # the caller's request the sequence belongs to (a server request of several prompts x n);
    # the scheduler runs at most `max_seqs_per_owner` sequences of one owner at once (None: no cap)
    owner: str | None = None
    images: list[RequestImage] = field(default_factory=list)   # one per image span (engine/images.py)
    # ---- the scheduler's decisions
    status: Status = Status.WAITING
    num_computed_tokens: int = 0         # positions whose KV is in the cache
    num_cached_tokens: int = 0           # of which came from the prefix cache at admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # ---- the engine's results
    output_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0      # sum of the sampled tokens' raw logprobs (best_of ranks by it)
    # prompt_logprobs: aligned with prompt_ids (entry 0 None, then TokenLogprob), when
    # params.prompt_logprobs is set; filled when the prefill completes
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    error: str | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prefill must score every prompt row (full decoder, no prefix-cached blocks)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence will have in cache after its next step (prompt + outputs)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        """Done: the engine gave it a finish reason (the scheduler frees it at the step's end) or
        the scheduler finished it."""
        return self.finish_reason is not None or self.status is Status.FINISHED


def select_samples(samples: list, n: int) -> list:
    """The n samples an n / best_of request returns: all of them, in sample order, when exactly n
    were drawn; else the n with the highest `cumulative_logprob` (ties: sample order). Works on
    anything with a `cumulative_logprob` (Requests, completion outputs)."""
    if len(samples) <= n:
        return list(samples)
    return sorted(samples, key=lambda r: -r.cumulative_logprob)[:n]
