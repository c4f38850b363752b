"""`cedlm bench --device`: the device is resolved and printed at start, recorded in every JSON, and
everything a figure builds lives on it; a figure that measures the CPU by nature is skipped on a
GPU with its reason (recorded, printed, in BENCHMARKS.md), never silently.

Without a GPU the CUDA side is checked two ways: the figure selection (`runner.plan`,
`runner.skip_reason`) and the skipped figures' JSON are made for a `torch.device("cuda")` object
without running anything on it; the quick suite runs on the CPU under `implicit_device_guard()`
(tests/devices.py), where a tensor created without a device lands on `meta` and fails, so a
factory call that would put a tensor on the host beside a model on the GPU is caught.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cedlm.bench import cli
from cedlm.bench.common import Ctx
from cedlm.bench.runner import FIGURES, plan, run_figures, skip_reason
from tests.devices import CUDA
from tests.test_bench import check_json

CPU_ONLY = {"formats", "attn_packed", "step_ops"}
CUDA_DEV = torch.device("cuda")             # a device object only: nothing runs on it here


def test_figure_plan_on_cuda_skips_the_cpu_only_figures_with_their_reason():
    on_cpu = plan(list(FIGURES), torch.device("cpu"))
    assert set(on_cpu) == set(FIGURES) and all(v is None for v in on_cpu.values())
    on_cuda = plan(list(FIGURES), CUDA_DEV)
    assert {n for n, why in on_cuda.items() if why} == CPU_ONLY
    for n in CPU_ONLY:
        assert on_cuda[n].startswith(f"{n} skipped on cuda: ") and FIGURES[n].CPU_ONLY in on_cuda[n]
    assert "C++" in skip_reason(FIGURES["attn_packed"], CUDA_DEV)
    assert skip_reason(FIGURES["decode"], CUDA_DEV) is None        # runs on the GPU


def test_cpu_only_figures_on_cuda_are_recorded_as_skipped(tmp_path):
    """The runner writes a skipped figure's JSON (device, reason), prints the reason and puts it in
    BENCHMARKS.md, without running the figure (nothing touches CUDA)."""
    out, md, lines = tmp_path / "r", tmp_path / "B.md", []
    ctx = Ctx(quick=True, out=out, profile=False, log=lines.append, device=CUDA_DEV)
    res = run_figures(sorted(CPU_ONLY), ctx, md)
    assert all(r.get("skipped") for r in res)
    text = md.read_text()
    for name in CPU_ONLY:
        j = check_json(out, name)
        assert j["device"] == "cuda" and j["env"]["device"] == "cuda"
        assert j["skip_reason"] == FIGURES[name].CPU_ONLY
        assert j["skipped"] == skip_reason(FIGURES[name], CUDA_DEV)
        assert j["target"]["met"] is None and j["target"]["note"] == j["skipped"]
        assert any(j["skipped"] in line for line in lines)               # printed
        assert f"**Skipped:** {j['skipped']}" in text                   # and in BENCHMARKS.md


def test_peer_table_says_what_a_gpu_run_does_not_measure():
    from cedlm.bench import peer
    row = {"context": 512, "batch": 1, "new_tokens": 3, "ced_tokens_per_s": 50.0,
           "hf_tokens_per_s": 40.0, "ratio": 1.25, "target": 2.0, "met": False, "spread": 0.1}
    skipped = {k: f"not measured on cuda:0: {v}" for k, v in peer.CPU_ONLY_PARTS.items()}
    res = {"rows": [row], "config": {"ced_params_without_engram_tables": 1, "ced_params_total": 2,
                                     "hf_params": 1, "hf_config": {}, "transformers": "t",
                                     "cpu_only_skipped": skipped}}
    t = peer.table(res)
    assert "Llama cpp: not measured on cuda:0: the llama.cpp peer decodes on the CPU" in t
    assert "Bandwidth fraction: not measured on cuda:0:" in t


@pytest.mark.skipif(CUDA, reason="this torch build sees a GPU: --device cuda is valid here")
def test_cuda_on_the_cpu_wheel_is_one_error_line():
    with pytest.raises(SystemExit) as e:
        cli.main(["--device", "cuda", "--only", "kv_bytes"])
    msg = str(e.value.code)
    assert msg.startswith("cedlm bench: error: device: 'cuda'") and "\n" not in msg
    p = subprocess.run([sys.executable, "-m", "cedlm.bench", "--device", "cuda:1", "--only", "kv_bytes"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and p.stdout == ""
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cedlm bench: error: device: 'cuda:1'"), p.stderr
    with pytest.raises(SystemExit, match="device: 'npu' is not a device"):
        cli.main(["--device", "npu", "--only", "kv_bytes"])


def test_quick_suite_on_the_cpu_under_the_implicit_device_guard(bench_quick):
    """`cedlm bench --quick` (default --device: auto, the CPU here) with every figure, while a
    tensor created without a device goes to `meta`: the same results as the unguarded smoke test
    (test_bench.test_quick_smoke), the device printed at start and in every JSON.

    Not under the guard, by design (each on the host explicitly, then moved to the run's device):
    drawing the models' random weights and the HF Llama's (common._build_ced, peer.llama_for),
    reading the dspark figure's checkpoint (checkpoint.load_model), and the CPU-only figures
    (formats, attn_packed, step_ops: the runner runs them on the CPU, their device by nature).

    The run is the suite's one `cedlm bench --quick` (conftest `bench_quick`: under the guard),
    whose figures test_bench.test_quick_smoke checks."""
    rc, out, printed = bench_quick
    assert rc == 0
    assert printed.splitlines()[0].startswith("cedlm bench: device cpu (")
    for name in FIGURES:
        res = check_json(out, name)
        assert res["device"] == "cpu" and res["env"]["device"] == "cpu"
        assert res["env"]["device_description"].startswith("cpu (")
        if name == "peer" and res.get("skipped"):
            assert "transformers" in res["skipped"]
        elif name in ("decode", "prefill", "resume", "peer", "dspark", "kv_bytes", "capacity"):
            assert not res.get("skipped") and res["config"]["device"] == "cpu", name
        if name == "peer" and not res.get("skipped"):
            assert res["config"]["cpu_only_skipped"] == {}                # all of it measured
    decode = json.loads((out / "decode.json").read_text())
    assert decode["config"]["ced_decode_step"] == "static"


def test_synthetic_caches_live_on_the_models_device():
    """The states the decode, peer and resume figures build directly (contiguous rows, one block
    pool for a batch, the decoder-only baseline's K and V) are on the model's device, every tensor
    of them: here `meta`, another device than the CPU (no forward runs on it)."""
    from cedlm.bench.common import _build_ced, synth_ced_batch, synth_ced_state, synth_decoder_only_state
    from cedlm.config import ModelConfig
    from cedlm.model.decoder_only import DecoderOnlyModel
    cfg = ModelConfig.preset("tiny")
    ced = _build_ced(cfg, 0, torch.device("meta"))

    def devices(st):
        ts = [st.window_all, st.window_pos_all] + [t for p in st.pending.values() for t in p]
        ts += [r.blocks()[0] for r in (*st.kv.values(), *st.index.values())]
        return {str(t.device) for t in ts}
    assert devices(synth_ced_state(ced, 300)) == {"meta"}
    batch = synth_ced_batch(ced, 300, 3)
    assert [devices(s) for s in batch] == [{"meta"}] * 3
    assert batch[0].kv[next(iter(batch[0].kv))].blocks()[0] is batch[1].kv[next(iter(batch[1].kv))].blocks()[0]
    assert len(synth_ced_state(ced, 300).token_ids) == 300                  # ids: host-side Python
    torch.manual_seed(0)
    only = DecoderOnlyModel(cfg).to("meta")
    assert synth_decoder_only_state(only, 100).kv.device.type == "meta"
