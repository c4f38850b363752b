"""The official DeepSeek-V4.1 checkpoint layout: loading it into cedlm, exporting cedlm to it.

A checkpoint layer (beside `cedlm.checkpoint`, which dispatches here for an official-layout
directory): it imports `cedlm.model`, `cedlm.config`, `cedlm.quant`, nothing above.

    layout.py    official names -> cedlm tensors (identity) and each tensor's storage format;
                 the drafter and vision components (mtp / vision / aligner / image); grouping
    dequant.py   FP8 32x32-block, packed-FP4 (MXFP4-like) and FP8 per-row dequantisers, and
                 the quantisers the export uses
    errors.py    the loader's errors (`OfficialCheckpointError`, `CheckpointTooLargeError`)
    headers.py   load step 1: shard headers, checked against the index; `is_official_layout`
    memory.py    load step 2: the float32 RAM a checkpoint needs vs. what is available
                 (`checkpoint_memory`, `available_memory`)
    plan.py      load step 3: the checkpoint's tensors matched to the model's (`plan_load`)
    load.py      load step 4: lazy, chunked, dequantising load (`load_official`,
                 `load_official_model`); re-exports the names of steps 1-3
    export.py    a CEDModel -> sharded, quantised safetensors + index + config (`export_official`)
"""
from cedlm.official.export import ExportReport, export_official, official_config
from cedlm.official.errors import CheckpointTooLargeError, OfficialCheckpointError
from cedlm.official.headers import is_official_layout, read_header
from cedlm.official.load import OfficialCheckpoint, load_official, load_official_model
from cedlm.official.memory import MemoryAccount, available_memory, checkpoint_memory
from cedlm.official.plan import LoadReport

__all__ = ["load_official", "load_official_model", "is_official_layout", "checkpoint_memory",
           "available_memory", "read_header", "export_official", "official_config",
           "OfficialCheckpoint", "LoadReport", "MemoryAccount", "ExportReport",
           "OfficialCheckpointError", "CheckpointTooLargeError"]
