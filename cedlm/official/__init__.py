"""The official DeepSeek-V4.1 checkpoint layout: loading it into cedlm, exporting cedlm to it.

A checkpoint layer (beside `cedlm.checkpoint`, which dispatches here for an official-layout
directory): it imports `cedlm.model`, `cedlm.config`, `cedlm.quant`, nothing above.

    layout.py    official names -> cedlm tensors (identity) and each tensor's storage format;
                 skipped kinds (mtp / vision / aligner / image); grouping for error messages
    dequant.py   FP8 32x32-block, packed-FP4 (MXFP4-like) and FP8 per-row dequantisers, and
                 the quantisers the export uses
    load.py      headers -> early memory check -> layout check -> lazy, chunked, dequantising
                 load (`load_official`, `load_official_model`, `checkpoint_memory`)
    export.py    a CEDModel -> sharded, quantised safetensors + index + config (`export_official`)
"""
from cedlm.official.export import ExportReport, export_official, official_config
from cedlm.official.load import (CheckpointTooLargeError, LoadReport, MemoryAccount,
                                 OfficialCheckpoint, OfficialCheckpointError, available_memory,
                                 checkpoint_memory, is_official_layout, load_official,
                                 load_official_model, read_header)

__all__ = ["load_official", "load_official_model", "is_official_layout", "checkpoint_memory",
           "available_memory", "read_header", "export_official", "official_config",
           "OfficialCheckpoint", "LoadReport", "MemoryAccount", "ExportReport",
           "OfficialCheckpointError", "CheckpointTooLargeError"]
