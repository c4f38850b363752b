"""Assemble the default model's directory from the joint run's stages, its drafter and vision runs
and the evaluations, with a summary.json the model card is generated from.

    .venv/bin/python experiments/joint_pretraining/assemble.py experiments/joint_pretraining/ship.json OUT_DIR
    .venv/bin/python experiments/joint_pretraining/assemble.py ship.json OUT_DIR --card-only   # docs keys only

The spec (`ship.json`) names, relative to the repository root:
    stages    the joint run's stages in order: {"stage", "run" (a `cedlm train pretrain` run dir),
              "mixture" (its mixture file), "threads"}; the last one's export is the text model.
              A stage without "run" is one of `previous`'s: its row as that model recorded it
    previous  (optional) the shipped directory the first new stage started from (`--init-from`):
              its summary.json gives the rows of the stages trained before
    text      that export (`cedlm export RUN DIR`)
    dspark    the `cedlm train dspark` run trained against it (its export/ adds mtp.safetensors)
    vision    the `cedlm train vision` run trained against it (its export/ adds vision.safetensors
              and the config's vision_config / image_token_id)
    evals     the directory `evaluate.sh` wrote (`val_ppl.json`, `heldout_ppl.json`, `chat.json`,
              `fid_trained.json`, `fid_init.json`, `bench/dspark.json`)
    heldout   the held-out English file of `heldout_ppl.json`
    why       per target, why it was missed (prose, only used for missed targets)
    machine, notes, commands, curves   copied into summary.json (notes: bullets under the targets)
    curve_points   the run's curves (`curves.py`'s JSONL): its validation steps go into the card
    sweep     {"json": the width sweep's output (`sweep.py`), "conclusion", "command"}: into the card
    dspark_bench   (optional) a later `cedlm bench --only dspark` JSON on the shipped model: its
              figures replace those of `evals`' run

The drafter's and the vision tower's exports must carry the text weights of `text` unchanged (checked
tensor by tensor): they were trained against that target. The directory is written atomically; then
`python -m cedlm.train.model_card OUT_DIR` is what `tests/test_model_dir.py` checks it against.
"""
from __future__ import annotations

import bz2
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file

from cedlm.train.chat_data import EVAL_MAX_TOKENS
from cedlm.train.model_card import expected_files
from cedlm.util import atomic_directory

COPIED = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "training_args.json")


def _json(p: Path) -> dict:
    return json.loads(p.read_text("utf-8"))


def _same_text_weights(a: Path, b: Path) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    if x.keys() != y.keys() or any(not x[k].equal(y[k]) for k in x):
        raise SystemExit(f"error: {b} was not trained against {a}: its text weights differ")


def stage_rows(spec: dict, root: Path) -> list[dict]:
    """Per stage: its checkpoint's step, the tokens and wall time up to it (metrics.jsonl; the
    elapsed time carries over resumes), the mixture's row shares and the lengths of its curriculum
    that the stage reached."""
    rows = []
    prev = ({r["stage"]: r for r in _json(root / spec["previous"] / "summary.json")["joint_stages"]}
            if spec.get("previous") else {})
    for st in spec["stages"]:
        if "run" not in st:                # trained before `previous` was shipped
            if st["stage"] not in prev:
                raise SystemExit(f"error: stage {st['stage']} has no run and is not in {spec.get('previous')}")
            rows.append(prev[st["stage"]])
            continue
        run = root / st["run"]
        step = _json(run / "checkpoint" / "training_args.json")["step"]
        recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
        last = [r for r in recs if r["step"] <= step and "elapsed" in r][-1]
        mix = _json(root / st["mixture"])
        rows.append({"stage": st["stage"], "mixture": st["mixture"], "steps": step, "tokens": last["tokens"],
                     "wall_s": round(last["elapsed"], 1), "threads": st["threads"],
                     "weights": mix["weights"], "answer_weight": mix.get("answer_weight", 1.0),
                     "seq_lens": [n for start, n in mix["curriculum"] if start < step]})   # as trained
    return rows


def passkey_rows(trained: dict, init: dict) -> list[dict]:
    return [{"length": int(n), "n": trained["retrieval_samples"][n], "exact": trained["retrieval"][n],
             "exact_init": init["retrieval"].get(n), "token_acc": trained["answer_token_acc"][n],
             "token_acc_init": init["answer_token_acc"].get(n)}
            for n in sorted(trained["retrieval"], key=int)]


def targets(s: dict, why: dict) -> list[dict]:
    """The default model's targets, each with what this model measures."""
    pk = {r["length"]: r for r in s["joint_passkey"]}

    def passkey(n, goal):
        r = pk.get(n)
        return (f"{round(r['exact'] * r['n'])} / {r['n']} ({r['exact']:.0%})" if r else "not run"), \
            bool(r and r["exact"] >= goal)

    out = []
    for n, goal in ((1024, 0.9), (4096, 0.9), (16384, 0.5)):
        m, ok = passkey(n, goal)
        out.append({"id": f"passkey_{n}", "target": f"passkey exact at {n:,} tokens, sparse as shipped",
                    "goal": f">= {goal:.0%}", "measured": m, "met": ok})
    ahead = all(r["exact_init"] is not None and r["token_acc"] > r["token_acc_init"] for r in s["joint_passkey"])
    out.append({"id": "indexer_ahead", "target": "trained indexer ahead of the untrained one at every length",
                "goal": "answer tokens right, trained > at initialisation", "met": ahead,
                "measured": ", ".join(f"{r['token_acc']:.2f} > {r['token_acc_init']:.2f}" for r in s["joint_passkey"])})
    out.append({"id": "val_ppl", "target": "validation perplexity at 256 tokens", "goal": "<= 60",
                "measured": f"{s['val_perplexity']:.1f}", "met": s["val_perplexity"] <= 60})
    out.append({"id": "heldout_bpb", "target": "held-out English bits/byte", "goal": "< bzip2",
                "measured": f"{s['heldout_bits_per_byte']:.3f} (bzip2 {s['bzip2_heldout_bits_per_byte']:.3f})",
                "met": s["heldout_bits_per_byte"] < s["bzip2_heldout_bits_per_byte"]})
    out.append({"id": "chat_end", "target": "greedy chat replies that end their turn", "goal": ">= 95%",
                "measured": f"{s['chat_finished_greedy']:.0%} of {s['chat_heldout_n']}",
                "met": s["chat_finished_greedy"] >= 0.95})
    right = round(s["chat_source_accuracy_greedy"] * s["chat_source_n"])
    out.append({"id": "chat_source", "target": "source questions right (greedy)", "goal": ">= 10 / 16",
                "measured": f"{right} / {s['chat_source_n']}", "met": right >= 10})
    if "vision_digits_heldout_acc" in s:
        out.append({"id": "vision_digits", "target": "vision: held-out digits", "goal": ">= 97%",
                    "measured": f"{s['vision_digits_heldout_acc']:.1%}", "met": s["vision_digits_heldout_acc"] >= 0.97})
        out.append({"id": "vision_words", "target": "vision: held-out words", "goal": ">= 50%",
                    "measured": f"{s['vision_words_heldout_acc']:.1%}", "met": s["vision_words_heldout_acc"] >= 0.5})
    if "dspark_tokens_per_forward" in s:
        out.append(dspark_target(s))
    return with_reasons(out, why)


def dspark_target(s: dict) -> dict:
    return {"id": "dspark", "target": "DSpark tokens per target forward, batch 1", "goal": ">= 3",
            "measured": f"{s['dspark_tokens_per_forward']:.2f}", "met": s["dspark_tokens_per_forward"] >= 3}


def with_reasons(targets: list[dict], why: dict) -> list[dict]:
    """Each missed target gets its reason from the spec's `why` (by id)."""
    for t in targets:
        if not t["met"]:
            t["why"] = why.get(t["id"], "")
    return targets


def summary(spec: dict, root: Path) -> dict:
    ev = root / spec["evals"]
    val, held, chat = _json(ev / "val_ppl.json"), _json(ev / "heldout_ppl.json"), _json(ev / "chat.json")
    trained, init = _json(ev / "fid_trained.json"), _json(ev / "fid_init.json")
    stages = stage_rows(spec, root)
    raw = (root / spec["heldout"]).read_bytes()          # an absolute path stays itself
    s = {"preset": spec.get("preset", "small"),
         "tokens": sum(r["tokens"] for r in stages),
         "train_wall_s_approx": round(sum(r["wall_s"] for r in stages)),
         "joint_stages": stages, "joint_machine": spec.get("machine"),
         "val_perplexity": val["perplexity"], "val_bits_per_byte": val["bits_per_byte"],
         "val_tokens": val["tokens"], "val_bytes": val["bytes"],
         "heldout_text": spec["heldout"], "heldout_bits_per_byte": held["bits_per_byte"],
         "bzip2_heldout_bits_per_byte": 8 * len(bz2.compress(raw, 9)) / len(raw),
         "chat_heldout_n": chat["n_heldout"], "chat_heldout_loss": chat["heldout_loss"],
         "chat_finished_greedy": chat["finished_greedy"], "chat_finished_sampled": chat["finished_sampled"],
         "chat_reply_tokens_greedy": chat["reply_tokens_greedy"], "chat_source_n": chat["n_source"],
         "chat_source_accuracy_greedy": chat["source_accuracy_greedy"], "chat_eval_max_tokens": EVAL_MAX_TOKENS,
         "joint_passkey": passkey_rows(trained, init),
         "indexer_fidelity_len": int(next(iter(trained["text_samples"]))),
         "joint_indexer_kl": trained["kl"], "joint_indexer_kl_init": init["kl"]}
    dspark = root / spec["dspark"]
    s.update(_json(dspark / "summary.json"))
    if (ev / "bench" / "dspark.json").exists():            # `cedlm bench --only dspark` on the drafter's export
        s.update(dspark_keys(_json(ev / "bench" / "dspark.json")))
    vis = _json(root / spec["vision"] / "eval.json")
    s.update({f"vision_{k}" if not k.startswith("vision_") else k: v for k, v in vis.items()
              if k not in ("vision_config", "init", "threads")})
    s["joint_targets"] = targets(s, spec.get("why", {}))
    s.update(doc_keys(spec, root))
    return s


def dspark_keys(b: dict) -> dict:
    """The card's DSpark figures from a `cedlm bench --only dspark` JSON (batch 1, whole block)."""
    row = next(r for r in b["rows"] if r["batch"] == 1 and r["config"] == "dspark_block" and "context" not in r)
    d = {"dspark_tokens_per_forward": row["tokens_per_forward"],
         "dspark_acceptance_by_position": [round(a, 4) for a in row["acceptance_by_position"]],
         "dspark_speedup_batch1": round(row["speedup"], 3)}
    b8 = [r for r in b["rows"] if r["batch"] == 8 and r["config"] == "dspark_block"]
    if b8:
        d["dspark_speedup_batch8"] = round(b8[0]["speedup"], 3)
    return d


def curve_points(path: Path) -> list[dict]:
    """The validation steps of the run's curves (`curves.py`'s JSONL), compact, for the card."""
    out = []
    for line in path.read_text("utf-8").splitlines():
        r = json.loads(line) if line.strip() else {}
        if "val_ppl" not in r:
            continue
        p = {"stage": r["stage"] + 1, "step": r["global_step"], "tokens": r["global_tokens"],
             "seq_len": r.get("seq_len"), "phase": r.get("phase"), "loss": round(r["loss"], 4),
             "val_ppl": round(r["val_ppl"], 2)}
        if r.get("val_retrieval_acc") is not None:
            p.update(retrieval_acc=round(r["val_retrieval_acc"], 4),
                     retrieval_exact=round(r["val_retrieval_exact"], 4), retrieval_len=r["val_retrieval_len"])
        out.append(p)
    return out


def doc_keys(spec: dict, root: Path) -> dict:
    """The summary keys that come from the spec and the repository's docs, not from the run dirs: the
    notes, the curves (plot and validation points), the width sweep, the commands. `--card-only`
    refreshes just these (and the targets' reasons) in a shipped directory."""
    d = {"joint_notes": spec.get("notes", []), "joint_curves": spec.get("curves"),
         "commands": spec.get("commands", [])}
    if spec.get("curve_points"):
        d["joint_curve_points"] = curve_points(root / spec["curve_points"])
    if spec.get("dspark_bench"):           # a later run of the DSpark figure on the shipped model
        d.update(dspark_keys(_json(root / spec["dspark_bench"])))
    if spec.get("sweep"):
        sw = spec["sweep"]
        d["joint_sweep"] = {**_json(root / sw["json"]), "conclusion": sw.get("conclusion"),
                            "command": sw.get("command")}
    return d


def card_only(spec: dict, root: Path, out: Path) -> int:
    """Refresh a shipped directory's summary.json keys from the spec and docs (`doc_keys`, the missed
    targets' reasons) and regenerate its card files; the weights and configs are left as they are."""
    from cedlm.util import atomic_write_text
    s = _json(out / "summary.json")
    s.update(doc_keys(spec, root))
    if "dspark_tokens_per_forward" in s:       # the drafter's target follows its latest figure
        s["joint_targets"] = [dspark_target(s) if t["id"] == "dspark" else t for t in s.get("joint_targets", [])]
    with_reasons(s.get("joint_targets", []), spec.get("why", {}))
    atomic_write_text(out / "summary.json", json.dumps(s, indent=2) + "\n")
    for name, body in expected_files(out).items():
        atomic_write_text(out / name, body)
    print(f"refreshed {out}/summary.json and its card files (weights unchanged)")
    return 0


def main(argv: list[str]) -> int:
    only = "--card-only" in argv
    argv = [a for a in argv if a != "--card-only"]
    if len(argv) != 2:
        print("usage: assemble.py SHIP_JSON OUT_DIR [--card-only]", file=sys.stderr)
        return 2
    root = Path.cwd()
    spec = _json(Path(argv[0]))
    if only:
        return card_only(spec, root, Path(argv[1]))
    text, dspark = root / spec["text"], root / spec["dspark"] / "export"
    vision = root / spec["vision"] / "export"
    _same_text_weights(text, dspark)
    _same_text_weights(text, vision)
    cfg, vcfg = _json(text / "config.json"), _json(vision / "config.json")
    if {k: v for k, v in vcfg.items() if k not in ("vision_config", "image_token_id")} != \
            {k: v for k, v in cfg.items() if k not in ("vision_config", "image_token_id")}:
        raise SystemExit(f"error: {vision}'s config differs from {text}'s beyond its vision_config")
    s = summary(spec, root)
    with atomic_directory(Path(argv[1])) as tmp:
        for name in COPIED:
            shutil.copy(text / name, tmp / name)
        shutil.copy(vision / "config.json", tmp / "config.json")     # the text config + the tower's
        shutil.copy(dspark / "mtp.safetensors", tmp / "mtp.safetensors")
        shutil.copy(vision / "vision.safetensors", tmp / "vision.safetensors")
        (tmp / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
        for name, body in expected_files(tmp).items():
            (tmp / name).write_text(body, encoding="utf-8")
    print(f"wrote {argv[1]}: {len(s['joint_stages'])} stages, {s['tokens']:,} tokens")
    for t in s["joint_targets"]:
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['measured']} (goal {t['goal']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
