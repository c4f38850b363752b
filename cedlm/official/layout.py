"""Which official tensor names map to which cedlm tensors, and how each is stored.

cedlm's state-dict names ARE the official text-model names (`embed.weight`,
`layers.L.attn.wq_a.weight`, `layers.L.ffn.experts.E.w1.weight`, `layers.L.engram.embed.weight`,
...; no "model." prefix), so the mapping is the identity on names; what differs is the storage
(the official checkpoint's safetensors index, DeepSeek-V4.1-Flash revision dba1be0):

    format      official dtype (+ sibling "<name>.scale" F8_E8M0)        tensors
    fp8_block   F8_E4M3 [N, K], scale [ceil(N/32), ceil(K/32)]           attn.{wq_a, wq_b, wkv, wo_a, wo_b},
                                                                         ffn.shared_experts.w{1,2,3},
                                                                         attn.indexer.wq_b, engram.wkv,
                                                                         mtp.0.main_proj
    fp4_expert  I8 [N, K/2] (E2M1 pairs, even = low nibble),              ffn.experts.E.w{1,2,3}
                scale [N, K/32]
    fp8_rows    F8_E4M3 [rows, dim], scale [rows, dim/32]                 engram.embed (hash tables)
    f32         F32                                                      hc_{attn,ffn}_{fn,base,scale},
                                                                         attn.attn_sink, ffn.gate.bias(_vl)
    bf16        BF16                                                     everything else: embed, head, norms,
                                                                         router weight, compressor, indexer
                                                                         wk / k_norm / weights_proj,
                                                                         engram q_weight / k_weight

Components beside the text model, loaded strictly when the checkpoint has them (`components`):
`mtp.*` (the DSpark draft stages: the model gets its drafter) and `vision.*`, `aligner.*`,
`image_*` (the vision tower, aligner and learned image delimiter rows: the model gets its tower
when config.json describes one). The per-layer `ffn.gate.bias_vl` (routing bias of image-span
tokens) has a cedlm buffer: it is loaded there (absent: it stays zero); without a vision tower it
is reported as unused.
"""
from __future__ import annotations

import re
from collections import defaultdict

FP8_BLOCK = "fp8_block"
FP4_EXPERT = "fp4_expert"
FP8_ROWS = "fp8_rows"
BF16 = "bf16"
F32 = "f32"
QUANTISED = (FP8_BLOCK, FP4_EXPERT, FP8_ROWS)
FORMATS = (FP8_BLOCK, FP4_EXPERT, FP8_ROWS, BF16, F32)

SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"

# safetensors dtype strings of the official storage.
STORED_DTYPE = {FP8_BLOCK: "F8_E4M3", FP4_EXPERT: "I8", FP8_ROWS: "F8_E4M3", BF16: "BF16",
                F32: "F32"}
SCALE_DTYPE = "F8_E8M0"

_LAYER = r"(?:layers|mtp)\.\d+"
_PATTERNS: list[tuple[str, re.Pattern]] = [
    (FP4_EXPERT, re.compile(rf"^{_LAYER}\.ffn\.experts\.\d+\.w[123]\.weight$")),
    (FP8_ROWS, re.compile(r"^layers\.\d+\.engram\.embed\.weight$")),
    (FP8_BLOCK, re.compile(rf"^{_LAYER}\.attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)\.weight$")),
    (FP8_BLOCK, re.compile(rf"^{_LAYER}\.ffn\.shared_experts\.w[123]\.weight$")),
    (FP8_BLOCK, re.compile(r"^layers\.\d+\.attn\.indexer\.wq_b\.weight$")),
    (FP8_BLOCK, re.compile(r"^layers\.\d+\.engram\.wkv\.weight$")),
    (FP8_BLOCK, re.compile(r"^mtp\.\d+\.main_proj\.weight$")),
    (F32, re.compile(rf"^{_LAYER}\.hc_(?:attn|ffn)_(?:fn|base|scale)$")),
    (F32, re.compile(rf"^{_LAYER}\.attn\.attn_sink$")),
    (F32, re.compile(rf"^{_LAYER}\.ffn\.gate\.bias(?:_vl)?$")),
]

# Official tensors outside the text model: prefix -> kind; and which component each belongs to.
COMPONENT_PREFIXES = {"mtp.": "mtp (DSpark draft stages)", "vision.": "vision tower",
                      "aligner.": "vision aligner", "image_": "image delimiter rows"}
MTP_PREFIXES = ("mtp.",)
VISION_PREFIXES = ("vision.", "aligner.", "image_")
UNUSED_SUFFIXES = {".ffn.gate.bias_vl": "ffn.gate.bias_vl (image-token routing bias; loaded, "
                                        "unused without a vision tower)"}


def storage_format(name: str) -> str:
    """The official storage format of a tensor name (a cedlm name or an official one)."""
    for fmt, pat in _PATTERNS:
        if pat.match(name):
            return fmt
    return BF16


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.scale` (the official sibling of a quantised weight)."""
    base = weight_name[: -len(WEIGHT_SUFFIX)] if weight_name.endswith(WEIGHT_SUFFIX) else weight_name
    return base + SCALE_SUFFIX


def weight_of_scale(name: str) -> str:
    return name[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX


def component_kind(name: str) -> str | None:
    """The kind of a tensor outside the text model (None: part of the text model)."""
    for prefix, kind in COMPONENT_PREFIXES.items():
        if name.startswith(prefix):
            return kind
    return None


def components(names) -> tuple[bool, bool]:
    """(has the DSpark drafter, has the vision tower) for a checkpoint's tensor names: what a
    loader builds (`cedlm.official.load.model_for_weights`; both layouts)."""
    names = list(names)
    return (any(n.startswith(MTP_PREFIXES) for n in names),
            any(n.startswith(VISION_PREFIXES) for n in names))


def unused_kind(name: str) -> str | None:
    for suffix, kind in UNUSED_SUFFIXES.items():
        if name.endswith(suffix) and not name.startswith("mtp."):
            return kind
    return None


def optional(name: str) -> bool:
    """cedlm tensors an official checkpoint may lack (they keep their built value)."""
    return unused_kind(name) is not None


# ----------------------------------------------------------------------------- grouping
def category(name: str) -> str:
    """A human group for error messages and reports."""
    kind = component_kind(name)
    if kind:
        return kind
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_experts." in name:
        return "shared experts"
    if ".ffn.gate." in name:
        return "router"
    if ".engram." in name:
        return "engram"
    if ".attn.compressor." in name or ".attn.indexer." in name:
        return "compressor / indexer"
    if ".attn." in name:
        return "attention"
    if ".hc_" in name or name.endswith("_norm.weight"):
        return "norms and hyper-connections"
    if name in ("embed.weight", "head.weight", "norm.weight"):
        return "embedding, head, final norm"
    return "other"


def pattern(name: str) -> str:
    """`layers.3.ffn.experts.17.w1.weight` -> `layers.*.ffn.experts.*.w1.weight`."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def group(names) -> dict[str, dict[str, list[str]]]:
    """names -> {category: {pattern: [names...]}} (sorted)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for n in sorted(names):
        out[category(n)][pattern(n)].append(n)
    return {c: dict(sorted(p.items())) for c, p in sorted(out.items())}


def format_groups(names, indent: str = "  ", examples: int = 2) -> list[str]:
    """One line per (category, pattern): count and the first names."""
    lines = []
    for cat, pats in group(names).items():
        total = sum(len(v) for v in pats.values())
        lines.append(f"{indent}{cat}: {total}")
        for pat, ns in pats.items():
            eg = ", ".join(ns[:examples]) + (", ..." if len(ns) > examples else "")
            lines.append(f"{indent}  {pat} x{len(ns)}" + ("" if ns == [pat] else f" ({eg})"))
    return lines
