"""guidellm (0.8.1) against `cedlm serve`: a few seconds of its streaming chat
load (synchronous profile, synthetic 32-token prompts, 16 output tokens), which sends
`stream_options: {"include_usage": true, "continuous_usage_stats": true}`. Every request must
succeed and guidellm must have measured time to first token and inter-token latency.

guidellm comes with requirements.lock (`./setup.sh`; .ci/lock.py says which of its dependencies
the lock leaves out, and why); found as `$CEDLM_GUIDELLM`, else `guidellm` beside this
Python, else on PATH. Without it the test skips, or fails when CEDLM_REQUIRE_GUIDELLM=1 (CI).
About 20 s (model load, 5 s of load, guidellm's start-up).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import cedlm_serve, tool_unavailable
from cedlm.engine.loader import DEFAULT_MODEL

SECONDS = 5


def guidellm_exe() -> str:
    exe = (os.environ.get("CEDLM_GUIDELLM") or shutil.which("guidellm", path=str(Path(sys.executable).parent))
           or shutil.which("guidellm"))
    if exe is None:
        tool_unavailable("CEDLM_REQUIRE_GUIDELLM",
                         "guidellm is not installed (./setup.sh installs it from requirements.lock)")
    return exe


def test_guidellm_streaming_run_against_cedlm_serve(tmp_path):
    exe = guidellm_exe()
    with cedlm_serve(tmp_path / "serve.log") as base:
        out = tmp_path / "benchmarks.json"
        run = subprocess.run(
            [exe, "run", "--backend", f"kind=openai_http,target={base}", "--profile", "kind=synchronous",
             "--constraint", f"kind=max_duration,seconds={SECONDS}",
             "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
             "--tokenizer", f"kind=huggingface_auto,model={DEFAULT_MODEL}",
             "--output", f"kind=json,path={out}", "--disable-console-interactive"],
            capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert run.returncode == 0 and out.exists(), (run.stdout[-3000:], run.stderr[-3000:])
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    totals = m["request_totals"]
    ttft, itl = m["time_to_first_token_ms"]["successful"], m["inter_token_latency_ms"]["successful"]
    print(f"guidellm: {totals}, TTFT mean {ttft['mean']:.1f} ms, ITL mean {itl['mean']:.1f} ms")
    # at most one incomplete: the request in flight when max_duration ends is cancelled by guidellm
    assert totals["errored"] == 0 and totals["incomplete"] <= 1 and totals["successful"] >= 2, totals
    assert ttft["count"] == totals["successful"] and ttft["mean"] > 0
    assert itl["count"] > 0 and itl["mean"] > 0
