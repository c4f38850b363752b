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
    Stop strings are matched incrementally, so a token costs the same at any output length.
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
        # Stop strings are matched incrementally (Knuth-Morris-Pratt): per stop string, the length
        # of its longest prefix that ends the text so far. Each token costs O(new characters x stop
        # strings), whatever the output length; only the text not yet released is kept here.
        self._fail = [_prefix_function(t) for t in self.stops]
        self._state = [0] * len(self.stops)
        self._len = 0                 # characters seen
        self._emitted = 0             # characters released
        self._pending = ""            # text[_emitted:_len]
        self._released: list[str] = []

    @property
    def output(self) -> str:
        """Text released so far; the final output text once finished."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def held_back(self) -> str:
        return "" if self.finished else self._pending

    def update(self, token_id: int, text: str) -> StopResult:
        if self.finished:
            raise RuntimeError("StopChecker.update called after the request finished")
        if len(text) < self._len:
            raise ValueError("text must extend the previously passed text (pass the full text so far)")
        return self.update_delta(token_id, text[self._len:])

    def update_delta(self, token_id: int, delta: str) -> StopResult:
        if self.finished:
            raise RuntimeError("StopChecker.update called after the request finished")
        prev = self._len
        self._pending += delta
        self._len += len(delta)
        self.num_tokens += 1
        token_id = int(token_id)
        keep = self.params.include_stop_str_in_output

        if token_id in self.eos_ids or token_id in self.stop_ids:
            return self._finish("stop", token_id, self._len if keep else prev)
        if self.stops:
            hit = self._scan(delta, prev)
            if hit is not None:
                start, s = hit
                return self._finish("stop", s, start + len(s) if keep else start)
        if self.num_tokens >= self.params.max_tokens:
            return self._finish("length", None, self._len)

        safe = self._len - max(self._state) if self._hold else self._len
        return StopResult(False, None, self._release(max(safe, self._emitted)))

    def finish(self, reason: str = "length") -> StopResult:
        """End the request for an outside reason (e.g. context limit); releases held-back text."""
        if self.finished:
            return StopResult(True, self.reason, "")
        return self._finish(reason, None, self._len)

    # ------------------------------------------------------------------ helpers

    def _release(self, end: int) -> str:
        """Release the text up to absolute position ``end``."""
        out = self._pending[: end - self._emitted]
        self._pending = self._pending[end - self._emitted:]
        self._emitted = end
        if out:
            self._released.append(out)
        return out

    def _finish(self, reason: str, stop_reason, end: int) -> StopResult:
        out = self._release(max(end, self._emitted))
        self._pending = ""
        self.finished, self.reason, self.stop_reason = True, reason, stop_reason
        return StopResult(True, reason, out)

    def _scan(self, delta: str, prev: int) -> tuple[int, str] | None:
        """Feed ``delta`` (starting at absolute position ``prev``) to every stop string's matcher;
        the earliest-starting match that ends in it (ties: list order), else None."""
        best: tuple[int, str] | None = None
        for i, s in enumerate(self.stops):
            fail, st, n = self._fail[i], self._state[i], len(s)
            for p, c in enumerate(delta):
                while st and s[st] != c:
                    st = fail[st - 1]
                if s[st] == c:
                    st += 1
                    if st == n:
                        start = prev + p + 1 - n
                        if best is None or start < best[0]:
                            best = (start, s)
                        break
            self._state[i] = st
        return best


def _prefix_function(s: str) -> list[int]:
    """KMP failure table: f[k] = length of the longest proper prefix of s[:k+1] that is also its suffix."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f
