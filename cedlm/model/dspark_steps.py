"""The DSpark steps with static shapes, each a compiled wrapper of the one model: the verify step
(`model.decode_step` with ids [B, T]: anchor + drafts for B sequences in one call, and the
write-back of the kept prefix) and the draft step (`dspark.draft_step`: one block's hidden rows
and base logits).

`rollback.verify` (the reference, and the fallback) appends the T tokens to the sequences'
caches through the eager encoder and decoder passes, then `rollback.rollback` undoes what the
rejected ones wrote. This step appends nothing while it runs: each of the T rows attends to the
cache as it was plus the block's earlier rows (window ring + the block's window rows; stored
entries + the entries the block completes, at their indices n, n + 1, ...), so after acceptance
the host writes back only the first n_keep rows' effects (`commit`), and nothing needs rolling
back. The verified length is fixed per step object (T = 1 + the speculator's draft cap): a
shorter block is padded with token 0, whose rows are computed and dropped, so one graph serves
every call (plus one for batch 1, as for the decode step).

    vs = VerifyStep.of(CompiledDecode.of(model), T)
    logits, taps, out = vs(ids, states)       # ids [B, <= T]; logits [B, T, V], taps [B, T, n*D]
    vs.commit(ids, states, out, keep)         # the first keep[b] tokens of row b, as if appended

Modes follow the decode step's (`CompiledDecode.mode`): "compiled" compiles this step (its own
graphs, cached on disk like the decode step's), "static" and "cudagraph" run it uncompiled (no
CUDA graph is captured for the verify step), "eager" or a reason in `why_not` sends the caller
to `rollback.verify` (`usable` is False). `tests/test_verify_step.py` compares logits, taps and
every cache byte after `commit` with `rollback.verify` + `rollback.rollback`.
"""
from __future__ import annotations

import copy
import weakref
from typing import NamedTuple

import torch

from cedlm.model import dspark
from cedlm.model.model import decode_step
from cedlm.model.rollback import mark, rollback, verify
from cedlm.model.static_kv import StepShapes
from cedlm.model.compiled_step import (CompiledDecode, graph_name, loop_rows_for, mark_dynamic,
                                       run_step, scratch_states, stored_step)
from cedlm.model.state import SequenceState


# decode step -> {T: VerifyStep}; weak, so the graphs go with the model's decode step
_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# decode step -> DraftStep
_DRAFTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Appended(NamedTuple):
    """What the reference verification left to `VerifyStep.commit`: every row appended, the
    marks and captures `rollback.rollback` needs to take the rejected ones back."""
    marks: list
    cap: object


class VerifyStep:
    @classmethod
    def of(cls, decoder: CompiledDecode, T: int, log=None) -> "VerifyStep":
        """The step of `decoder`'s model for T tokens, made once: engines built one after another
        (a bench, a server restarting its engine) share its graphs (a new object would trace and
        load them again, seconds to tens of seconds)."""
        steps = _STEPS.setdefault(decoder, {})
        if T not in steps:
            steps[T] = cls(decoder, T, log=log)
        return steps[T]

    def __init__(self, decoder: CompiledDecode, T: int, log=None):
        if not 1 <= T <= decoder.model.cfg.sliding_window:
            raise ValueError(f"verify step: T={T} not in [1, sliding_window="
                             f"{decoder.model.cfg.sliding_window}]")
        self.decoder, self.model, self.T = decoder, decoder.model, T
        self.compile = decoder.mode == "compiled"
        self.fn = self.uncompiled = decode_step
        self.loop_rows = loop_rows_for(T)        # the products of its batch-1 graph: T rows
        if self.compile:                         # a graph of its own (options as the decode step's)
            self.fn = stored_step(decoder.model, f"verify{T}", loop_rows=self.loop_rows)
        self._shapes: dict[bool, StepShapes] = {}
        self.compile_s: dict[str, float] = {}
        self.log = log

    @property
    def usable(self) -> bool:
        """Whether the static step runs now (else the reference, `rollback.verify`)."""
        return self.decoder.mode != "eager" and self.decoder.why_not() is None

    def _shape(self, states) -> StepShapes:
        sh = self.decoder.shape_for(states)
        if sh.flat not in self._shapes:
            mine = copy.copy(sh)
            mine.taps = True
            self._shapes[sh.flat] = mine
        return self._shapes[sh.flat]

    @torch.no_grad()
    def __call__(self, ids, states: list[SequenceState]):
        """ids [B, t] (t <= T; padded to T with token 0) -> (logits [B, T, V] (the reference:
        [B, t, V]), taps [B, T, n*D], out: what `commit` writes back). The static step changes
        nothing in the states; the reference (`usable` False: `rollback.verify`) appends the rows,
        and `commit` rolls back the rejected ones."""
        ids = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
        B, t = ids.shape
        if B != len(states):
            raise ValueError(f"input_ids: {B} rows for {len(states)} states")
        if not 1 <= t <= self.T:
            raise ValueError(f"verify step: {t} tokens per row, expected 1..{self.T}")
        if not self.usable:
            marks = [mark(st, t) for st in states]
            logits, cap = verify(self.model, ids, states, taps=True)
            return logits, cap.taps, Appended(marks, cap)
        if t < self.T:
            ids = torch.cat((ids, ids.new_zeros(B, self.T - t)), 1)
        shapes = self._shape(states)
        args = self.decoder.inputs(ids, states)
        logits, out = run_step(self, f"verify step (T={self.T})", decode_step, (shapes, *args),
                               graph_name(B, shapes.flat))
        return logits, out.pop("taps"), out

    def commit(self, ids, states: list[SequenceState], out: dict, keep: list[int]) -> None:
        """Write back the first keep[b] tokens of ids[b] (0 <= keep[b] <= its length): the
        states are then what appending just them would have made."""
        rows = ids.tolist() if isinstance(ids, torch.Tensor) else [list(r) for r in ids]
        for b, (r, k) in enumerate(zip(rows, keep)):
            if not 0 <= k <= len(r):
                raise ValueError(f"commit: keep {k} not in [0, {len(r)}] (row {b})")
        if isinstance(out, Appended):               # the reference appended every row
            for b, st in enumerate(states):
                rollback(self.model, st, out.marks[b], keep[b], out.cap, b)
            return
        self.decoder.write_back(rows, states, out, keep)

    @torch.no_grad()
    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2), rows=None) -> dict[str, float]:
        """Compile the graphs (as `CompiledDecode.warm_up`, scratch states) before a request."""
        if not self.compile or not self.usable:
            return {}
        for B in batch_sizes:
            self(torch.arange(B * self.T, device="cpu").view(B, self.T) % 7, scratch_states(self.model, B, rows))
        return dict(self.compile_s)


class DraftStep:
    """`dspark.draft_block` as one compiled call per block (`dspark.draft_step`):

        ds = DraftStep.of(CompiledDecode.of(model))
        h, base = ds(states, anchors, P)        # DraftState per sequence; h [B, N, D], base [B, N, V]

    Modes follow the decode step's (`CompiledDecode.mode`): "compiled" compiles it (its own
    graphs: batch 1 and batch >= 2), "static" and "cudagraph" run it uncompiled, "eager" (or a
    reason in `why_not`) sends the caller to `dspark.draft_block` (`usable` is False).
    `tests/test_draft_step.py` compares h, base and the experts with `draft_block`."""

    @classmethod
    def of(cls, decoder: CompiledDecode, log=None) -> "DraftStep":
        """The draft step of `decoder`'s model, made once (engines built one after another share
        its graphs)."""
        if decoder not in _DRAFTS:
            _DRAFTS[decoder] = cls(decoder, log=log)
        return _DRAFTS[decoder]

    def __init__(self, decoder: CompiledDecode, log=None):
        if not hasattr(decoder.model, "mtp"):
            raise ValueError("draft step: this model has no DSpark drafter (no mtp.* weights)")
        self.decoder, self.model = decoder, decoder.model
        self.compile = decoder.mode == "compiled"
        self.uncompiled = dspark.draft_step
        self.loop_rows = loop_rows_for(decoder.model.cfg.dspark_block_size)    # a block's rows
        self.fn = (stored_step(decoder.model, "draft", dspark.draft_step, self.loop_rows)
                   if self.compile else dspark.draft_step)
        self.compile_s: dict[str, float] = {}
        self.log = log

    @property
    def usable(self) -> bool:
        """Whether the static step runs now (else the reference, `dspark.draft_block`)."""
        return self.decoder.mode != "eager" and self.decoder.why_not() is None

    @torch.no_grad()
    def __call__(self, states: list[dspark.DraftState], anchors: torch.Tensor, P: torch.Tensor,
                 with_experts: bool = False):
        """One block per sequence: anchors [B] at positions P [B] (its context holds positions
        < P) -> (h [B, N, D], base [B, N, V]), as `dspark.draft_block`; with_experts: also the
        experts each stage chose ({stage: [B * N, k]}, for a test)."""
        B = len(states)
        if anchors.shape != (B,) or P.shape != (B,):
            raise ValueError(f"draft step: anchors {tuple(anchors.shape)} and P {tuple(P.shape)} "
                             f"must both be [{B}] (one per state)")
        if not self.usable:
            return dspark.draft_block(self.model, states, anchors, P)
        if B == 1:
            rings, ring_pos = states[0].window.unsqueeze(1), states[0].window_pos[:1]
        else:
            rings = torch.stack([st.window for st in states], 1)
            ring_pos = torch.stack([st.window_pos[0] for st in states])
        args = (self.decoder.shapes, rings, ring_pos, anchors, P)
        if self.compile and B > 1:                 # one graph for every batch size >= 2
            mark_dynamic((rings, 1), (ring_pos, 0), (anchors, 0), (P, 0))
        h, base, experts = run_step(self, "draft step", dspark.draft_step, args, graph_name(B, False))
        return (h, base, experts) if with_experts else (h, base)

    @torch.no_grad()
    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2)) -> dict[str, float]:
        """Compile the graphs before a request, on empty draft states."""
        if not self.compile or not self.usable:
            return {}
        dev = self.decoder.device
        for B in batch_sizes:
            states = [dspark.DraftState(self.model.kv_layout, len(self.model.mtp), device=dev)
                      for _ in range(B)]
            self(states, torch.full((B,), 3, device=dev), torch.zeros(B, dtype=torch.int64, device=dev))
        return dict(self.compile_s)
