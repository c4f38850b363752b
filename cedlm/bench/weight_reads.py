"""Bytes of weights a decoded token reads, and the machine's single-thread read bandwidth.

The weight-read bandwidth fraction of a decoder is (bytes of weights read per token x tokens/s)
/ (bytes/s one thread reads from memory): 1.0 means the step runs as fast as streaming its
weights once allows at batch 1. `active_parameters` counts what CED reads per token;
`read_bandwidth` measures the denominator on this machine, in the figure's run.
"""
from __future__ import annotations

import re
import statistics
import time

import torch

GIB = 1 << 30
_EXPERT = re.compile(r"^(layers\.\d+\.ffn)\.experts\.(\d+)\.")


def active_parameters(model) -> dict:
    """Parameters a CED model multiplies (or reads) for one decoded token, by part.

    Counted: one row of the embedding, every layer's attention (with its compressor and indexer),
    hyper-connection mixers, norms, MoE gate, the shared experts, `num_experts_per_tok` of the
    routed experts (each of a layer's experts has the same size), the Engram projections, the
    final norm and the whole head. Not counted: the Engram embedding tables (a few rows are looked
    up, none multiplied) and the unselected routed experts. Returns part -> count plus `total`.
    """
    cfg = model.cfg
    k = cfg.num_experts_per_tok
    parts = {"embedding_row": 0, "attention": 0, "routed_experts": 0, "shared_experts": 0,
             "other_layer": 0, "engram_projections": 0, "head": 0}
    experts: dict[str, dict[int, int]] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        m = _EXPERT.match(name)
        if name == "embed.weight":
            parts["embedding_row"] += p.shape[1]
        elif m:
            per = experts.setdefault(m.group(1), {})
            per[int(m.group(2))] = per.get(int(m.group(2)), 0) + n
        elif ".engram.embed." in name:
            continue                                   # a table: rows looked up, not multiplied
        elif ".engram." in name:
            parts["engram_projections"] += n
        elif ".attn." in name:
            parts["attention"] += n
        elif ".ffn.shared_experts." in name:
            parts["shared_experts"] += n
        elif name.startswith("layers."):
            parts["other_layer"] += n                  # hyper-connections, norms, MoE gate
        elif name.startswith(("head.", "norm.")):
            parts["head"] += n
        else:
            raise ValueError(f"active_parameters: parameter {name!r} has no rule (add one)")
    for layer, per in experts.items():
        sizes = set(per.values())
        if len(sizes) != 1:
            raise ValueError(f"active_parameters: {layer} has experts of different sizes {sizes}")
        if k > len(per):
            raise ValueError(f"active_parameters: num_experts_per_tok {k} > {len(per)} experts "
                             f"in {layer}")
        parts["routed_experts"] += k * sizes.pop()
    parts["total"] = sum(parts.values())
    return parts


def read_bandwidth(nbytes: int = GIB, repeats: int = 5, threads: int = 1) -> dict:
    """Bytes/s `threads` torch threads (default one) read from memory: the median time of summing
    a float32 tensor of `nbytes` (1 GiB: far past the caches), after one untimed warm-up sum.
    The caller's thread count is restored."""
    if nbytes < 4:
        raise ValueError(f"read_bandwidth: nbytes must be >= 4, got {nbytes}")
    if repeats < 1:
        raise ValueError(f"read_bandwidth: repeats must be >= 1, got {repeats}")
    if threads < 1:
        raise ValueError(f"read_bandwidth: threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device="cpu")     # host memory, by definition
        x.sum()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    med = statistics.median(times)
    return {"bytes": x.numel() * 4, "median_s": med, "bytes_per_s": x.numel() * 4 / med,
            "repeats": repeats, "threads": threads, "spread": (max(times) - min(times)) / med,
            "runs_s": times}


def bandwidth_fraction(bytes_per_token: float | None, tokens_per_s: float | None,
                       bytes_per_s: float) -> float | None:
    """(bytes of weights read per token x tokens/s) / read bandwidth; None where a side is missing."""
    if bytes_per_token is None or tokens_per_s is None:
        return None
    return bytes_per_token * tokens_per_s / bytes_per_s
