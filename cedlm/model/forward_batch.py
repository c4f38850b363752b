"""The forward batch: the metadata of one pass of the model over B sequences, built once.

A model call runs an encoder pass (every new token; ends with the global-KV projection) and a
decoder pass (every row, or only the trailing ones at prefill). Each pass gets one
`ForwardBatch`: the positions of its rows, the Engram rows looked up from token ids before any
layer runs (encoder pass only: Engram layers sit in the encoder), and whether the pass replays
tokens whose global entries already exist. Its fields are fixed at construction; the one thing a
pass produces for its later layers, the sparse selection (each index source's top-k and the
candidate pool), lives in `selection`, which only the indexer writes. An optional `probe`
(`cedlm.model.probe.IndexerProbe`, None by default) asks the indexers and the attention to record
what the indexer distillation needs (training only; nothing is recorded when it is None).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

from cedlm.model.probe import IndexerProbe


@dataclass
class Selection:
    """Per-pass output of the lightning indexers, read by Reuse layers and Reindex layers."""
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    pool: torch.Tensor | None = None      # candidate pool [B, T, N] bool


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor               # [B, T] int64 positions of this pass's rows
    engram_rows: Mapping[int, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    replay: bool = False                  # rebuilding windows: global entries already exist
    selection: Selection = field(default_factory=Selection)
    probe: IndexerProbe | None = None     # indexer distillation (training): see probe.py
    image_mask: torch.Tensor | None = None   # [B, T] image-span rows (vision models; else None)
    first: tuple[int, ...] | None = None  # positions[:, 0] when the caller knows them (training: 0s)

    def __post_init__(self):
        if self.positions.dim() != 2:
            raise ValueError(f"positions: expected [B, T], got shape {tuple(self.positions.shape)}")
        if not isinstance(self.engram_rows, MappingProxyType):
            object.__setattr__(self, "engram_rows", MappingProxyType(dict(self.engram_rows)))

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def num_rows(self) -> int:
        return self.positions.shape[1]

    def first_positions(self) -> list[int]:
        """Each row's first position: `first` when given (no tensor read: torch.compile traces
        the training forward without a graph break here), else read from `positions`."""
        return list(self.first) if self.first is not None else self.positions[:, 0].tolist()
