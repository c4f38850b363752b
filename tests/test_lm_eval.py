"""lm-evaluation-harness against a live `cedlm serve`: `local-completions`.

A `cedlm serve` subprocess serves the shipped default model; lm-eval's `local-completions` backend
(pinned in the `test` extra) runs two tasks defined here, offline, from a task directory and
JSONL files written into tmp_path (`dataset_path: json`, `TaskManager(include_path=...)`):

* `cedlm_mc`: ten multiple-choice items from the KJV fixture (the first half of a verse; the
  choices are its own second half and three other verses' second halves). The model is weak: only
  that an accuracy comes back, with every request answered, is checked.
* `cedlm_ppl`: `loglikelihood_rolling` over three short documents (Moby-Dick, Pride and
  Prejudice, Genesis). Its bits per byte and word perplexity must match `cedlm eval ppl` on the
  same documents within 1%.

Same quantity on both sides: `cedlm eval ppl` scores every token of a text after one EOS token of
context (cedlm/eval/ppl.py); lm-eval scores a short document as one window after its
`prefix_token_id`, which is the tokenizer's BOS unless `custom_prefix_token_id` says otherwise, so
the test passes the EOS id (1). Each document is shorter than the model's trained `seq_len` (256),
so `cedlm eval ppl` scores it in one window too. lm-eval tokenizes on the client
(`tokenized_requests=True`) with the model directory's `tokenizer.json`, the tokenizer the server
uses; the server has no `/tokenizer_info`, so the backend is named (`tokenizer_backend=huggingface`,
`tokenizer=cedlm/assets/model`). Everything is local: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set
and the datasets cache is in tmp_path.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

# lm_eval (and transformers, datasets) are imported inside the test, after the offline
# environment is set
for _mod in ("lm_eval", "transformers", "tenacity"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} is not installed (the eval extra; ./setup.sh installs it from requirements.lock)", allow_module_level=True)
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conftest import cedlm_serve  # noqa: E402  (the suite's helpers)
from cedlm.engine.loader import DEFAULT_MODEL  # noqa: E402
from cedlm.eval.cli import main as eval_main  # noqa: E402

CORPUS = Path(__file__).parent / "fixtures" / "corpus"
SERVED = "cedlm-small"
EOS_ID = 1          # the shipped tokenizer: BOS 0, EOS 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`cedlm serve` (the shipped default model) on a free loopback port; yields its base URL."""
    with cedlm_serve(tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


# --------------------------------------------------------------------------- data and tasks


def kjv_verses() -> list[str]:
    text = (CORPUS / "kjv" / "bible.txt").read_text(encoding="utf-8")
    return [m.group(1).strip() for m in re.finditer(r"^\s+\d+ (.+)$", text, flags=re.M)]


def mc_items(n: int = 10) -> list[dict]:
    """n items: the first half of a verse; its own second half and three others' as choices."""
    verses = [v.split() for v in kjv_verses() if len(v.split()) >= 12][: n + 3]
    halves = [(" ".join(w[: len(w) // 2]), " ".join(w[len(w) // 2:])) for w in verses]
    items = []
    for i in range(n):
        others = [halves[(i + k) % len(halves)][1] for k in (1, 2, 3)]
        label = i % 4
        choices = others[:label] + [halves[i][1]] + others[label:]
        items.append({"context": halves[i][0], "choices": choices, "label": label})
    return items


def rolling_docs() -> list[str]:
    moby = (CORPUS / "moby" / "data" / "chapter_1.txt").read_text(encoding="utf-8")
    moby = next(p for p in re.split(r"\n\s*\n", moby) if len(p) > 400)
    austen = json.loads((CORPUS / "austen" / "prideprejudice.lines.json").read_text(encoding="utf-8"))
    austen = " ".join(ln for ln in austen[9:20] if ln)
    genesis = " ".join(kjv_verses()[:4])
    # short documents: one window on both sides (fewer tokens than the trained seq_len, 256)
    return [" ".join(d.split())[:600] for d in (moby, austen, genesis)]


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    cache = root / "hf-datasets"
    mc, ppl = root / "mc.jsonl", root / "ppl.jsonl"
    mc.write_text("".join(json.dumps(x) + "\n" for x in mc_items()), encoding="utf-8")
    ppl.write_text("".join(json.dumps({"text": d}) + "\n" for d in rolling_docs()), encoding="utf-8")

    def dataset(path: Path) -> dict:
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)},
                                                           "cache_dir": str(cache)},
                "test_split": "test"}
    # YAML is a superset of JSON: the task files are written as JSON
    (tasks / "cedlm_mc.yaml").write_text(json.dumps({
        "task": "cedlm_mc", **dataset(mc), "output_type": "multiple_choice",
        "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0}}))
    (tasks / "cedlm_ppl.yaml").write_text(json.dumps({
        "task": "cedlm_ppl", **dataset(ppl), "output_type": "loglikelihood_rolling",
        "doc_to_text": "", "doc_to_target": "text",
        "metric_list": [{"metric": m, "aggregation": agg, "higher_is_better": False}
                        for m, agg in (("word_perplexity", "weighted_perplexity"),
                                       ("byte_perplexity", "weighted_perplexity"),
                                       ("bits_per_byte", "bits_per_byte"))],
        "metadata": {"version": 1.0}}))
    return tasks


def metrics(base: str) -> dict[str, float]:
    """The server's Prometheus counters and gauges, by their full sample name (labels included)."""
    out = {}
    for ln in httpx.get(f"{base}/metrics").text.splitlines():
        if ln and not ln.startswith("#"):
            name, value = ln.rsplit(" ", 1)
            out[name] = float(value)
    return out


def finished(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("cedlm_requests_finished_total"))


def cedlm_eval_ppl(path: Path, capsys) -> dict:
    """`cedlm eval ppl --text PATH --json` (the shipped default model), in process."""
    capsys.readouterr()
    assert eval_main(["ppl", "--text", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- the test


def test_lm_eval_local_completions(server, tmp_path, monkeypatch, capsys):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == SERVED
    tasks = write_tasks(tmp_path)
    before = metrics(server)
    model_args = ",".join([
        f"base_url={server}/v1/completions", f"model={SERVED}",
        "tokenizer_backend=huggingface", f"tokenizer={DEFAULT_MODEL}", "tokenized_requests=True",
        f"custom_prefix_token_id={EOS_ID}", "num_concurrent=1", "max_retries=1", "batch_size=8",
        "timeout=60"])
    t0 = time.monotonic()
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                  tasks=["cedlm_mc", "cedlm_ppl"],
                                  task_manager=TaskManager(include_path=str(tasks)),
                                  log_samples=True, bootstrap_iters=0)
    elapsed = time.monotonic() - t0
    res = out["results"]

    # every request answered: /v1/completions only ever said 200, and the engine finished one
    # request per (context, continuation) pair: 10 x 4 choices + 3 documents
    after = metrics(server)
    http = {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith("cedlm_http_requests_total")}
    http = {k: v for k, v in http.items() if v and 'route="/metrics"' not in k}
    assert http and all('route="/v1/completions"' in k and 'status="200"' in k for k in http), http
    assert finished(after) - finished(before) == 10 * 4 + 3

    # multiple choice: an accuracy over the ten items, each scored on all four choices
    mc = res["cedlm_mc"]
    assert 0.0 <= mc["acc,none"] <= 1.0 and 0.0 <= mc["acc_norm,none"] <= 1.0
    samples = out["samples"]["cedlm_mc"]
    assert len(samples) == 10
    for s in samples:
        lls = [r[0] for r in s["filtered_resps"]]
        assert len(lls) == 4 and all(math.isfinite(x) and x < 0 for x in lls)

    # rolling perplexity: the same documents through `cedlm eval ppl`, one file each
    docs = rolling_docs()
    ours = []
    for i, d in enumerate(docs):
        f = tmp_path / f"doc{i}.txt"
        f.write_text(d, encoding="utf-8")
        r = cedlm_eval_ppl(f, capsys)
        assert r["tokens"] < r["seq_len"] and r["bytes"] == len(d.encode("utf-8"))
        ours.append(r)
    nats = sum(r["nats"] for r in ours)
    n_bytes = sum(r["bytes"] for r in ours)
    n_tokens = sum(r["tokens"] for r in ours)
    n_words = sum(len(re.split(r"\s+", d)) for d in docs)
    ppl = res["cedlm_ppl"]
    lm_nats = ppl["bits_per_byte,none"] * math.log(2) * n_bytes     # lm-eval's total NLL
    report = {"lm_eval": {"bits_per_byte": ppl["bits_per_byte,none"],
                          "byte_perplexity": ppl["byte_perplexity,none"],
                          "word_perplexity": ppl["word_perplexity,none"],
                          "token_perplexity": math.exp(lm_nats / n_tokens)},
              "cedlm_eval_ppl": {"bits_per_byte": nats / math.log(2) / n_bytes,
                                 "byte_perplexity": math.exp(nats / n_bytes),
                                 "word_perplexity": math.exp(nats / n_words),
                                 "token_perplexity": math.exp(nats / n_tokens)},
              "mc_acc": mc["acc,none"], "tokens": n_tokens, "bytes": n_bytes, "words": n_words,
              "lm_eval_seconds": round(elapsed, 1)}
    print(json.dumps(report, indent=2))          # shown with a failure
    for k, v in report["cedlm_eval_ppl"].items():
        assert report["lm_eval"][k] == pytest.approx(v, rel=0.01), (k, report)
    # and document by document: lm-eval's loglikelihood is minus cedlm's total NLL
    per_doc = {s["doc_id"]: s["filtered_resps"][0] for s in out["samples"]["cedlm_ppl"]}
    assert sorted(per_doc) == [0, 1, 2]
    for i, r in enumerate(ours):
        ll = per_doc[i][0] if isinstance(per_doc[i], (list, tuple)) else per_doc[i]
        assert -float(ll) == pytest.approx(r["nats"], rel=0.01), (i, ll, r)


def documented_lm_eval_command() -> list[str]:
    """The `lm_eval` command line of docs/serving.md (its fenced bash block), split as a shell would."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", doc, flags=re.S) if b.startswith("lm_eval "))
    return shlex.split(block.replace("\\\n", " "))


def test_documented_command(server, tmp_path):
    """The lm-eval command of docs/serving.md, run as written through the `lm_eval` CLI against the
    running server: only the port (8000 -> this server's), the task (`wikitext`, a hub download -> the local
    `cedlm_ppl`, with `--include_path`) and `--limit 2` differ. `--batch_size` is the CLI's (in
    `--model_args` too it fails with "got multiple values for keyword argument 'batch_size'")."""
    argv = documented_lm_eval_command()
    assert argv[0] == "lm_eval" and "--batch_size" in argv
    i = argv.index("--tasks")
    argv[i + 1] = "cedlm_ppl"
    j = argv.index("--model_args")
    assert "http://127.0.0.1:8000/v1/completions" in argv[j + 1]
    argv[j + 1] = argv[j + 1].replace("http://127.0.0.1:8000", server)
    tasks = write_tasks(tmp_path)
    lm_eval_bin = Path(sys.executable).with_name("lm_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    r = subprocess.run([str(lm_eval_bin), *argv[1:], "--include_path", str(tasks), "--limit", "2"],
                       cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("|cedlm_ppl"))
    value = re.search(r"bits_per_byte\s*\|[^|]*\|\s*([0-9.]+)\s*\|", row)
    assert value and 0 < float(value.group(1)) < 20, row
