"""Accounting and capacity planning: KV bytes, window bytes, parameter counts, sequences that fit.

Everything here is computed from a `ModelConfig` alone (no model is built), so the same code
serves the official full-size configs and the small runnable presets. For the runnable presets
the numbers are pinned to what the code allocates (tests compare them with `SequenceState.nbytes()`
and `CEDModel.num_parameters()`).

    entry_bytes(cfg, fmt, dim)        bytes of one stored entry in a KV format
    kv_bytes_per_token(cfg)           global (context-proportional) KV bytes per token, by part
    window_bytes_per_sequence(cfg)    fixed per-sequence bytes: SWA rings, DSpark rings, compressor
    param_inventory(cfg)              every parameter tensor (name, shape, group, layer)
    param_counts(cfg)                 total / Engram / DSpark / vision / active prefill & decode
    plan(cfg, context, memory_gib)    the whole account plus sequences that fit (JSON-stable keys)
    format_plan(plan_dict)            a human table
    add_parser(subparsers) / main()   the `cedlm plan` command (`python -m cedlm.plan ...`)

Conventions (also listed in each plan's `assumptions`):

* GiB = 2^30 bytes, MiB = 2^20 bytes.
* A token's global KV is the sum over KV-source layers of (entry bytes / compress ratio) for the
  main KV and, where the source owns index keys, the index keys. Reuse/Reindex layers own nothing.
* `bytes_per_sequence` at context C = sum over sources of floor(C / r) entries (what is allocated;
  equals kv_bytes_per_token x C when C is a multiple of every ratio) + the SWA rings of every
  layer + the DSpark rings + the largest compressor pending state. Token ids, ring positions and
  allocator slack are not counted.
* Parameters are learnable weights, counted as numbers of elements. Router selection biases
  (`ffn.gate.bias`, `ffn.gate.bias_vl`) are buffers in cedlm and not counted (they are 2 x experts
  per layer, negligible); `.scale` tensors of the quantised checkpoint are not parameters.
"""
from __future__ import annotations

from cedlm.plan.capacity import (DEVICES, EXAMPLE_CONTEXTS, EXAMPLE_MODELS, PLAN_KEYS,
                                 concurrency_example, max_sequences, plan, sequence_bytes)
from cedlm.plan.kvbytes import GIB, MIB, entry_bytes, kv_bytes_per_token, window_bytes_per_sequence
from cedlm.plan.params import Tensor, param_counts, param_inventory, vision_config
from cedlm.plan.report import add_parser, format_plan, main, run

__all__ = ["DEVICES", "EXAMPLE_CONTEXTS", "EXAMPLE_MODELS", "GIB", "MIB", "Tensor", "vision_config",
           "PLAN_KEYS", "plan", "sequence_bytes", "max_sequences", "concurrency_example",
           "entry_bytes", "kv_bytes_per_token", "window_bytes_per_sequence", "param_counts",
           "param_inventory", "format_plan", "add_parser", "main", "run"]
