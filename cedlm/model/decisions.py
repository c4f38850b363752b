"""Discrete decisions of the model, recorded and replayed: a tool for comparing computations.

Two computations that should agree (fast vs reference kernels, one CPU's SIMD path vs another's,
a verify pass over 8 rows vs one over 4) round differently in the last bits. Continuous outputs
then differ by rounding, which a tolerance absorbs; but a discrete choice taken on a near-tie can
fall the other way and move the output by far more. The model takes two such choices per layer
call: the lightning indexer's top-k entries (`Indexer.select`) and the MoE router's top-k experts
(`Gate.forward`). `Decisions` records them on one side and replays them on the other, so that a
test compares the continuous math with the choices pinned, and separately counts how often the
choices themselves agree.

    rec = Decisions.record(model)            # every choice the model takes is appended
    out_a = model(ids)
    rec.detach()
    with Decisions.replay(model, rec.log):   # the same choices, in the same order, are imposed
        out_b = model(ids)

A replayed choice is matched by module (its qualified name) and call order. `prefix_rows=True`
replays a recorded choice onto a call over a prefix of the recorded rows (a verify pass over the
first n of the recorded T tokens): the first rows of the record are imposed. A shape that does not
fit, or a call with nothing recorded left, raises: a replay never silently falls back to choosing.
With no `Decisions` attached (the default) the modules take their own choices at no cost.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

# Modules that take a discrete choice and accept a `decisions` attribute.
_KINDS = ("Indexer", "Gate")


class Decisions:
    """A log of discrete choices per module (qualified name -> list of tensors, in call order)."""

    def __init__(self, model: nn.Module, log: dict[str, list[torch.Tensor]] | None = None,
                 prefix_rows: bool = False):
        self.model, self.replaying, self.prefix_rows = model, log is not None, prefix_rows
        self.log: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._next: dict[str, int] = defaultdict(int)
        if log is not None:
            self.log.update({k: list(v) for k, v in log.items()})
        self.modules = {name: m for name, m in model.named_modules() if type(m).__name__ in _KINDS}
        for name, m in self.modules.items():
            m.decisions, m.decision_key = self, name

    # ------------------------------------------------------------------ construction
    @classmethod
    def record(cls, model: nn.Module) -> "Decisions":
        return cls(model)

    @classmethod
    def replay(cls, model: nn.Module, log: dict[str, list[torch.Tensor]],
               prefix_rows: bool = False) -> "Decisions":
        return cls(model, log, prefix_rows)

    def detach(self) -> None:
        for m in self.modules.values():
            m.decisions = None

    def __enter__(self) -> "Decisions":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ------------------------------------------------------------------ the hook
    def take(self, key: str, choice: torch.Tensor, row_dim: int) -> torch.Tensor:
        """The choice a module took (`choice`, rows along `row_dim`) -> the choice to use."""
        if not self.replaying:
            self.log[key].append(choice.detach().clone())
            return choice
        i = self._next[key]
        if i >= len(self.log.get(key, [])):
            raise RuntimeError(f"decisions: no recorded choice left for {key} (call {i})")
        self._next[key] = i + 1
        rec = self.log[key][i]
        if self.prefix_rows and rec.shape[row_dim] >= choice.shape[row_dim]:
            rec = rec.narrow(row_dim, 0, choice.shape[row_dim])
        if rec.shape != choice.shape:
            raise RuntimeError(f"decisions: recorded choice {tuple(rec.shape)} for {key} (call {i}) "
                               f"does not fit this call's {tuple(choice.shape)}")
        return rec.to(choice.device)

    @property
    def num_calls(self) -> int:
        return sum(len(v) for v in self.log.values())

    def all_replayed(self) -> bool:
        """Every recorded choice was imposed (a replay that ran fewer calls did not cover them)."""
        return all(self._next[k] == len(v) for k, v in self.log.items())


def agreement(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> tuple[int, int]:
    """(rows whose choice differs, rows compared) between two logs of the same computation. A row
    is one query's top-k entries or one token's experts; the order within a row does not count."""
    differ = total = 0
    if a.keys() != b.keys():
        raise ValueError(f"decisions: the logs cover other modules ({sorted(a)} vs {sorted(b)})")
    for k in a:
        if len(a[k]) != len(b[k]):
            raise ValueError(f"decisions: {k} was called {len(a[k])} vs {len(b[k])} times")
        for x, y in zip(a[k], b[k]):
            if x.shape != y.shape:
                raise ValueError(f"decisions: {k} shapes {tuple(x.shape)} vs {tuple(y.shape)}")
            xs = x.reshape(-1, x.shape[-1]).sort(-1).values
            ys = y.reshape(-1, y.shape[-1]).sort(-1).values
            differ += int((xs != ys).any(-1).sum())
            total += xs.shape[0]
    return differ, total
