"""A generation request and its lifecycle (plain data; the engine and scheduler move it along)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from cedlm.engine.sampling_params import SamplingParams


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
