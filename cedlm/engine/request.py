"""A generation request and its lifecycle (plain data; the engine and scheduler move it along)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cedlm.engine.sampling_params import SamplingParams


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
    RUNNING = "running"          # decoding one token per engine step
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    text: str = ""
    # prompt_logprobs: list aligned with prompt_ids (entry 0 None, then TokenLogprob), when
    # params.prompt_logprobs is set; filled when the prefill completes
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_preemptions: int = 0
    # cache-side bookkeeping (integers, so the scheduler can plan without the model)
    num_cached: int = 0                  # tokens whose KV is in the cache
    num_prefix_hit: int = 0              # of which came from the prefix cache
    num_blocks: int = 0                  # blocks held
    # engine-side objects (opaque to the scheduler)
    state: Any = None
    table: Any = None
    prefill: Any = None                  # the PrefillRun in progress
    stop: Any = None
    generator: Any = None
    detok: Any = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # samples of one prompt (SamplingParams.n / best_of; Engine.add_samples)
    group_id: str | None = None          # the id the caller gave the prompt (= request_id for one sample)
    sample_index: int = 0
    forks: list[Any] = field(default_factory=list)   # samples waiting to start from this one's prefill
    images: list[Any] = field(default_factory=list)  # RequestImage per image span (engine/images.py)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prefill must score every prompt row (full decoder, no prefix-cached blocks)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the raw logprobs of the sampled tokens (how best_of ranks samples)."""
        return float(sum(self.output_logprobs))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence will have in cache after its next step (prompt + outputs)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


def select_samples(samples: list[Request], n: int) -> list[Request]:
    """The n samples an n / best_of request returns: all of them, in sample order, when exactly n
    were drawn; else the n with the highest cumulative logprob (ties: sample order)."""
    if len(samples) <= n:
        return list(samples)
    return sorted(samples, key=lambda r: -r.cumulative_logprob)[:n]
