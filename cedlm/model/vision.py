"""The V4.1 vision front end: a native ViT with 2-D RoPE, the 3x3-unfold aligner, the learned
image delimiter rows, and the splice of image-span embeddings into the token embeddings.

Official parameter names (top level of the checkpoint, beside `embed.weight`):

    vision.patch_embed.proj.{weight [Dv, 3*p*p], bias}      patch (c, y, x)-flattened -> Dv
    vision.blocks.B.{norm1, norm2}.weight                   RMSNorm (eps 1e-6)
    vision.blocks.B.attn.wqkv.{weight [3Dv, Dv], bias}      fused q|k|v, heads of Dv/H dims
    vision.blocks.B.attn.wo.{weight, bias}
    vision.blocks.B.mlp.w1.weight [2I, Dv]                  fused gate|up, SwiGLU
    vision.blocks.B.mlp.w2.weight [Dv, I]
    vision.norm.weight
    aligner.w1.{weight [D, Dv*r*r], bias}, aligner.w2.{weight [D, D], bias}   Linear-GELU-Linear
    image_start, image_newline, image_end [D]

An image of n_vit_h x n_vit_w patches (row-major) runs through bidirectional attention with a
2-D RoPE over the whole head: the first half of the head's rotated pairs (i, i + hd/2) turn with
the patch row, the second half with the patch column, at frequencies theta^(-2j/(hd/2)).
The aligner pads the patch grid with zeros to multiples of r (bottom, right), and each r x r
neighbourhood (channel-major: c, dy, dx, as `F.unfold`) becomes one row of Dv*r*r inputs.
Its n_llm_h x n_llm_w outputs fill the image span in reading order:

    [image_start] ([row_0 .. row_{w-1}] [image_newline]) * n_llm_h [image_end]

Every span position carries `image_token_id` in the token ids (how routing and Engram know it).
`span_embeds_reference` builds the span position by position (readable); `span_embeds` builds
it with one scatter; a test compares them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cedlm.config.vision import VisionConfig
from cedlm.model.norm import RMSNorm

IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = range(4)
VISION_EPS = 1e-6


def rope_2d_angles(n_h: int, n_w: int, head_dim: int, theta: float,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """[n_h * n_w, head_dim / 2] angles of patch (i, j) (row-major): columns 0..hd/4-1 are
    i * f_k, columns hd/4..hd/2-1 are j * f_k, with f_k = theta^(-2k / (hd/2)); on `device`."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))   # [hd/4]
    ii = torch.arange(n_h, dtype=torch.float32, device=device).repeat_interleave(n_w)
    jj = torch.arange(n_w, dtype=torch.float32, device=device).repeat(n_h)
    return torch.cat((ii[:, None] * inv, jj[:, None] * inv), dim=1)


def apply_rope_2d(x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd]; ang [N, hd/2]: rotate the pair (k, k + hd/2) by ang[:, k] (halves layout)."""
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * vc.patch_size ** 2, vc.hidden_size, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.h, self.hd = vc.num_attention_heads, vc.head_dim
        self.wqkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size, bias=True)
        self.wo = nn.Linear(vc.hidden_size, vc.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
        """x [..., N, Dv]: the N patches of one image (per leading index), full bidirectional
        attention among them."""
        lead = x.shape[:-1]
        q, k, v = (t.view(*lead, self.h, self.hd) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rope_2d(q, ang), apply_rope_2d(k, ang)
        o = F.scaled_dot_product_attention(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2))
        return self.wo(o.transpose(-3, -2).reshape(*lead, -1))


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(vc.hidden_size, 2 * vc.intermediate_size, bias=False)   # gate | up
        self.w2 = nn.Linear(vc.intermediate_size, vc.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(vc.hidden_size, VISION_EPS)
        self.attn = VisionAttention(vc)
        self.norm2 = RMSNorm(vc.hidden_size, VISION_EPS)
        self.mlp = VisionMLP(vc)

    def forward(self, x: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), ang)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.num_hidden_layers))
        self.norm = RMSNorm(vc.hidden_size, VISION_EPS)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [..., n_h * n_w, 3, p, p] (row-major; optional leading batch of images of one
        grid) -> [..., n_h * n_w, Dv]."""
        if patches.shape[-4] != n_h * n_w:
            raise ValueError(f"patches: {patches.shape[0]} for a {n_h}x{n_w} grid")
        w = self.patch_embed.proj.weight                 # patches come from the host: moved here
        ang = rope_2d_angles(n_h, n_w, self.vc.head_dim, self.vc.rope_theta, w.device)
        x = self.patch_embed.proj(patches.to(w.device, w.dtype).flatten(-3))
        for blk in self.blocks:
            x = blk(x, ang)
        return self.norm(x)


def unfold_3x3(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[(B,) n_h * n_w, C] patch features -> [(B,) ceil(n_h/r) * ceil(n_w/r), C*r*r]: zero-pad to
    multiples of r (bottom, right), then each r x r block flattened channel-major (c, dy, dx)."""
    one = x.dim() == 2
    g = x.reshape(-1, n_h, n_w, x.shape[-1]).permute(0, 3, 1, 2)
    g = F.pad(g, (0, -n_w % r, 0, -n_h % r))
    out = F.unfold(g, r, stride=r).transpose(1, 2)
    return out[0] if one else out


def unfold_reference(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """`unfold_3x3` written out with loops (the readable reference)."""
    C = x.shape[1]
    g = x.view(n_h, n_w, C)
    rows = []
    for bi in range(-(-n_h // r)):
        for bj in range(-(-n_w // r)):
            v = x.new_zeros(C, r, r)
            for dy in range(r):
                for dx in range(r):
                    i, j = bi * r + dy, bj * r + dx
                    if i < n_h and j < n_w:
                        v[:, dy, dx] = g[i, j]
            rows.append(v.reshape(-1))
    return torch.stack(rows)


class Aligner(nn.Module):
    def __init__(self, vc: VisionConfig, hidden: int):
        super().__init__()
        self.r = vc.downsample_ratio
        self.w1 = nn.Linear(vc.hidden_size * self.r ** 2, hidden, bias=True)
        self.w2 = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(unfold_3x3(x, n_h, n_w, self.r))))


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """The span roles in reading order: start, (IMAGE * w, newline) * h, end."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEWLINE]) * n_llm_h + [IMAGE_END]


def span_embeds_reference(rows: torch.Tensor, n_llm_h: int, n_llm_w: int, start, newline, end):
    """rows [h*w, D] aligner outputs -> [h*(w+1)+2, D], position by position."""
    out, k = [], 0
    for t in span_types(n_llm_h, n_llm_w):
        if t == IMAGE:
            out.append(rows[k])
            k += 1
        else:
            out.append({IMAGE_START: start, IMAGE_NEWLINE: newline, IMAGE_END: end}[t])
    return torch.stack(out)


def span_embeds(rows: torch.Tensor, n_llm_h: int, n_llm_w: int, start, newline, end):
    """The same span, as a grid with a newline column between start and end."""
    D = rows.shape[-1]
    grid = torch.cat((rows.view(n_llm_h, n_llm_w, D),
                      newline.to(rows.dtype).expand(n_llm_h, 1, D)), dim=1).reshape(-1, D)
    return torch.cat((start.to(rows.dtype)[None], grid, end.to(rows.dtype)[None]))


def add_vision(model: nn.Module, vc: VisionConfig, hidden: int) -> None:
    """Register the official-name vision modules on a model (after its text weights are
    initialised, so a text model's RNG use is unchanged): `vision`, `aligner`, `image_*`."""
    model.vision = ViT(vc)
    model.aligner = Aligner(vc, hidden)
    for name in ("image_start", "image_end", "image_newline"):
        setattr(model, name, nn.Parameter(torch.randn(hidden) * 0.02))


def encode_image(model: nn.Module, patches: torch.Tensor, vit_grid, llm_grid) -> torch.Tensor:
    """One preprocessed image -> its span embeddings [n_llm_h*(n_llm_w+1)+2, D] (fp32); with a
    leading batch of same-grid images, [B, L, D]."""
    (n_h, n_w), (lh, lw) = vit_grid, llm_grid
    rows = model.aligner(model.vision(patches, n_h, n_w), n_h, n_w)
    if rows.shape[-2] != lh * lw:
        raise ValueError(f"image: aligner gave {rows.shape[-2]} rows for an llm grid {lh}x{lw}")
    if rows.dim() == 3:
        return torch.stack([span_embeds(r.float(), lh, lw, model.image_start, model.image_newline,
                                        model.image_end) for r in rows])
    return span_embeds(rows.float(), lh, lw, model.image_start, model.image_newline, model.image_end)


def splice(x: torch.Tensor, pos: torch.Tensor, spans, first: tuple[int, ...] | None = None) -> torch.Tensor:
    """Replace token embeddings by image-span embeddings.

    x [B, T, D] embeddings of rows at positions pos [B, T] (contiguous per row); spans: per batch
    row a list of (start position, embeds [L, D]); first: pos[:, 0] when the caller knows them
    (no read of a device tensor). Rows of a span outside this pass are skipped (a chunk may cut
    an image span)."""
    if not spans or not any(spans):
        return x
    x = x.clone()
    for b, row in enumerate(spans):
        if not row:
            continue
        p0, T = (first[b] if first is not None else int(pos[b, 0])), x.shape[1]
        for s, emb in row:
            lo, hi = max(s, p0), min(s + emb.shape[0], p0 + T)
            if lo < hi:
                x[b, lo - p0: hi - p0] = emb[lo - s: hi - s].to(x.device, x.dtype)
    return x
