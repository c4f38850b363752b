"""`cedlm serve` from its first seconds: the port is checked before any work, /health answers while
the model loads, and a cold server answers on the uncompiled step while its compiled graphs are
built in the background. `cedlm --help` imports no torch."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from cedlm.cli import COMMANDS, main
from tests.conftest import _free_port, stop_process

pytestmark = pytest.mark.foreground    # times wall-clock latencies: see tests/ahead.py


def _cli(*args: str, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cedlm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _python(code: str) -> str:
    """Run `code` in a fresh interpreter; its stdout (the test fails on a non-zero exit)."""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_help_imports_no_torch():
    code = ("import sys, contextlib, io\nfrom cedlm.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "assert 'serve' in out.getvalue() and 'bench' in out.getvalue()\n"
            "print('torch' in sys.modules)")
    assert _python(code).strip() == "False"


def test_serve_flags_parse_without_torch():
    code = ("import sys\nfrom cedlm.cli import build_parser\n"
            "p = build_parser('serve')\np.parse_args(['serve', '--port', '8001'])\n"
            "print('torch' in sys.modules)")
    assert _python(code).strip() == "False"


def test_serve_checks_its_http_flags_and_makes_its_protocol_without_torch():
    """--http / --loop are checked before the port is bound, and uvicorn's protocol class is made,
    without the app or torch: the server answers /health ("loading") within a second of the start."""
    code = ("import sys, argparse\nfrom cedlm.server.cli import _server_libs_error\n"
            "ok = _server_libs_error(argparse.Namespace(http='auto', loop='auto'))\n"
            "bad = _server_libs_error(argparse.Namespace(http='spdy', loop='auto'))\n"
            "from cedlm.server.http_protocol import http_protocol\n"
            "classes = [http_protocol(10.0, 'httptools'), http_protocol(10.0, 'h11')]\n"
            "print(ok, 'http' in bad, 'torch' in sys.modules, 'starlette' in sys.modules)")
    out = _python(code)
    assert out.split() == ["None", "True", "False", "False"], out


@pytest.mark.parametrize("name,mod,help_line", COMMANDS)
def test_command_table_matches_the_modules(name, mod, help_line):
    import argparse
    import importlib

    from cedlm.cli import CommandParser
    sub = argparse.ArgumentParser().add_subparsers(parser_class=CommandParser)
    importlib.import_module(mod).add_parser(sub)
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert helps.get(name) == help_line


def test_bad_port_is_one_line(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--port", "99999"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--port: must be in 0..65535, got 99999" in err
    assert "Traceback" not in err


def test_busy_port_is_one_line_before_loading(capsys):
    import gc

    from cedlm.util import SERVE_FULL_COLLECTION_EVERY
    before = gc.get_threshold()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        try:
            rc = main(["serve", "--model", "tiny", "--port", str(port)])
            # a serving process's full collections are rarer (cedlm.util.collect_fully_less_often)
            assert gc.get_threshold() == (*before[:2], SERVE_FULL_COLLECTION_EVERY)
        finally:
            gc.set_threshold(*before)
        took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"cedlm serve: error: port: cannot listen on 127.0.0.1:{port}")
    assert took < 5, took                       # no model was loaded first


def test_cold_server_answers_before_its_compile_finishes(tmp_path):
    """An empty compile cache: the server listens at once (/health 503 "loading", then 200 on the
    static step with a compile under way) and answers a chat completion before the compiled
    graphs exist."""
    port = _free_port()
    env = {**os.environ, "CEDLM_DECODE_STEP": "compiled", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "CEDLM_CACHE_DIR": str(tmp_path / "cache")}
    log = open(tmp_path / "serve.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cedlm.cli", "serve", "--model", "tiny", "--port", str(port),
                             "--threads", "1", "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)       # its compiler processes in its group
    base = f"http://127.0.0.1:{port}"
    seen = []
    try:
        while time.monotonic() - t0 < 60:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                r = httpx.get(f"{base}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1] == (200, "ready"), seen
        assert all(code == 503 and st == "loading" for code, st in seen[:-1]), seen
        health = r.json()
        assert health["decode_step"] == "static" and health["compiling"], health
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "cedlm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] > 0
        after = httpx.get(f"{base}/health", timeout=5).json()
        assert after["decode_step"] == "static" and after["compiling"], after     # still compiling
        card = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]
        assert card["decode_step"] == "static"
        answered = time.monotonic() - t0
        assert answered < 60, answered
    finally:
        stop_process(proc, 15)
        try:                                  # the compiler processes it left running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "compiling decode graph for batch 1 (1/2) in the background" in text, text[-2000:]


def test_warmup_command_reports_what_it_compiled(capsys):
    rc = main(["warmup", "--model", "tiny", "--decode-step", "static"])
    err = capsys.readouterr().err
    assert rc == 0 and "nothing to compile (decode step static)" in err, err
