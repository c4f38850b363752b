"""Shared pieces of the benchmark suite: environment, timing, models, synthetic caches, output.

Every figure is a ratio of two measurements taken in the same run on the same machine; times are
medians of repeated runs (time.perf_counter, after warm-up; on a GPU the device is synchronised
before and after each timed call, so a time is the work's, not its launch's). Models are built
from the presets with random weights (fixed seed, drawn on the host, then moved to the run's
device): the benchmarks time work and count bytes, neither depends on trained values.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cedlm.bench.gpu_common import sync
from cedlm.config import ModelConfig

SCHEMA = 1
GIB = 1 << 30
MIB = 1 << 20


# ============================================================================ environment
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> tuple[str | None, bool | None]:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return head, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def env_block(device: torch.device | None = None) -> dict:
    """The run's environment; with `device` (the device the figures run on) also `device` and
    its `device_description` (GPU name and memory)."""
    head, dirty = git_commit()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": head,
        "git_dirty": dirty,
        "loadavg_at_start": load,
    }
    if device is not None:
        env.update(device=str(device), device_description=_describe(torch.device(device)))
    return env


def _describe(device: torch.device) -> str:
    from cedlm.util import describe_device
    try:
        return describe_device(device)
    except Exception as e:                  # a broken driver must not lose the figure's numbers
        return f"{device} (describe_device failed: {type(e).__name__}: {e})"


# ============================================================================ context
@dataclass
class Ctx:
    """What a figure gets: sizes (quick or full), output directory, options, shared models."""
    quick: bool = False
    out: Path = Path("bench/results")
    threads: int = 1
    install: bool = False                # peer figure: pip-install its peers if absent (opt-in)
    peer_contexts: list | None = None    # peer figure: contexts to run (default: its own sweep)
    profile: bool = True                 # profile figures that miss their target
    seed: int = 0
    log: object = print
    dspark_model: Path | None = None     # dspark figure: model dir with mtp.safetensors
    dspark_contexts: list | None = None  # dspark figure: long contexts (default: its own; [] none)
    engine_options: dict = field(default_factory=dict)   # engine flags the user set (EngineArgs names)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where models and caches live
    _models: dict = field(default_factory=dict)

    def engine_config(self, figure: str, **design):
        """The EngineConfig a figure runs: the engine's defaults, the figure's own `design` values
        (what it measures: budget, batch, block size), then the engine flags the user set. A flag
        the figure fixes is not applied, and a line says so (never silently ignored)."""
        import dataclasses
        from cedlm.engine.args import EngineConfig
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        user = {k: v for k, v in self.engine_options.items() if k in names}
        for k in sorted(set(user) & set(design)):
            if user[k] != design[k]:
                self.log(f"{figure}: --{k.replace('_', '-')} {user[k]} not applied (the figure "
                         f"fixes {k} = {design[k]})")
        return EngineConfig(**{**user, **design})

    def size(self, full, quick):
        return quick if self.quick else full

    # ---------------------------------------------------------------- models (cached per run)
    def ced(self):
        return self._model("ced", lambda: _build_ced(small_config(), self.seed, self.device))

    def decoder_only(self):
        """The decoder-only baseline (full attention, BF16 KV) of the small preset."""
        from cedlm.model.decoder_only import DecoderOnlyModel

        def build():
            torch.manual_seed(self.seed)
            with torch.device("cpu"):                # drawn on the host: the same weights everywhere
                return DecoderOnlyModel(small_config()).eval().to(self.device)
        return self._model("decoder_only", build)

    def v4(self):
        """The same-size DeepSeek-V4-Flash-style baseline of the small preset (`v4_style_config`)."""
        return self._model("v4", lambda: _build_ced(v4_style_config(small_config()), self.seed, self.device))

    def preset_model(self, name: str):
        """A runnable preset with random weights (fixed seed)."""
        return self._model(name, lambda: _build_ced(ModelConfig.preset(name), self.seed, self.device))

    def _model(self, key, build):
        if key not in self._models:
            self._models[key] = build()
        return self._models[key]


def ced_decode_fn(model, mode: str | None = None):
    """The CED decode step the figures time, as the engine runs it: a callable `(ids, states) ->
    logits` (ids: one token per state, logits: [len(states), vocab]). `mode` is the engine's
    `decode_step` ("compiled", "static", "eager"; None: the engine's default, compiled unless
    CEDLM_DECODE_STEP or CEDLM_REFERENCE_KERNELS say otherwise). One step object per model and
    mode, so its compiled graphs are made once per run (`.compile_s` says how long that took)."""
    from cedlm.model.compiled_step import CompiledDecode
    return CompiledDecode.of(model, mode)


def _build_ced(cfg: ModelConfig, seed: int, device: torch.device | None = None):
    """A CEDModel of `cfg`, weights drawn on the host (seeded: the same on every device), then
    moved to `device`."""
    from cedlm.model import CEDModel
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = CEDModel(cfg).eval()
    return model if device is None else model.to(device)


# ============================================================================ configs
def small_config() -> ModelConfig:
    return ModelConfig.preset("small")


def v4_style_config(cfg: ModelConfig) -> ModelConfig:
    """A same-size DeepSeek-V4-Flash-style baseline of a CED config.

    The leading SWA-only layers are kept; every later layer alternates CSA (ratio 4, with its own
    indexer and index keys) and HCA (ratio 128, attends to all of its entries), as V4-Flash's
    [0, 0] + [4, 128] * 20 + [4]. Every compressed layer is its own KV source; ratio-4 layers are
    the index sources; no decoder (every layer sees every token), no candidate pool. Main KV is
    stored as `v4_fp8` (V4's MODEL1 entry: FP8 NoPE, BF16 RoPE, UE8M0 per 64). That layout keeps
    64 BF16 RoPE dims, so the baseline's qk_rope_head_dim is 64 (the small preset has 32 of 128). V4
    has no Engram and no DSpark: none here. Width, depth, heads, MoE, window and formats of the
    window and index keys are those of `cfg`.
    """
    L = cfg.n_layers
    n_swa = 0
    while n_swa < L and cfg.compress_ratios[n_swa] == 0:
        n_swa += 1
    ratios = [0] * n_swa + [4 if (i - n_swa) % 2 == 0 else 128 for i in range(n_swa, L)]
    ratios += [0] * cfg.num_nextn_predict_layers
    kv_src = [i for i in range(L) if ratios[i] > 0]
    idx_src = [i for i in range(L) if ratios[i] == 4]
    out = cfg.replace(
        compress_ratios=ratios, kv_source_layer_ids=kv_src, index_source_layer_ids=idx_src,
        candidate_source_layer_id=None, main_kv_format="v4_fp8", qk_rope_head_dim=64,
        engram_layer_ids=[], engram_num_embeddings=[], dspark_target_layer_ids=[],
        family="v4", model_type="deepseek_v4")
    # V4-family configs serialise their flat source dict (to_dict); this one has none: record
    # every field, so fingerprints and `to_dict` work.
    flat = {f.name: copy.deepcopy(getattr(out, f.name)) for f in dataclasses.fields(out)
            if f.name != "extra"}
    out.extra = {"flat": flat}
    return out


# ============================================================================ timing
def measure(fn, repeats: int, warmup: int = 1, setup=None, device=None) -> list[float]:
    """Seconds of `fn(setup())` per run (setup, if any, runs outside the timed region). `device`:
    where `fn` queues its work; a GPU is synchronised before and after each run (`gpu_common.sync`;
    nothing happens on the CPU)."""
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        t0 = _start(device)
        fn(arg) if setup is not None else fn()
        dt = _stop(device, t0)
        if i >= warmup:
            times.append(dt)
    return times


def measure_interleaved(fns: dict, repeats: int, warmup: int = 1, device=None) -> dict:
    """Seconds per run of each of `fns` (name -> callable), the runs taken round-robin (one of
    each per round), so that a change of load on a shared machine during the measurement hits
    every entry alike and their ratios stay fair (`device`: as `measure`). name -> list of seconds."""
    times: dict = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            t0 = _start(device)
            fn()
            dt = _stop(device, t0)
            if i >= warmup:
                times[k].append(dt)
    return times


def _start(device) -> float:
    """The start of a timed region: the device idle first (work queued before is not counted)."""
    if device is not None:
        sync(torch.device(device))
    return time.perf_counter()


def _stop(device, t0: float) -> float:
    """Seconds since `t0` once the device has finished the work queued in the region."""
    if device is not None:
        sync(torch.device(device))
    return time.perf_counter() - t0


def stats(times: list[float]) -> dict:
    """median, min, max and relative spread ((max-min)/median) of a list of seconds."""
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "n": len(times),
            "spread": (max(times) - min(times)) / med if med > 0 else 0.0, "runs_s": times}


# ============================================================================ synthetic caches
def _fill_rows(n: int, dim: int, fmt: str, g: torch.Generator, pool: int = 512,
               device=None) -> torch.Tensor:
    """n encoded entries of `dim` values: `pool` random N(0,1) rows encoded, tiled to n rows, on
    `device` (default the CPU). The values are drawn and encoded on the host (`g` is a host
    generator: the same bytes on every device), then moved.

    Values of the right format and distribution (RMS 1, as kv_norm / k_norm outputs are), so no
    NaN/inf/denormal codes; timing depends on sizes, not values."""
    from cedlm.kernels import encode
    base = encode(torch.randn(min(max(n, 1), pool), dim, generator=g, device="cpu"), fmt)
    reps = -(-n // base.shape[0])
    return base.to(device or "cpu").repeat(reps, 1)[:n].contiguous()


def synth_ced_state(model, context: int, seed: int = 0, margin: int = 64, pool=None):
    """A SequenceState of `context` tokens built directly (no prefill): random token ids, every
    source's main KV and index-key rows (context // ratio entries, valid encodings of random
    values), pending compressor rows of the incomplete group (random fp32), and every layer's
    window ring full (the last n_win positions). Same shapes and bytes as after a real prefill.
    pool: a `BlockPool` to hold the rows in (paged, as the engine keeps them; on the model's
    device), else contiguous. Every tensor lives on the model's device; the values are drawn on
    the host (one seeded generator: the same state on every device) and moved there."""
    from cedlm.model.state import ByteRows
    cfg = model.cfg
    dev = model.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    if pool is not None:
        from cedlm.cache.block_pool import BlockTable
        st = model.new_state(pool.rows(BlockTable(pool)))
    else:
        st = model.new_state()
    st.set_tokens(torch.randint(0, cfg.vocab_size, (context,), generator=g, device="cpu").tolist())
    for kind, store, fmt, dim in (("kv", st.kv, cfg.main_kv_format, cfg.head_dim),
                                  ("idx", st.index, cfg.index_kv_format, cfg.index_head_dim)):
        for s, rows in store.items():
            n = context // cfg.compress_ratios[s]
            new = ByteRows(rows.width, capacity=n + margin, device=dev) if pool is None else rows
            new.append(_fill_rows(n, dim, fmt, g, device=dev))
            store[s] = new
    for s in st.pending:
        k = context % cfg.compress_ratios[s]
        st.pending[s] = (torch.randn(k, cfg.head_dim, generator=g, device="cpu").to(dev),
                         torch.randn(k, cfg.head_dim, generator=g, device="cpu").to(dev))
    win = cfg.sliding_window
    pos = torch.arange(max(0, context - win), context, device=dev)
    for l in range(cfg.n_layers):
        st.window[l][pos % win] = _fill_rows(pos.numel(), cfg.head_dim, cfg.window_kv_format, g, device=dev)
        st.window_pos[l][pos % win] = pos
    return st


def synth_ced_batch(model, context: int, batch: int, seed: int = 0, new_tokens: int = 64) -> list:
    """`batch` states of `context` tokens (seeds seed, seed+1, ...): one contiguous state for batch
    1; for more, paged rows in one `BlockPool` sized for context + new_tokens each, as the engine
    holds a batch (the decode step then reads every sequence through one pool and block table),
    on the model's device."""
    if batch == 1:
        return [synth_ced_state(model, context, seed=seed)]
    from cedlm.cache.block_pool import BlockPool
    block = 64
    per_seq = -(-(context + new_tokens + 1) // block) + 1
    pool = BlockPool(model.kv_layout, batch * per_seq, block, device=model.device)
    return [synth_ced_state(model, context, seed=seed + b, pool=pool) for b in range(batch)]


def synth_decoder_only_state(model, context: int, seed: int = 0, margin: int = 64):
    """A DecoderOnlyState of `context` tokens on the model's device: BF16 K and V of every layer
    filled with N(0,1) values (drawn on the host, seeded, then moved)."""
    from cedlm.model.decoder_only import DecoderOnlyState
    g = torch.Generator(device="cpu").manual_seed(seed)
    st = DecoderOnlyState(model.cfg, capacity=context + margin, device=model.device)
    for l in range(model.cfg.n_layers):
        st.kv[l, :, :context] = torch.randn(2, context, model.cfg.head_dim, generator=g,
                                            device="cpu").to(st.kv.device, torch.bfloat16)
    st.n = context
    return st


# ============================================================================ output
def write_json(out: Path, name: str, result: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"{name}.json"
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, p)
    return p


def _jsonable(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def md_table(header: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table (also readable as plain text)."""
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"
    sep = "|" + "|".join("-" * (x + 2) for x in w) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _fmt(c) -> str:
    if isinstance(c, float):
        if c == 0:
            return "0"
        if abs(c) >= 1000:
            return f"{c:,.0f}"
        if abs(c) >= 10:
            return f"{c:.1f}"
        if abs(c) >= 0.01:
            return f"{c:.3f}"
        return f"{c:.2e}"
    if isinstance(c, int) and not isinstance(c, bool):
        return f"{c:,}"
    return str(c)


def target(metric: str, op: str, value: float, measured: float | None, note: str = "") -> dict:
    met = None
    if measured is not None:
        met = {"<=": lambda: measured <= value, ">=": lambda: measured >= value,
               "==": lambda: measured == value}[op]()
    return {"metric": metric, "op": op, "value": value, "measured": measured, "met": met,
            "note": note}


def save_plot(pyplot, fig, path) -> bool:
    """Every figure's last step: lay out, write `path` (110 dpi), free the figure; True."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
    return True


def plt():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        return pyplot
    except ImportError:
        return None
