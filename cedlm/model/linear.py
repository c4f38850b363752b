"""Linear layers that multiply the same input, as one matrix: their weights concatenated along the
output dimension, each layer's weight made a view of its rows (same storage, nothing copied
twice; a later load writes both). The static step reads the fused matrices (one product instead
of several); the modules keep computing with their own views."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def concat_weights(linears) -> tuple[torch.Tensor, list[int]]:
    """(weight [sum of outs, in], each linear's out size); the linears' weights become views."""
    W = torch.cat([m.weight.detach() for m in linears])
    sizes, at = [], 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = W[at: at + n]
        sizes.append(n)
        at += n
    return W, sizes


def fuse(named) -> tuple[torch.Tensor, list[str], list[int]]:
    """named [(name, linear)] -> (weight, names, sizes) for `project`."""
    W, sizes = concat_weights([m for _, m in named])
    return W, [name for name, _ in named], sizes


def project(fused, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """fused = (weight, names, sizes): {name: x @ its rows^T} from one product."""
    W, names, sizes = fused
    return dict(zip(names, F.linear(x, W).split(sizes, -1)))
