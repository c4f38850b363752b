"""The sampling a request gets for what it leaves unset: the model's `generation_config.json`.

As vLLM does (`--generation-config auto`, its default), `cedlm serve` reads the model
directory's generation_config.json once at start and uses its `temperature`, `top_p`, `top_k`,
`min_p` and `repetition_penalty` for every request that does not set them; a request's own value
always wins. `LLM.generate` and `LLM.chat` without sampling parameters use the same values
(`LLM.default_sampling_params`). `do_sample: false` means greedy (temperature 0), as in transformers. Without the file
(a preset, `--generation-config none`) the neutral values apply: temperature 1, top_p 1, top_k off,
no penalty. The shipped model's values, and why: docs/serving.md, "Sampling defaults";
`cedlm.train.model_card.GENERATION_DEFAULTS` writes them.
"""
from __future__ import annotations

import json
from pathlib import Path

# the request fields a generation_config.json may supply, with cedlm's neutral value for each
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def read(path: str | Path | None) -> dict:
    """{field: value} from a generation_config.json (or the directory holding one); {} when there
    is none. Only the fields of NEUTRAL, each checked to be a number."""
    if path is None:
        return {}
    p = Path(path)
    if p.is_dir():
        p = p / "generation_config.json"
    if not p.is_file():
        return {}
    gc = json.loads(p.read_text("utf-8"))
    out = {}
    for name in NEUTRAL:
        v = gc.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = type(NEUTRAL[name])(v)
    if gc.get("do_sample") is False:            # transformers: greedy, whatever the temperature says
        out["temperature"] = 0.0
    return out


def describe(defaults: dict) -> str:
    """'temperature 0.6, top_p 0.9' (the values that differ from the neutral ones), or 'none'."""
    diff = [f"{k} {v:g}" for k, v in defaults.items() if v != NEUTRAL[k]]
    return ", ".join(diff) or "none"
