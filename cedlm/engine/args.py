"""`EngineArgs`: every engine option in one place, the one surface `LLM`, `cedlm serve`,
`cedlm generate` and `cedlm bench` share; defaults are written here once.

`EngineConfig` is the part the `Engine` itself reads (memory, batching, prefill); `EngineArgs`
adds how the model is loaded and run (threads, Engram offload, speculative decoding, the KV
store, the device). Each field's command-line flag is its name with dashes (`--max-num-seqs`), except the
spellings kept from before: `--kv-budget` (kv_budget_bytes, with K/M/G suffixes), `--threads`
(num_threads), `--no-prefix-cache` (enable_prefix_cache). `add_cli_args` adds the flags to a
parser; `EngineArgs.from_cli(namespace)` reads them back.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from cedlm.config.modes import DECODE_STEPS, PREFILL_MODES, REPLAY_MODES
from cedlm.config.modes import SPEC_METHODS as METHODS, SPEC_POLICIES as POLICIES

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(s: str) -> int:
    """'268435456', '256M', '256MiB', '1.5G', '512k' -> bytes (binary multiples)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(s))
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size like 268435456, 256M or 1G")
    n = int(float(m.group(1)) * _SUFFIX[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {s!r}")
    return n


def _opt(default, help: str, flag: str | None = None, none: str | None = None, **cli) -> Any:
    """A field with its flag's help; `none`: what a None default means, for the help."""
    return field(default=default, metadata={"help": help, "flag": flag, "cli": cli, "none": none})


@dataclass
class EngineConfig:
    """What the engine reads: KV memory, batching, prefill and replay."""
    kv_budget_bytes: int = _opt(256 << 20, "KV-cache bytes (pool + windows); suffixes K/M/G (binary)",
                                "--kv-budget", type=parse_bytes)
    max_num_seqs: int = _opt(16, "sequences the engine runs at once", type=int)
    block_tokens: int = _opt(64, "tokens per KV block (rounded to the model's KV layout)", type=int)
    prefill_chunk: int = _opt(512, "prompt tokens per prefill chunk (the scheduler's chunk size)", type=int)
    max_prefills_while_decoding: int = _opt(1, "prefill chunks per engine step while sequences decode "
                                            "(each prefill holds every running stream for its time; with "
                                            "nothing decoding every admitted prompt gets its chunk)", type=int)
    prefill_mode: str = _opt("bounded", "which prompt rows run the decoder", choices=list(PREFILL_MODES))
    replay_mode: str = _opt("bounded", "window rebuild after a prefix-cache hit", choices=list(REPLAY_MODES))
    enable_prefix_cache: bool = _opt(True, "share KV blocks of common prompt prefixes", "--no-prefix-cache")
    max_model_len: int | None = _opt(None, "context length (default: the model's max_position_embeddings)",
                                     type=int)
    decode_step: str | None = _opt(None, "how a decode step runs: compiled (the static step "
                                   "through torch.compile), cudagraph (the static step captured as CUDA "
                                   "graphs), static (the same step uncompiled), eager (the reference "
                                   "model.decode); default $CEDLM_DECODE_STEP, else cudagraph on CUDA "
                                   "and compiled on the CPU", choices=list(DECODE_STEPS))

    def __post_init__(self):
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode: {self.prefill_mode!r} is not one of {PREFILL_MODES}")
        if self.replay_mode not in REPLAY_MODES:
            raise ValueError(f"replay_mode: {self.replay_mode!r} is not one of {REPLAY_MODES}")
        for name in ("kv_budget_bytes", "max_num_seqs", "block_tokens", "prefill_chunk",
                     "max_prefills_while_decoding"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.decode_step is not None and self.decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step: {self.decode_step!r} is not one of {DECODE_STEPS}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {self.max_model_len}")


@dataclass
class EngineArgs(EngineConfig):
    """Every engine option: `EngineConfig` plus loading and decoding options."""
    speculative: str | None = _opt(None, "speculative decoding with the model's DSpark drafter "
                                   "(mtp.safetensors)", nargs="?", const="dspark", metavar="METHOD")
    speculative_threshold: float = _opt(0.0, "verify drafts while the product of their confidences "
                                        "is >= this (0: the whole block)", type=float)
    num_draft_tokens: int | None = _opt(None, "at most this many drafts per block (default: the "
                                        "drafter's block size)", type=int)
    speculative_policy: str = _opt("adaptive", "when to speculate: adaptive (each step, where the "
                                   "measured acceptance and step costs say drafting pays; plain decode "
                                   "steps otherwise) or always (every step)", choices=list(POLICIES))
    num_threads: int | None = _opt(None, "torch intra-op threads (1 is fastest for small models on "
                                   "a busy machine)", "--threads", type=int)
    engram_mmap: str | None = _opt(None, "directory to memory-map the Engram tables from (host "
                                   "memory / disk)")
    seed: int = _opt(0, "seed for a preset's random weights", "--seed", type=int)
    device: str | None = _opt(None, "where the model, its KV cache and the sampler live: auto (CUDA "
                              "when this torch build sees a GPU, else the CPU), cpu, cuda or cuda:N",
                              none="auto", metavar="DEVICE")
    store: Any = field(default=None, metadata={"help": "KV store (path, redis:// URL or object)"})
    store_capacity_bytes: int | None = _opt(None, "byte budget of a store given as a path or URL: the "
                                            "least recently used entries are evicted beyond it (default: "
                                            "8 GiB for a directory store, none for Redis)", type=parse_bytes)

    def __post_init__(self):
        super().__post_init__()
        if self.speculative is not None and self.speculative not in METHODS:
            raise ValueError(f"speculative: unknown method {self.speculative!r} (expected one of {METHODS})")
        if self.speculative is None and (self.speculative_threshold or self.num_draft_tokens is not None
                                         or self.speculative_policy != "adaptive"):
            raise ValueError("speculative: speculative_threshold / num_draft_tokens / speculative_policy "
                             "need speculative='dspark'")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        self.speculative_config()               # its own checks (threshold range, ...)
        self.resolved_device()                  # a device this torch cannot use fails here

    def resolved_device(self):
        """The `torch.device` the engine runs on (`cedlm.util.resolve_device`: None / "auto" ->
        CUDA when available, else the CPU); a ValueError naming `device` for one it cannot use."""
        from cedlm.util import resolve_device
        return resolve_device(self.device, "device")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})

    def speculative_config(self) -> "SpeculativeConfig | None":
        if self.speculative is None:
            return None
        from cedlm.engine.speculative import SpeculativeConfig
        return SpeculativeConfig(self.speculative, self.speculative_threshold, self.num_draft_tokens,
                                 self.speculative_policy)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, *, skip: tuple[str, ...] = (), **overrides) -> "EngineArgs":
        """The options `add_cli_args` put on a parsed namespace (absent ones, and those in skip,
        keep their defaults), with `overrides` on top."""
        kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
              if hasattr(ns, f.name) and f.name not in skip}
        return cls(**{**kw, **overrides})


def add_cli_args(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = (), **defaults) -> None:
    """Add one flag per EngineArgs field (but the store's and those in skip); `defaults` overrides a
    field's default for this command (say why where you pass one)."""
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip or f.name in ("store", "store_capacity_bytes"):
            continue
        default = defaults.get(f.name, f.default)
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        shown = default if default is not None else f.metadata.get("none")
        help = f.metadata["help"] + ("" if shown is None else f" (default: {shown})")
        names = [flag] + ([flag.replace("-", "_").replace("__", "--", 1)] if "-" in flag[2:] else [])
        if f.name == "enable_prefix_cache":
            p.add_argument(flag, dest=f.name, action="store_false", default=default,
                           help="no prefix cache: every prompt is computed from scratch")
            continue
        p.add_argument(*names, dest=f.name, default=default, help=help, **f.metadata["cli"])
