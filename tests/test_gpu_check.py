"""bench/scripts/gpu_check.sh and the GPU figure set (cedlm/bench/gpu*.py), on the CPU.

The script runs once on a GPU, so every path it takes is exercised here with tiny sizes: the
whole script under --cpu-smoke (every phase, the JSON's keys, the table), a phase that fails and
one killed by its timeout (recorded, the others still run), the message without a GPU, and in
process the figures' skip logic, caps and well-formed synthetic states.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cedlm.bench import gpu, gpu_capacity, gpu_common, gpu_decode, gpu_exact
from tests.devices import implicit_device_guard

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "scripts" / "gpu_check.sh"
CPU = torch.device("cpu")


def _script(tmp_path, *args, **env):
    e = {**os.environ, "PYTHON": sys.executable, **env}
    e.pop("CEDLM_DECODE_STEP", None)            # the script's own choice, not the suite's
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_the_script_stops_with_a_clear_message(tmp_path):
    p = _script(tmp_path, "--out", str(tmp_path / "out"))
    assert p.returncode == 3, p.stderr
    assert "no CUDA device" in p.stderr and "--cpu-smoke" in p.stderr
    assert not (tmp_path / "out").exists()


def test_cpu_smoke_runs_every_phase_and_writes_one_json(tmp_path):
    out = tmp_path / "out"
    p = _script(tmp_path, "--cpu-smoke", "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert set(res) >= {"schema", "name", "profile", "ok", "started_at", "finished_at", "wall_s",
                        "budget_s", "device", "env", "phases", "tests", "checks", "figures"}
    assert res["ok"] and res["profile"] == "cpu-smoke"
    assert res["device"]["type"] == "cpu" and res["device"]["description"].startswith("cpu")
    assert res["device"]["torch"] == torch.__version__
    assert list(res["phases"]) == list(gpu.PHASE_ORDER)
    for name, ph in res["phases"].items():
        assert ph["status"] in ("ok", "no_tests"), (name, ph)
        assert ph["timeout_s"] > 0 and ph["wall_s"] >= 0
    for name in gpu.FIGURE_PHASES:
        assert res["figures"][name]["status"] == "done", name
    fig = res["figures"]
    assert fig["exact"]["result"]["codecs"]["identical"]
    assert fig["exact"]["result"]["logits"]["within_tolerance"]
    assert fig["capacity"]["result"]["rows"][0]["within_budget"]
    assert fig["decode"]["result"]["status"] == "done"
    assert res["checks"]["codecs_identical"] and res["checks"]["decode_cells"]["failed"] == 0
    md = (out / "gpu_check.md").read_text()
    assert "## capacity" in md and "## decode" in md and "## exact" in md
    assert "all phases ok" in p.stdout


def test_a_failing_phase_and_a_timed_out_phase_are_recorded_and_the_rest_runs(tmp_path):
    out = tmp_path / "out"
    p = _script(tmp_path, "--cpu-smoke", "--out", str(out), GPU_CHECK_PHASES="tests decode capacity",
                GPU_CHECK_TESTS="tests/no_such_test_file.py", GPU_CHECK_TIMEOUT_DECODE="1")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    ph = res["phases"]
    assert ph["tests"]["status"] == "failed" and ph["tests"]["rc"] == 4
    assert ph["decode"]["status"] == "timed_out" and ph["decode"]["timeout_s"] == 1
    assert ph["capacity"]["status"] == "ok"                # ran after the two that went wrong
    assert all(ph[k]["status"] == "not_run" for k in ("exact", "tests_golden", "tests_compiled"))
    assert not res["ok"] and "capacity" in res["figures"]
    assert "SOME PHASES FAILED" in (out / "gpu_check.md").read_text()


def test_bad_arguments_are_refused(tmp_path):
    p = _script(tmp_path, "--budget", "soon")
    assert p.returncode == 2 and "--budget" in p.stderr
    with pytest.raises(ValueError, match="phase"):
        gpu.run_phase("nope", tmp_path)
    with pytest.raises(ValueError, match="profile"):
        gpu.run_phase("exact", tmp_path, profile="huge")


def test_phase_records_parse():
    tsv = "\n".join(["tests\t1\t3.5\t120\t", "decode\t124\t60.0\t60\tkilled", "exact\t0\t2\t45\t",
                     "tests_compiled\t5\t1\t60\t", "capacity\tskipped\t0\t0\tbudget spent"])
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"phases-{os.getpid()}.tsv"
    path.write_text(tsv)
    try:
        ph = gpu.read_phases(path)
    finally:
        path.unlink()
    assert {k: v["status"] for k, v in ph.items()} == {
        "tests": "failed", "decode": "timed_out", "exact": "ok", "tests_compiled": "no_tests",
        "capacity": "skipped"}


def test_pytest_log_names_the_test_a_timeout_cut(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("tests/test_a.py::t1[cuda] PASSED  [ 5%]\ntests/test_a.py::t2[cuda] FAILED  [10%]\n"
                   "tests/test_a.py::t3[cuda] SKIPPED (no)  [15%]\ntests/test_a.py::t4[cuda] \n"
                   "Timeout (0:00:45)!\n")
    t = gpu.read_pytest_log(log)
    assert (t["passed"], t["failed"], t["skipped"]) == (1, 1, 1)
    assert t["failures"] == ["tests/test_a.py::t2[cuda]"] and t["unfinished"] == "tests/test_a.py::t4[cuda]"


def test_junit_counts(tmp_path):
    x = tmp_path / "t.xml"
    x.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                 '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
                 '<testcase classname="a" name="s"><skipped message="no CUDA"/></testcase>'
                 '</testsuite></testsuites>')
    j = gpu.read_junit(x)
    assert (j["passed"], j["failed"], j["skipped"], j["failures"]) == (1, 1, 1, ["a::bad"])
    assert gpu.read_junit(tmp_path / "absent.xml") is None


def test_decode_cells_are_skipped_with_their_reason(monkeypatch):
    import cedlm.bench.peer as peer
    r = gpu_decode.decode_throughput(CPU, batches=(1,), contexts=(16,), new_tokens=1, repeats=1,
                                     budget_s=0.0, preset="tiny", decode_step="static", log=lambda s: None)
    assert all(c["status"] == "skipped" and "budget" in c["reason"] for c in (r["rows"][0]["ced"], r["rows"][0]["hf"]))
    monkeypatch.setattr(peer, "ensure_transformers", lambda install, log=print: (None, "not installed here"))
    seen = []
    r = gpu_decode.decode_throughput(CPU, batches=(1,), contexts=(16,), new_tokens=1, repeats=1,
                                     budget_s=60.0, preset="tiny", decode_step="static",
                                     memory_cap_bytes=1, log=lambda s: None, on_row=seen.append)
    row = r["rows"][0]
    assert row["ced"]["status"] == "skipped" and "cap" in row["ced"]["reason"]
    assert row["hf"] == {"status": "skipped", "reason": "not installed here"}
    assert row["ced_over_hf"] is None and len(seen) == 1 and r["status"] == "done"
    r = gpu_decode.decode_throughput(CPU, batches=(1,), contexts=(16,), new_tokens=1, repeats=1,
                                     preset="tiny", decode_step="bogus", log=lambda s: None)
    assert r["rows"][0]["ced"]["status"] == "failed" and "bogus" in r["rows"][0]["ced"]["error"]


def test_a_cell_that_raises_or_overruns_is_recorded_as_failed():
    def boom():
        raise RuntimeError("no memory")
    r = gpu_decode._cell("ced", boom, 1, 1, CPU, 1, 1.0)
    assert r["status"] == "failed" and "no memory" in r["error"]
    with pytest.raises(gpu_common.TimeCapExceeded):
        with gpu_common.time_cap(0.2, "a loop"):
            while True:
                time.sleep(0.01)


def test_device_states_are_states_the_decode_step_runs_like_the_reference():
    """The synthetic device states hold what a prefill leaves (sizes as synth_ced_state's), and
    the engine's static step on them gives the reference decode's logits."""
    from cedlm.bench.common import ced_decode_fn, synth_ced_state
    from cedlm.config import ModelConfig
    from cedlm.model import CEDModel
    torch.manual_seed(0)
    m = CEDModel(ModelConfig.preset("tiny")).eval()
    C = 40
    a = gpu_decode.device_states(m, C, 2, CPU, seed=3)
    b = gpu_decode.device_states(m, C, 2, CPU, seed=3)
    ref = synth_ced_state(m, C)
    want = ref.nbytes()
    for st in a:
        got = st.nbytes()
        assert {k: got[k] for k in ("main_kv", "index_keys", "window")} == \
               {k: want[k] for k in ("main_kv", "index_keys", "window")}
        assert st.num_tokens == C and len(st.token_ids) == C
    with torch.no_grad():
        got = ced_decode_fn(m, "static")([5, 9], a)
        exp = m.decode([5, 9], b)
    torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    # every tensor the figure makes names its device (tests/devices.py: the rest lands on meta)
    with implicit_device_guard(), torch.no_grad():
        states = gpu_decode.device_states(m, C, 2, CPU, seed=3)
        run = gpu_decode._ced_runner(m, ced_decode_fn(m, "static"), 2, C, 2, 8, CPU, 0)
        run()
        gpu_exact.codecs(CPU, rows=4, cases=(("kv_fp4", 128), ("window_fp8", 128)))
        gpu_capacity.capacity(CPU, budget_bytes=16 << 20, contexts=(512,), probe_blocks=2,
                              log=lambda s: None)
    assert states[0].window_all.device == CPU


def test_capacity_counts_live_allocations_and_refuses_bad_input():
    seen = []
    r = gpu_capacity.capacity(CPU, budget_bytes=32 << 20, contexts=(1024,), probe_blocks=4,
                              log=lambda s: None, on_row=lambda res: seen.append(len(res["rows"])))
    assert seen == [1, 2]                                   # kept after every (preset, context)
    assert r["status"] == "done"
    part = gpu_capacity._result(r["config"], r["rows"][:1], "running")
    assert part["ratios"] == {} and "cut short" in gpu_capacity.table(part)
    a, b = r["rows"]
    assert a["preset"] == "small40" and b["preset"] == "small40-v4flash"
    for row in (a, b):
        assert row["within_budget"] and row["fitted"] and row["sequences_live"] >= 1
        assert row["allocated_bytes"] <= 32 << 20
        assert row["live_bytes_per_block"] == row["planned_bytes_per_block"]   # storages, exactly
        assert row["live_fixed_bytes_per_sequence"] > row["planned_fixed_bytes_per_sequence"]
    assert r["ratios"]["1024"]["sequences_live"] == a["sequences_live"] / b["sequences_live"]
    with pytest.raises(ValueError, match="budget_bytes"):
        gpu_capacity.capacity(CPU, budget_bytes=0)
    with pytest.raises(ValueError, match="presets"):
        gpu_capacity.capacity(CPU, presets=("small40",))


def test_codec_comparison_reports_differing_rows():
    r = gpu_exact.codecs(CPU, rows=8, cases=(("kv_fp4", 128), ("v4_fp8", 128)))
    assert r["identical"] and r["config"]["device"] == "cpu"
    x = torch.zeros(4, 3, dtype=torch.uint8)
    y = x.clone()
    y[2, 1] = 1
    assert gpu_exact._bytes_equal(x, y) == {"equal": False, "rows_differing": 1}
    f = torch.tensor([[float("nan"), 1.0]])
    assert gpu_exact._values_equal(f, f.clone())["equal"]
    # a case that raises is recorded in its row; the others still run
    r = gpu_exact.codecs(CPU, rows=4, cases=(("no_such_format", 128), ("index_fp4", 64)))
    assert "no_such_format" in r["rows"][0]["error"] and r["rows"][1]["identical"]
    assert not r["identical"] and "failed" in gpu_exact.table({"codecs": r})
    lg = gpu_exact.logits(CPU, presets=("no_such_preset",), tokens=4, log=lambda s: None)
    assert not lg["within_tolerance"] and "no_such_preset" in lg["rows"][0]["error"]
