"""The stage runner: what every `cedlm train STAGE` shares.

A stage (pretrain, chat, indexer, dspark, vision) supplies its model, its batches and its loss step
as `step(i) -> record`, optionally an evaluation and a save; `run_steps` runs them:

    for each step i (0-based) until `stop`, or until the time budget is used up:
        rec = step(i)                                  # one optimizer step -> its metrics record
        evaluate(rec)   when every `eval_every` steps, and at the last step with `eval_at_end`
        metrics.jsonl  += rec; progress bar / report(rec)
        save()          when every `save_every` steps, and at the last step

Besides the loop: `set_threads`, `stage_device` (--device), `TimeBudget` (--max-minutes /
--minutes), `MetricsLog` (the one metrics.jsonl writer), `write_json` (summary.json and
friends), `plot_loss` (loss.png) and `save_model` (the run's `checkpoint/`). The learning-rate
schedule and the optimizer step are `cedlm.train.optim`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


def default_threads() -> int:
    """Cores per process: all of them, shared among the local ranks of a torchrun job."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // local)


def set_threads(n: int | None) -> int:
    """torch's intra-op threads: `n`, or `default_threads()` when None; -> the count set."""
    if n is not None and n < 1:
        raise ValueError(f"--threads: must be >= 1, got {n}")
    torch.set_num_threads(n or default_threads())
    return torch.get_num_threads()


DEVICE_HELP = "auto (default: CUDA when this torch build sees a GPU, else the CPU), cpu, cuda or cuda:N"


def stage_device(spec) -> torch.device:
    """The device a stage trains on, for its `--device spec` (`cedlm.util.resolve_device`: a
    ValueError naming `device` for one this torch cannot use); resolved before the model loads."""
    from cedlm.util import resolve_device
    return resolve_device(spec, "device")


class TimeBudget:
    """A wall-time budget (--max-minutes / --minutes; None = unlimited), counted from `begin()`."""

    def __init__(self, minutes: float | None = None, *, seconds: float | None = None):
        if minutes is not None and seconds is not None:
            raise ValueError("TimeBudget: give minutes or seconds, not both")
        self.seconds = seconds if seconds is not None else (None if minutes is None else 60.0 * minutes)
        self.minutes = None if self.seconds is None else self.seconds / 60.0
        self.t0: float | None = None

    def begin(self) -> "TimeBudget":
        """Start the clock (once: a later call keeps the first start)."""
        if self.t0 is None:
            self.t0 = time.monotonic()
        return self

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0

    def over(self) -> bool:
        """Whether the budget is used up (never, for an unlimited one)."""
        return self.seconds is not None and self.elapsed() >= self.seconds

    def frac(self) -> float | None:
        """Share of the budget used, in [0, 1]; None when unlimited."""
        if self.seconds is None:
            return None
        return min(1.0, self.elapsed() / max(self.seconds, 1e-9))

    def rest(self, floor: float = 0.0) -> "TimeBudget":
        """A new budget, started now, of what is left of this one (at least `floor` seconds)."""
        if self.seconds is None:
            return TimeBudget().begin()
        return TimeBudget(seconds=max(self.seconds - self.elapsed(), floor)).begin()


class MetricsLog:
    """A run's `metrics.jsonl`: one JSON line per record, appended as each comes, so a crashed run
    keeps every finished step; `records` holds them in memory too.

    Opening it writes `records` (empty for a new run, a resumed run's saved ones) atomically,
    replacing what was there. `write=False` (the non-zero ranks of a torchrun job) keeps the
    records in memory only."""

    def __init__(self, path: str | Path, records=(), write: bool = True):
        from cedlm.util import atomic_open
        self.path, self.records, self.write = Path(path), list(records), write
        if write:
            with atomic_open(self.path) as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, rec: dict) -> None:
        self.records.append(rec)
        if self.write:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def __len__(self) -> int:
        return len(self.records)


def progress_bar(enabled: bool, total: int, desc: str, initial: int = 0):
    """A tqdm bar on stderr, or None when not `enabled`."""
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)


@dataclass
class StepLoop:
    """One stage's training loop (see the module docstring); `run_steps` runs it."""
    name: str                                     # the stage, for messages ("train chat")
    step: Callable[[int], dict]                   # one optimizer step (0-based) -> its record
    stop: int                                     # run steps start .. stop - 1
    metrics: MetricsLog
    budget: TimeBudget
    start: int = 0
    evaluate: Callable[[dict], None] | None = None  # adds its results to the step's record
    eval_every: int = 0
    eval_at_end: bool = False
    save: Callable[[], None] | None = None        # checkpoint: when due and after the last step
    save_every: int = 0
    report: Callable[[dict], None] | None = None  # after a record is kept: a log line, a plot
    bar: object = None                            # progress_bar(...)
    postfix: Callable[[dict], dict] | None = None  # the bar's postfix of a record
    out_of_time: Callable[[], bool] | None = None  # instead of budget.over() (a rank-0 decision)
    announce: bool = True                         # print a line when the time budget stops it


def run_steps(loop: StepLoop) -> tuple[int, bool]:
    """Run the loop; -> (the number of steps done in all, counting `start`; whether the time
    budget stopped it). The budget's clock starts here unless the stage started it earlier; it is
    checked after each step, so a loop with steps to do runs at least one."""
    budget = loop.budget.begin()
    over = loop.out_of_time or budget.over
    i, stopped = loop.start, False
    while i < loop.stop and not stopped:
        rec = loop.step(i)
        i += 1
        stopped = over()
        final = i >= loop.stop or stopped
        if loop.evaluate and ((loop.eval_every and i % loop.eval_every == 0) or (final and loop.eval_at_end)):
            loop.evaluate(rec)
        loop.metrics.append(rec)
        if loop.report:
            loop.report(rec)
        if loop.bar is not None:
            if loop.postfix:
                loop.bar.set_postfix(**loop.postfix(rec))
            loop.bar.update(1)
        if loop.save and ((loop.save_every and i % loop.save_every == 0) or final):
            loop.save()
    if loop.bar is not None:
        loop.bar.close()
    if stopped and loop.announce:
        print(f"{loop.name}: time budget of {budget.minutes:g} min reached at step {i}", file=sys.stderr)
    return i, stopped


def write_json(path: str | Path, obj) -> None:
    """A JSON file of the run (summary.json, eval.json ...), indented, written atomically."""
    from cedlm.util import atomic_open
    with atomic_open(path) as f:
        f.write(json.dumps(obj, indent=2) + "\n")


def plot_loss(records: list[dict], path: str | Path, key: str = "loss") -> None:
    """loss.png of `records` with `key` as the training loss (`cedlm.train.plot`); a plot that
    cannot be drawn (no matplotlib) is a warning, not a failed run."""
    from cedlm.train.plot import plot_metrics
    rows = [{**r, "loss": r.get(key)} for r in records]
    try:
        plot_metrics(rows, path)
    except ImportError as e:
        print(f"warning: {path} not written: {e}", file=sys.stderr)


def save_model(out: str | Path, model, tokenizer, training_args: dict | None = None,
               state: dict | None = None) -> Path:
    """The run's `checkpoint/` (`cedlm.checkpoint.save_checkpoint`: config, weights, tokenizer,
    `training_args.json`, and `training_state.pt` when given a state)."""
    from cedlm import checkpoint as ckpt_io
    return ckpt_io.save_checkpoint(Path(out) / ckpt_io.CHECKPOINT_NAME, model, tokenizer, state,
                                   training_args=training_args)
