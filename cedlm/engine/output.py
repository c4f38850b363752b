"""What one engine step did to one request: `StepOutput` (plain Python values, built once).

`Engine.step()` returns one `StepOutput` per request the step touched (admitted, prefilled a
chunk, sampled, finished or failed), modeled on vLLM's `EngineCoreOutput`: the tokens sampled in
this step with their logprobs, the text they added, the finish reason when it is the request's
last output, the scored prompt once it is ready, token counts, and the request's timings. The
server worker, `LLM` and the benchmarks read these; nobody diffs a request to learn what
changed."""
from __future__ import annotations

from dataclasses import dataclass

from cedlm.engine.request import TokenLogprob

TopLogprobs = tuple[tuple[int, ...], tuple[float, ...]]      # (top ids, their logprobs), best first


@dataclass(frozen=True)
class RequestTimes:
    """Monotonic timestamps (time.monotonic) of one request; None until it happened."""
    arrival: float
    first_scheduled: float | None = None   # admitted by the scheduler (KV reserved) the first time
    first_token: float | None = None       # first sampled token
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        """Waiting for admission."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_s(self) -> float | None:
        """From admission to the first token (the prompt's prefill, with the batch's other work)."""
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_s(self) -> float | None:
        """From the first token to the finish."""
        return None if self.finished is None or self.first_token is None else self.finished - self.first_token

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        """Decode time per token after the first (None with fewer than two tokens)."""
        d = self.decode_s
        return None if d is None or num_output_tokens < 2 else d / (num_output_tokens - 1)


@dataclass(frozen=True)
class StepOutput:
    """One request's share of one engine step.

    new_token_ids / new_logprobs: the tokens sampled in this step (several with speculative
    decoding) and their raw logprobs; new_top_logprobs: per token (ids, logprobs) when
    `SamplingParams.logprobs = k > 0`, else None. text: what those tokens added to the output
    text (stop strings held back until they cannot match). finish_reason: set on the request's
    last output ("stop" | "length" | "abort" | "error"; with "error", `error` says why);
    stop_reason: the stop string or token id that ended it. prompt_logprobs: the scored prompt,
    on the one output after the prefill scored it. num_cached_tokens: prompt tokens served by the
    prefix cache at admission."""
    request_id: str
    group_id: str
    sample_index: int
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[float, ...] = ()
    new_top_logprobs: tuple[TopLogprobs, ...] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    times: RequestTimes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        return self.finish_reason == "error"
