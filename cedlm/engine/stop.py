"""Stop handling for the inference engine: ``StopChecker`` and its ``StopResult``.

Per-request stop logic over the incrementally decoded text: stop strings (also across token
boundaries, holding back a tail that may begin one), stop token ids, EOS and ``max_tokens``, as
set in the request's ``SamplingParams`` (``cedlm.engine.sampling_params``).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from cedlm.engine.sampling_params import SamplingParams


class StopResult(NamedTuple):
    finished: bool
    reason: str | None      # "stop" | "length" | None
    text: str               # newly releasable text (a delta; concatenating all deltas = output)


class StopChecker:
    """Stop logic of one request over its incrementally decoded text.

    Call ``update(token_id, text)`` once per generated token, with ``text`` the full text generated
    so far (including that token; it must extend the previous ``text``), or ``update_delta(token_id,
    delta)`` with only the new text. Each call returns ``StopResult(finished, reason, text)`` where
    ``text`` is the newly releasable output; the concatenation of all returned texts is the final
    output (``self.output``).

    Checks, in order:
      * EOS (``eos_token_id``, unless ``ignore_eos``) and ``stop_token_ids`` -> "stop"; the token's
        own text is dropped unless ``include_stop_str_in_output``.
      * stop strings, found anywhere in the text including across token boundaries -> "stop"; the
        output is cut before the earliest match (after it with ``include_stop_str_in_output``), and
        anything decoded after the match is discarded.
      * ``max_tokens`` tokens generated -> "length" (all text is released).
    While streaming, the longest tail of the text that is a proper prefix of some stop string is
    held back (not needed, hence not done, with ``include_stop_str_in_output``) and released once
    it can no longer begin a stop string. ``stop_reason`` records the matched string or token id.
    """

    def __init__(self, params: SamplingParams, eos_token_id: int | Iterable[int] | None = None):
        self.params = params
        self.stops: list[str] = list(params.stop or [])
        self.stop_ids = set(params.stop_token_ids or [])
        if params.ignore_eos or eos_token_id is None:
            self.eos_ids: set[int] = set()
        elif isinstance(eos_token_id, int):
            self.eos_ids = {eos_token_id}
        else:
            self.eos_ids = set(eos_token_id)
        self._hold = bool(self.stops) and not params.include_stop_str_in_output
        self.num_tokens = 0
        self.finished = False
        self.reason: str | None = None
        self.stop_reason: str | int | None = None
        self._text = ""
        self._emitted = 0

    @property
    def output(self) -> str:
        """Text released so far; the final output text once finished."""
        return self._text[: self._emitted]

    @property
    def held_back(self) -> str:
        return "" if self.finished else self._text[self._emitted:]

    def update_delta(self, token_id: int, delta: str) -> StopResult:
        return self.update(token_id, self._text + delta)

    def update(self, token_id: int, text: str) -> StopResult:
        if self.finished:
            raise RuntimeError("StopChecker.update called after the request finished")
        prev = len(self._text)
        if len(text) < prev:
            raise ValueError("text must extend the previously passed text (pass the full text so far)")
        self._text = text
        self.num_tokens += 1
        token_id = int(token_id)
        keep = self.params.include_stop_str_in_output

        if token_id in self.eos_ids or token_id in self.stop_ids:
            return self._finish("stop", token_id, len(text) if keep else prev)
        if self.stops:
            hit = self._find_stop(prev)
            if hit is not None:
                start, s = hit
                return self._finish("stop", s, start + len(s) if keep else start)
        if self.num_tokens >= self.params.max_tokens:
            return self._finish("length", None, len(text))

        safe = len(text) - self._held_len(text) if self._hold else len(text)
        safe = max(safe, self._emitted)
        out = text[self._emitted : safe]
        self._emitted = safe
        return StopResult(False, None, out)

    def finish(self, reason: str = "length") -> StopResult:
        """End the request for an outside reason (e.g. context limit); releases held-back text."""
        if self.finished:
            return StopResult(True, self.reason, "")
        return self._finish(reason, None, len(self._text))

    # ------------------------------------------------------------------ helpers

    def _finish(self, reason: str, stop_reason, end: int) -> StopResult:
        end = max(end, self._emitted)
        out = self._text[self._emitted : end]
        self._emitted = end
        self.finished, self.reason, self.stop_reason = True, reason, stop_reason
        return StopResult(True, reason, out)

    def _find_stop(self, prev: int) -> tuple[int, str] | None:
        """Earliest stop-string match that ends in the new text (text[prev:]); ties: list order."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self._text.find(s, max(0, prev - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
