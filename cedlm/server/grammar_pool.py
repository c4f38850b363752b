"""A small pool of compiler processes (`grammar_compile`) with a time and memory budget.

Compiling a request's constraint can crash llguidance (a stack overflow is a segfault, which no
Python handler can catch) or run for minutes. The server therefore compiles in separate
processes: `GrammarPool.compile(param, kind, value)` sends the constraint to an idle compiler
process and waits at most `timeout` seconds. A process that dies or runs past the budget is
killed and replaced on the next use; that request gets a `GrammarError` (400) saying so, and
every other request, stream and the engine go on. Each process runs under an address-space
limit (`memory_bytes`, RLIMIT_AS) and compiles with half the stack of the server's threads, so a
grammar it accepts also compiles in the server (the engine builds its matchers from the
validated grammar string).

Processes start on first use (a server with no structured output starts none) and are reused;
`close()` ends them, as does the pool's garbage collection; a compiler process
also ends by itself when the server exits (its stdin closes). Measured cost per request: see RELIABILITY.md.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import time
import weakref
from typing import Any

from cedlm.server.grammar_compile import GrammarError

log = logging.getLogger("cedlm.server")

DEFAULT_WORKERS = 2
DEFAULT_TIMEOUT = 10.0                 # seconds of compilation per request
DEFAULT_MEMORY_BYTES = 4 << 30         # address space of one compiler process
STARTUP_TIMEOUT = 60.0


def _transient(e: GrammarError) -> GrammarError:
    """A failure of this attempt (a time-out, a crash), not a verdict on the constraint: never cached."""
    e.transient = True
    return e


class _Compiler:
    """One compiler process (started lazily, restarted after a crash or a timeout)."""

    def __init__(self, hello: str, memory_bytes: int):
        self.hello, self.memory_bytes = hello, memory_bytes
        self.proc: subprocess.Popen | None = None
        self.buf = b""

    def _start(self) -> None:
        env = dict(os.environ, CEDLM_GRAMMAR_MEMORY_BYTES=str(self.memory_bytes), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "cedlm.server.grammar_compile"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.buf = b""
        self._send(self.hello)
        msg = self._read(STARTUP_TIMEOUT)
        if not msg or not msg.get("ready"):
            self.kill()
            raise RuntimeError("the grammar compiler process did not start")

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def _read(self, timeout: float) -> dict | None:
        """One JSON line from the process, or None on EOF or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.proc = None

    def compile(self, request: str, timeout: float) -> dict | None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self._start()
        try:
            self._send(request)
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        answer = self._read(timeout)
        if answer is None:
            self.kill()
        return answer


class GrammarPool:
    """Compiles constraints in `workers` compiler processes (see the module docstring)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_id: int, workers: int = DEFAULT_WORKERS,
                 timeout: float = DEFAULT_TIMEOUT, memory_bytes: int = DEFAULT_MEMORY_BYTES):
        hello = json.dumps({"tokenizer": tokenizer_json, "n_vocab": int(n_vocab), "eos": int(eos_id)})
        self.timeout, self.workers = float(timeout), int(workers)
        self.idle: queue.Queue[_Compiler] = queue.Queue()
        self.all = [_Compiler(hello, memory_bytes) for _ in range(workers)]
        for c in self.all:
            self.idle.put(c)
        self.counters = {"compiled": 0, "rejected": 0, "crashed": 0, "timed_out": 0}
        weakref.finalize(self, GrammarPool._kill_all, list(self.all))   # the processes end with the pool

    @staticmethod
    def _kill_all(compilers: list[_Compiler]) -> None:
        for c in compilers:
            c.kill()

    def compile(self, param: str, kind: str, value: Any) -> str:
        """The validated grammar string; GrammarError (400) for an invalid constraint, a crash of
        the compiler or a runaway past the time budget."""
        request = json.dumps({"param": param, "kind": kind, "value": value})
        c = self.idle.get()
        try:
            t0 = time.monotonic()
            try:
                answer = c.compile(request, self.timeout)
            except (RuntimeError, OSError, ValueError):     # it died starting, or its pipe broke
                c.kill()
                self.counters["crashed"] += 1
                log.warning("a grammar compiler process failed to start; it is started again on the next use")
                raise _transient(GrammarError(param, "the constraint could not be compiled now (the compiler "
                                                     "did not start); retry")) from None
            took = time.monotonic() - t0
        finally:
            self.idle.put(c)
        if answer is None:
            if took >= self.timeout:
                self.counters["timed_out"] += 1
                log.warning("grammar compilation of %s ran past %.0f s; compiler process replaced", param,
                            self.timeout)
                raise _transient(GrammarError(param, f"compiling the constraint took longer than the limit of "
                                                     f"{self.timeout:g} s"))
            self.counters["crashed"] += 1
            log.warning("the grammar compiler process died compiling %s; replaced", param)
            raise _transient(GrammarError(param, "the constraint could not be compiled (the compiler failed on "
                                                 "it; simplify it, e.g. less nesting)"))
        if "error" in answer:
            self.counters["rejected"] += 1
            raise GrammarError(answer.get("param") or param, answer["error"].split(": ", 1)[-1])
        self.counters["compiled"] += 1
        return answer["grammar"]

    def close(self) -> None:
        self._kill_all(self.all)
