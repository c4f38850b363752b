"""The official DeepSeek-V4.1 checkpoint layout: loading (cedlm.official via load_model), export.

The checkpoints here are written by a quantiser defined in THIS file, independently of
`cedlm.official`: its own table of which tensor is stored how (from
../shared/reference/v41-weight-names.txt), OCP-MX style floor scales (the export uses ceil
scales), nearest-value FP4 by table search, its own nibble packing and its own decoding. A
loaded model must give exactly the logits of a model built from this file's dequantised weights.
"""
from __future__ import annotations

import json
import math
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cedlm.checkpoint import load_model, save_checkpoint, set_token_map
from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.text.tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "cedlm" / "assets"
# The official checkpoint's tensor names, dtypes and shapes (one representative key per role).
WEIGHT_NAMES = Path(__file__).resolve().parent / "fixtures" / "v41-weight-names.txt"

# ============================================================================ independent quantiser
# Which official tensors are stored how (the weight-name file, written out again here).
_L = r"(?:layers|mtp)\.\d+"
_FP8_BLOCK = [rf"^{_L}\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$",
              rf"^{_L}\.ffn\.shared_experts\.w[123]\.weight$",
              r"^layers\.\d+\.attn\.indexer\.wq_b\.weight$", r"^layers\.\d+\.engram\.wkv\.weight$",
              r"^mtp\.\d+\.main_proj\.weight$"]
_FP4 = [rf"^{_L}\.ffn\.experts\.\d+\.w[123]\.weight$"]
_FP8_ROWS = [r"^layers\.\d+\.engram\.embed\.weight$"]
_F32 = [rf"^{_L}\.hc_(attn|ffn)_(fn|base|scale)$", rf"^{_L}\.attn\.attn_sink$",
        rf"^{_L}\.ffn\.gate\.bias(_vl)?$"]


def _kind(name: str) -> str:
    for kind, pats in (("fp8", _FP8_BLOCK), ("fp4", _FP4), ("rows", _FP8_ROWS), ("f32", _F32)):
        if any(re.match(p, name) for p in pats):
            return kind
    return "bf16"


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mx_bytes(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """OCP MX shared exponent: floor(log2 amax) - emax, as a biased E8M0 byte (0 -> scale 1)."""
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.double())), torch.full_like(amax.double(), emax))
    return (e - emax + 127).clamp(1, 254).to(torch.uint8)


def _byte_to_scale(b: torch.Tensor) -> torch.Tensor:
    return torch.tensor([2.0 ** (int(x) - 127) for x in b.flatten()], dtype=torch.float64
                        ).view(b.shape).float()


def _per_element(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    out = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = scale[i, j]
    return out


def _blocks_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    R, C = math.ceil(x.shape[0] / br), math.ceil(x.shape[1] / bc)
    return torch.tensor([[x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max().item()
                          for j in range(C)] for i in range(R)])


def ref_fp8(x: torch.Tensor, br: int, bc: int):
    """-> (float8_e4m3fn codes, float8_e8m0fnu scales [ceil(R/br), ceil(C/bc)], dequantised)."""
    b = _mx_bytes(_blocks_amax(x, br, bc), 8)                 # E4M3 max 448 = 1.75 * 2^8
    s = _per_element(_byte_to_scale(b), *x.shape, br, bc)
    q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, b.view(torch.float8_e8m0fnu), q.float() * s


def ref_fp4(x: torch.Tensor):
    """-> (int8 [N, ceil(K/2)] packed, float8_e8m0fnu [N, ceil(K/32)], dequantised)."""
    N, K = x.shape
    b = _mx_bytes(_blocks_amax(x, 1, 32), 2)                  # E2M1 max 6 = 1.5 * 2^2
    s = _per_element(_byte_to_scale(b), N, K, 1, 32)
    t = x / s
    mag = (t.abs().clamp(max=6).unsqueeze(-1) - _E2M1).abs().argmin(-1)
    codes = mag + 8 * (t < 0).long()
    deq = torch.where(t < 0, -_E2M1[mag], _E2M1[mag]) * s
    if K % 2:
        codes = torch.cat([codes, torch.zeros(N, 1, dtype=torch.long)], 1)
    packed = torch.empty(N, codes.shape[1] // 2, dtype=torch.uint8)
    for j in range(packed.shape[1]):
        packed[:, j] = (codes[:, 2 * j] + 16 * codes[:, 2 * j + 1]).to(torch.uint8)
    return packed.view(torch.int8), b.view(torch.float8_e8m0fnu), deq


def ref_decode(stored: dict, name: str, shape) -> torch.Tensor:
    """This file's own decoder of one official tensor (for checking exported files)."""
    w, kind = stored[name], _kind(name)
    if kind in ("bf16", "f32"):
        return w.float()
    sname = name[: -len(".weight")] + ".scale"
    sc = _byte_to_scale(stored[sname].view(torch.uint8))
    if kind == "fp4":
        N, K = shape
        codes = torch.stack([(w.view(torch.uint8) & 15), (w.view(torch.uint8) >> 4)], -1).view(N, -1)[:, :K].long()
        val = _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        return val * _per_element(sc, N, K, 1, 32)
    br, bc = (1, 32) if kind == "rows" else (32, 32)
    return w.float() * _per_element(sc, *shape, br, bc)


def official_tensors(model: CEDModel) -> tuple[dict, dict]:
    """(official stored tensors, the float32 weights they decode to) of a cedlm model."""
    stored, deq = {}, {}
    for name, v in model.state_dict().items():
        v = v.detach().float()
        kind = _kind(name)
        if kind == "fp8":
            q, s, d = ref_fp8(v, 32, 32)
        elif kind == "rows":
            q, s, d = ref_fp8(v, 1, 32)
        elif kind == "fp4":
            q, s, d = ref_fp4(v)
        else:
            stored[name] = v.to(torch.bfloat16) if kind == "bf16" else v
            deq[name] = stored[name].float()
            continue
        stored[name], stored[name[: -len(".weight")] + ".scale"], deq[name] = q, s, d
    return stored, deq


EXTRA = {   # a fragment of the official checkpoint's drafter and vision tensors (shapes scaled down)
    "mtp.0.attn.wq_a.weight": torch.zeros(32, 64, dtype=torch.float8_e4m3fn),
    "mtp.0.attn.wq_a.scale": torch.full((1, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    "mtp.0.ffn.experts.0.w1.weight": torch.zeros(32, 32, dtype=torch.int8),
    "mtp.0.ffn.experts.0.w1.scale": torch.full((32, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    "mtp.0.ffn.gate.bias_vl": torch.zeros(4),
    "mtp.0.main_norm.weight": torch.ones(64, dtype=torch.bfloat16),
    "vision.patch_embed.proj.weight": torch.zeros(16, 588, dtype=torch.bfloat16),
    "vision.blocks.0.attn.wqkv.weight": torch.zeros(48, 16, dtype=torch.bfloat16),
    "vision.norm.weight": torch.ones(16, dtype=torch.bfloat16),
    "aligner.w1.weight": torch.zeros(64, 144, dtype=torch.bfloat16),
    "aligner.w1.bias": torch.zeros(64, dtype=torch.bfloat16),
    "image_start": torch.zeros(64, dtype=torch.bfloat16),
    "image_end": torch.zeros(64, dtype=torch.bfloat16),
    "image_newline": torch.zeros(64, dtype=torch.bfloat16),
}


def write_official(path: Path, cfg: ModelConfig, stored: dict, tokenizer, n_shards: int = 3,
                   extra: dict | None = None) -> Path:
    """An official-layout directory: shards (Engram tables in the last), index, config, tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {**stored, **(extra or {})}
    engram = [n for n in tensors if ".engram.embed." in n]
    rest = [n for n in tensors if n not in engram]
    per = math.ceil(len(rest) / (n_shards - 1))
    groups = [rest[i * per:(i + 1) * per] for i in range(n_shards - 1)] + [engram]
    weight_map, total = {}, 0
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(path / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    d = cfg.to_dict()
    conf = {k: v for k, v in d.items() if k != "text_config"}
    conf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                   "expert_dtype": "fp4"}
    conf["text_config"] = d["text_config"]
    (path / "config.json").write_text(json.dumps(conf, indent=2))
    tokenizer.save(path)
    return path


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSETS / "tokenizer-512")


def _model(cfg: ModelConfig, seed: int = 0) -> CEDModel:
    torch.manual_seed(seed)
    m = CEDModel(cfg).eval()
    with torch.no_grad():                  # non-zero router biases, so that they matter
        for name, buf in m.named_buffers():
            if name.endswith(".ffn.gate.bias") or name.endswith(".ffn.gate.bias_vl"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    return m


def _reference(cfg: ModelConfig, deq: dict, tokenizer) -> CEDModel:
    ref = CEDModel(cfg).eval()
    ref.load_state_dict(deq, strict=True)
    set_token_map(ref, tokenizer)
    return ref


@pytest.fixture(scope="module")
def tiny_official(tmp_path_factory, tok):
    cfg = ModelConfig.preset("tiny")
    stored, deq = official_tensors(_model(cfg))
    path = write_official(tmp_path_factory.mktemp("official") / "tiny", cfg, stored, tok)
    return path, cfg, stored, deq


IDS = torch.tensor([[0, 17, 42, 300, 5, 99, 511, 2, 8, 64, 128, 256, 3, 7, 400, 401, 402, 9, 10, 11]])


def _logits(m: CEDModel) -> torch.Tensor:
    with torch.no_grad():
        return m(IDS)


# ============================================================================ loading
def test_official_layout_loads_with_dequantised_logits(tiny_official, tok):
    path, cfg, stored, deq = tiny_official
    model, tokenizer = load_model(path)                      # the public entry point dispatches
    ref = _reference(cfg, deq, tok)
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert torch.equal(model.engram_token_map, ref.engram_token_map)
    assert torch.equal(_logits(model), _logits(ref))          # same float32 weights: bit-equal
    rep = model.official_load_report
    assert rep.shards == 3 and rep.tensors == len(stored)
    assert rep.loaded == {"fp4_expert": 120, "fp8_block": 86, "fp8_rows": 2, "plain": 165}
    # No drafter or vision tensors here: none built; bias_vl loaded but unused without a tower.
    assert rep.components == {} and not hasattr(model, "mtp") and not hasattr(model, "vision")
    assert list(rep.unused.values()) == [cfg.n_layers]
    assert model.cfg.to_dict().get("quantization_config") is None   # the model is float now


def test_partial_blocks_odd_dims(tmp_path, tok):
    """Dims that are not multiples of 32 (and an odd K for FP4): ceil-shaped scales."""
    cfg = ModelConfig.preset("tiny").replace(hidden_size=45, moe_intermediate_size=21, q_lora_rank=36)
    stored, deq = official_tensors(_model(cfg, seed=1))
    assert stored["layers.0.attn.wq_a.scale"].shape == (2, 2)             # [36, 45]
    assert stored["layers.0.ffn.experts.0.w2.weight"].shape == (45, 11)   # K = 21: packed ceil(K/2)
    assert stored["layers.0.ffn.experts.0.w2.scale"].shape == (45, 1)
    assert stored["layers.1.engram.embed.scale"].shape == (240, 1)       # dim 8
    path = write_official(tmp_path / "odd", cfg, stored, tok, n_shards=2)
    model, _ = load_model(path)
    assert torch.equal(_logits(model), _logits(_reference(cfg, deq, tok)))


def test_load_official_state_dict_without_a_model(tiny_official):
    from cedlm.official import load_official
    path, cfg, _, deq = tiny_official
    ck = load_official(path)
    assert set(ck.state_dict) == set(deq)
    assert all(torch.equal(ck.state_dict[k], deq[k]) for k in deq)
    assert ck.config.to_dict()["text_config"] == cfg.to_dict()["text_config"]


def test_engram_tables_memory_mapped(tiny_official, tmp_path, tok):
    from cedlm.official import load_official_model
    path, cfg, _, deq = tiny_official
    model, rep = load_official_model(path, engram_mmap=tmp_path / "engram")
    set_token_map(model, tok)
    for layer in cfg.engram_layer_ids:
        eng = model.layers[layer].engram
        assert eng.host_table is not None and not hasattr(eng, "embed")
        assert torch.equal(torch.tensor(eng.host_table[:]), deq[f"layers.{layer}.engram.embed.weight"])
    assert "memory-mapped" in rep.engram
    assert torch.equal(_logits(model), _logits(_reference(cfg, deq, tok)))
    # A model with memory-mapped tables exports them too.
    from cedlm.official import export_official
    export_official(model, tmp_path / "re", tok, allow_cedlm_fields=True)    # the preset's float64 RoPE
    again, _ = load_model(tmp_path / "re")
    assert torch.equal(again.layers[1].engram.embed.weight,
                       torch.tensor(model.layers[1].engram.host_table[:]))


def test_large_tensors_built_on_meta_then_loaded(tiny_official, tok):
    """The skeleton leaves tensors >= meta_min_numel unallocated; all are filled by the load."""
    from cedlm.official import load_official_model
    path, cfg, _, deq = tiny_official
    model, _ = load_official_model(path, meta_min_numel=1)
    set_token_map(model, tok)
    assert not any(t.is_meta for t in model.state_dict().values())
    assert torch.equal(_logits(model), _logits(_reference(cfg, deq, tok)))


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy an official dir, applying edit(tensors) to the union of the shards (same sharding)."""
    import shutil
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(dst / f)))
        (dst / f).unlink()
    edit(tensors)
    wm = {}
    for n in tensors:
        wm[n] = index["weight_map"].get(n, "model-00001-of-00003.safetensors")
    for f in sorted(set(wm.values())):
        save_file({n: t for n, t in tensors.items() if wm[n] == f}, str(dst / f))
    index["weight_map"] = wm
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_missing_unexpected_malformed_grouped(tiny_official, tmp_path):
    from cedlm.official import OfficialCheckpointError

    def edit(t):
        for n in ("layers.0.ffn.experts.1.w1", "layers.3.ffn.experts.2.w1"):
            del t[n + ".weight"], t[n + ".scale"]
        del t["layers.5.attn.wq_a.weight"], t["layers.5.attn.wq_a.scale"]
        t["layers.0.attn.wq_c.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        t["layers.2.ffn.experts.9.w1.weight"] = torch.zeros(32, 32, dtype=torch.int8)
        t["layers.2.ffn.experts.9.w1.scale"] = torch.zeros(32, 2, dtype=torch.uint8)
        t["hc_head_fn"] = torch.zeros(2, 2)
        t["layers.4.attn.wo_b.scale"] = torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        del t["layers.6.attn.wkv.scale"]

    path = _rewrite(tiny_official[0], tmp_path / "bad", edit)
    with pytest.raises(OfficialCheckpointError) as e:
        load_model(path)
    msg = str(e.value)
    assert "3 missing, 4 unexpected, 2 malformed tensors" in msg
    assert "missing (3), by kind:" in msg
    assert "routed experts: 2" in msg and "layers.*.ffn.experts.*.w1.weight x2" in msg
    assert "attention: 1" in msg and "layers.5.attn.wq_a.weight" in msg
    assert "unexpected (4), by kind:" in msg
    assert "layers.*.ffn.experts.*.w1.scale x1" in msg and "hc_head_fn" in msg
    assert "layers.0.attn.wq_c.weight" in msg
    assert "layers.4.attn.wo_b.weight: scale [1, 1], expected [2, 2]" in msg
    assert "layers.6.attn.wkv.weight: F8_E4M3 [32, 64] without its layers.6.attn.wkv.scale" in msg


def test_index_and_shards_must_agree(tiny_official, tmp_path):
    import shutil
    from cedlm.official import OfficialCheckpointError
    path = tmp_path / "noshard"
    shutil.copytree(tiny_official[0], path)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(OfficialCheckpointError, match="1 of 3 shards named by model.safetensors.index.json"):
        load_model(path)


def _fake_header(path: Path, name: str, shape: list[int]) -> None:
    """Rewrite one tensor's declared shape (and byte range) in a shard header; data untouched."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    h = header[name]
    h["shape"] = shape
    h["data_offsets"] = [h["data_offsets"][0], h["data_offsets"][0] + math.prod(shape)]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_too_large_checkpoint_fails_early(tiny_official, tmp_path, capsys):
    import shutil
    from cedlm.official import CheckpointTooLargeError
    from cedlm.plan.report import main as plan_main
    path = tmp_path / "huge"
    shutil.copytree(tiny_official[0], path)
    shard = path / "model-00003-of-00003.safetensors"           # the Engram tables
    _fake_header(shard, "layers.4.engram.embed.weight", [1 << 40, 8])   # 8 TiB of FP8 rows
    t0 = time.perf_counter()
    with pytest.raises(CheckpointTooLargeError) as e:
        load_model(path)
    assert time.perf_counter() - t0 < 5                          # headers only, nothing built
    msg = str(e.value)
    assert "does not fit in RAM" in msg and "32,768.00 GiB" in msg     # 2^43 elements x 4 B
    assert "available" in msg and "Nothing was loaded" in msg
    assert "on disk in 3 shard(s)" in msg
    # cedlm plan tells the same from the headers.
    assert plan_main(["--checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert "load in RAM: needs" in out and "does NOT fit" in out
    # A real checkpoint against a small memory budget fails the same way.
    from cedlm.official import load_official_model
    with pytest.raises(CheckpointTooLargeError, match="does not fit in RAM"):
        load_official_model(tiny_official[0], memory_bytes=100_000)


def test_partial_drafter_or_unconfigured_vision_is_an_error(tiny_official, tmp_path, tok):
    """Drafter and vision tensors load strictly when present: a fragment of them is a layout
    error listing what is missing / unexpected by kind; vision tensors without a vision_config
    are refused by name."""
    from cedlm.official import OfficialCheckpointError
    _, cfg, stored, _ = tiny_official
    mtp = {k: v for k, v in EXTRA.items() if k.startswith("mtp.")}
    bad = write_official(tmp_path / "mtp", cfg, stored, tok, extra=mtp)
    with pytest.raises(OfficialCheckpointError, match=r"(?s)missing.*mtp \(DSpark draft stages\)"):
        load_model(bad)
    vis = {k: v for k, v in EXTRA.items() if not k.startswith("mtp.")}
    bad = write_official(tmp_path / "vis", cfg, stored, tok, extra=vis)
    with pytest.raises(OfficialCheckpointError, match="describes no vision tower"):
        load_model(bad)


def test_plan_checkpoint_fits(tiny_official, capsys):
    from cedlm.plan.report import main as plan_main
    assert plan_main(["--checkpoint", str(tiny_official[0]), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    acc = p["checkpoint"]
    assert acc["fits"] and acc["shards"] == 3
    assert acc["component_disk_bytes"] == 0
    # float32 bytes of every text-model tensor
    assert acc["ram_bytes"] == 4 * sum(t.numel() for t in tiny_official[3].values())


def test_is_official_layout(tiny_official, tmp_path, tok):
    from cedlm.official import is_official_layout
    own = save_checkpoint(tmp_path / "own", _model(ModelConfig.preset("tiny")), tok)
    assert not is_official_layout(own)
    assert is_official_layout(tiny_official[0])


# ============================================================================ export
def test_export_round_trip(tmp_path, tok, capsys):
    from cedlm.official import export_official
    cfg = ModelConfig.preset("tiny")
    model = _model(cfg, seed=3)
    set_token_map(model, tok)
    rep = export_official(model, tmp_path / "out", tok, shard_bytes=150_000, allow_cedlm_fields=True)
    assert rep.shards > 1
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert f"model-00001-of-{rep.shards:05d}.safetensors" in files
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                           "expert_dtype": "fp4"}
    assert list(conf)[list(conf).index("quantization_config") + 1] == "text_config"
    # The stored dtypes and shapes are the official ones (this file's table), and this file's
    # decoder reads the same weights the loader produces.
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    stored = {}
    for f in sorted(set(index["weight_map"].values())):
        stored.update(load_file(str(tmp_path / "out" / f)))
    assert set(stored) == set(index["weight_map"])
    loaded, _ = load_model(tmp_path / "out")
    dt = {"fp8": torch.float8_e4m3fn, "rows": torch.float8_e4m3fn, "fp4": torch.int8,
          "bf16": torch.bfloat16, "f32": torch.float32}
    for name, w in model.state_dict().items():
        kind = _kind(name)
        assert stored[name].dtype == dt[kind], name
        if kind == "fp4":
            assert stored[name].shape == (w.shape[0], w.shape[1] // 2)
            assert stored[name[:-7] + ".scale"].shape == (w.shape[0], math.ceil(w.shape[1] / 32))
        elif kind in ("fp8", "rows"):
            assert stored[name[:-7] + ".scale"].dtype == torch.float8_e8m0fnu
        assert torch.equal(loaded.state_dict()[name], ref_decode(stored, name, tuple(w.shape))), name
    # Logits: identical up to the weight quantisation (reported).
    a, b = _logits(model), _logits(loaded)
    err = (a - b).abs().max().item()
    rel = ((a - b).norm() / a.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\n[official export round trip, tiny] {rep.summary()}\n"
              f"  logits: max |diff| {err:.3e} (max |logit| {a.abs().max().item():.3f}), "
              f"relative L2 {rel:.3e}, argmax agreement {agree:.2%}")
    assert rel < 0.2
    # ... and exactly the logits of the original model with its weights replaced by their
    # quantised values (decoded here): the only difference is the weight quantisation.
    fq = CEDModel(cfg).eval()
    fq.load_state_dict({n: ref_decode(stored, n, tuple(w.shape)) for n, w in model.state_dict().items()})
    fq.engram_token_map.copy_(model.engram_token_map)
    assert torch.equal(_logits(fq), b)
    assert rep.errors["f32"]["max_abs"] == 0 and rep.errors["fp8_block"]["rel_rms"] < 0.05
    assert rep.errors["fp4_expert"]["rel_rms"] < 0.2
    # Exporting the loaded model again changes nothing: quantisation is idempotent.
    export_official(loaded, tmp_path / "again", tok, allow_cedlm_fields=True)
    again, _ = load_model(tmp_path / "again")
    assert torch.equal(_logits(again), b)


def test_cli_export_official(tmp_path, tok):
    from cedlm.cli import main
    src = save_checkpoint(tmp_path / "run" / "checkpoint", _model(ModelConfig.preset("tiny")), tok)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "off"), "--format", "official",
                 "--shard-size", "200K", "--allow-cedlm-fields"]) == 0
    a, _ = load_model(src)
    b, _ = load_model(tmp_path / "off")
    assert len(list((tmp_path / "off").glob("model-*-of-*.safetensors"))) >= 2
    assert (_logits(a) - _logits(b)).norm() / _logits(a).norm() < 0.2


def test_export_refuses_what_an_official_engine_reads_differently(tmp_path, tok, capsys):
    """The Engram map, the RoPE precision and the tokenizer live where an engine following the
    official config reads them the same, or the export is a one-line error saying what would
    change; --allow-cedlm-fields exports anyway."""
    from cedlm.cli import main
    cfg = ModelConfig.preset("tiny").replace(engram_token_map="legacy-v0", rope_precision="float64",
                                             eos_token_id=7)
    model = _model(cfg)
    set_token_map(model, tok)
    save_checkpoint(tmp_path / "ck", model, tok)
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "off"), "--format", "official"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not (tmp_path / "off").exists()
    assert "Engram token map 'legacy-v0'" in err and "token ids would hash with another" in err
    assert "RoPE precision 'float64'" in err and "float32" in err
    assert "its eos is id 1, config.json says 7" in err and "--allow-cedlm-fields" in err
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "off"), "--format", "official",
                 "--allow-cedlm-fields"]) == 0
    assert load_model(tmp_path / "off")[0].cfg.engram_token_map == "legacy-v0"   # cedlm reads it back
    official = ModelConfig.preset("tiny").replace(rope_precision="float32")
    save_checkpoint(tmp_path / "ok", _model(official), tok)
    assert main(["export", str(tmp_path / "ok"), str(tmp_path / "off2"), "--format", "official"]) == 0


def test_export_rejects_the_decoder_only_baseline(tmp_path):
    from cedlm.model import DecoderOnlyModel
    from cedlm.official import export_official
    with pytest.raises(ValueError, match="CED model"):
        export_official(DecoderOnlyModel(ModelConfig.preset("tiny").replace(arch="decoder_only")), tmp_path / "x")


# ============================================================================ layout vs reference
def test_layout_totals_match_the_official_checkpoint():
    """Every tensor of the full V4.1-Flash (text, DSpark, vision) stored as layout.py says:
    96,085 tensors and 475.24 GiB, the totals of the official index and shard headers."""
    from cedlm.config.params import param_inventory
    from cedlm.official import layout as L
    from cedlm.official.export import stored_bytes
    cfg = ModelConfig.preset("deepseek-v4.1-flash")
    names = [(t.name, tuple(t.shape)) for part in ("main", "dspark", "vision")
             for t in param_inventory(cfg, part)]
    for pre, n, k in [("layers", cfg.n_layers, cfg.n_routed_experts),
                      ("mtp", cfg.num_nextn_predict_layers, cfg.dspark_n_routed_experts)]:
        names += [(f"{pre}.{i}.ffn.gate.{b}", (k,)) for i in range(n) for b in ("bias", "bias_vl")]
    count = sum(2 if L.storage_format(n) in L.QUANTISED else 1 for n, _ in names)
    total = sum(stored_bytes(n, s) for n, s in names)
    assert count == 96_085
    assert round(total / 2 ** 30, 2) == 475.24
    experts = sum(stored_bytes(n, s) for n, s in names if ".ffn.experts." in n)
    assert round(experts / 2 ** 30, 2) == 275.67
    assert sum(1 for n, _ in names if ".ffn.experts." in n) * 2 == 94_464


@pytest.mark.skipif(not WEIGHT_NAMES.exists(), reason="reference/v41-weight-names.txt not here")
def test_layout_dtypes_match_the_weight_name_file():
    from cedlm.official import layout as L
    checked = 0
    for line in WEIGHT_NAMES.read_text().splitlines():
        if line.startswith("#") or "|" not in line:
            continue
        key, dtype = (c.strip() for c in line.split("|")[:2])
        name = re.sub(r"\.[LESB]\.", ".0.", key).replace("layers.L.", "layers.0.")
        if L.is_scale(name):
            assert dtype == L.SCALE_DTYPE, key
            assert L.storage_format(L.weight_of_scale(name)) in L.QUANTISED, key
        else:
            assert L.STORED_DTYPE[L.storage_format(name)] == dtype, key
            assert L.STORED_DTYPE[_kind_map(_kind(name))] == dtype, key      # this file's table too
        checked += 1
    assert checked >= 80


def _kind_map(k: str) -> str:
    return {"fp8": "fp8_block", "rows": "fp8_rows", "fp4": "fp4_expert", "bf16": "bf16", "f32": "f32"}[k]


# ============================================================================ formats
def test_dequantisers_match_this_files_decoder():
    """cedlm.official.dequant decodes this file's independently quantised tensors exactly,
    partial blocks included; its own quantisers round within half an E4M3 / E2M1 step."""
    from cedlm.official.dequant import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block
    torch.manual_seed(0)
    x = torch.randn(45, 70) * torch.logspace(-3, 2, 70)
    q, s, d = ref_fp8(x, 32, 32)
    assert s.shape == (2, 3)
    assert torch.equal(dequant_fp8_block(q, s), d)
    p, s4, d4 = ref_fp4(x[:, :45])
    assert p.shape == (45, 23) and s4.shape == (45, 2)
    assert torch.equal(dequant_fp4(p, s4, k=45), d4)
    q2, s2 = quant_fp8_block(x)
    scale = _per_element(_byte_to_scale(s2.view(torch.uint8)), 45, 70, 32, 32)
    assert ((dequant_fp8_block(q2, s2) - x).abs() <= scale * 16 + 1e-30).all()  # 448-range, 3 bits
    assert (x.abs() / scale <= 448).all()                                       # ceil: no clipping
    p2, s5 = quant_fp4(x[:, :45])
    sc5 = _per_element(_byte_to_scale(s5.view(torch.uint8)), 45, 45, 1, 32)
    assert ((dequant_fp4(p2, s5, k=45) - x[:, :45]).abs() <= sc5 + 1e-30).all()  # half of step 2
    name = "layers.0.ffn.experts.0.w1"
    assert torch.equal(ref_decode({f"{name}.weight": p2, f"{name}.scale": s5}, f"{name}.weight",
                                  (45, 45)), dequant_fp4(p2, s5, k=45))
