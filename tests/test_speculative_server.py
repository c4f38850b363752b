"""`cedlm serve --speculative` and `cedlm generate --speculative`: same greedy output as without
(policy "always" and the default adaptive one), the DSpark counters and the policy's decisions in
/metrics and the stats, clear one-line errors for bad options."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from cedlm.config import ModelConfig  # noqa: E402
from cedlm.engine.llm import LLM  # noqa: E402
from cedlm.engine.sampling_params import SamplingParams  # noqa: E402
from cedlm.model import CEDModel  # noqa: E402
from cedlm.server.app import create_app  # noqa: E402
from tests.test_server import serve  # noqa: E402

torch.set_num_threads(1)


def _model():
    torch.manual_seed(0)
    return CEDModel(ModelConfig.preset("tiny").replace(initializer_range=0.08), dspark=True).eval()


def _completion(base, prompt):
    r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_server_speculative_matches_plain_and_exports_metrics():
    m = _model()
    plain = create_app(LLM(m, kv_budget_bytes=8 << 20, num_threads=1), served_model_name="m")
    spec = create_app(LLM(m, kv_budget_bytes=8 << 20, num_threads=1, speculative="dspark",
                          speculative_policy="always"), served_model_name="m")
    prompts = ["It is a truth", "In the beginning"]
    with serve(plain) as base:
        want = [_completion(base, p) for p in prompts]
    with serve(spec) as base:
        got = [_completion(base, p) for p in prompts]
        metrics = httpx.get(f"{base}/metrics").text
    assert got == want
    vals = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
            if ln and not ln.startswith("#")}
    assert vals['cedlm_spec_steps_total{model_name="m"}'] > 0
    assert vals['cedlm_spec_emitted_tokens_total{model_name="m"}'] == 2 * 11     # first tokens: prefill
    assert 'cedlm_spec_acceptance_by_position{model_name="m",position="1"}' in vals
    # the latency histograms see the speculative requests too (where the speed-up shows)
    assert vals['cedlm_time_per_output_token_seconds_count{model_name="m"}'] == 2
    assert vals['cedlm_request_generation_tokens_sum{model_name="m"}'] == 2 * 12
    # policy "always": every decode step speculated
    assert vals['cedlm_spec_decode_num_speculative_steps_total{model_name="m"}'] > 0
    assert vals['cedlm_spec_decode_num_plain_steps_total{model_name="m"}'] == 0
    assert vals['cedlm_spec_decode_enabled{model_name="m"}'] == 1


def _metrics(base) -> dict:
    text = httpx.get(f"{base}/metrics").text
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def test_server_adaptive_policy_matches_plain_and_exports_its_decisions():
    """The default policy (adaptive): the same greedy text; /metrics carries the acceptance rate,
    the steps that speculated and that did not, and the measured cost of a speculative step
    against a plain one by batch bucket."""
    m = _model()
    plain = create_app(LLM(m, kv_budget_bytes=8 << 20, num_threads=1), served_model_name="m")
    spec = create_app(LLM(m, kv_budget_bytes=8 << 20, num_threads=1, speculative="dspark"),
                      served_model_name="m")
    prompts = ["It is a truth", "In the beginning"]
    with serve(plain) as base:
        want = [_completion(base, p) for p in prompts]
    with serve(spec) as base:
        got = [_completion(base, p) for p in prompts]
        vals = _metrics(base)
    assert got == want
    lab = '{model_name="m"}'
    spec_steps = vals[f"cedlm_spec_decode_num_speculative_steps_total{lab}"]
    plain_steps = vals[f"cedlm_spec_decode_num_plain_steps_total{lab}"]
    assert spec_steps >= 2 and plain_steps >= 1          # each kind measured (speculation first)
    assert vals[f"cedlm_spec_decode_num_exploration_steps_total{lab}"] >= 3
    assert 0 <= vals[f"cedlm_spec_decode_draft_acceptance_rate{lab}"] <= 1
    assert 1 <= vals[f"cedlm_spec_decode_tokens_per_verify{lab}"] <= 6
    assert vals[f"cedlm_spec_decode_enabled{lab}"] in (0, 1)
    assert vals['cedlm_spec_decode_cost_ratio{batch_bucket="1",model_name="m"}'] > 0
    # the speculative emissions cover the tokens of the steps that speculated only
    assert vals[f"cedlm_spec_emitted_tokens_total{lab}"] < 2 * 11


def test_llm_options():
    m = _model()
    llm = LLM(m, num_threads=1, speculative="dspark", speculative_threshold=0.5)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(out.token_ids) == 5 and llm.stats()["spec_steps"] > 0
    with pytest.raises(ValueError, match="speculative: unknown method"):
        LLM(m, speculative="eagle")
    with pytest.raises(ValueError, match="speculative_threshold"):
        LLM(m, speculative="dspark", speculative_threshold=2.0)
    with pytest.raises(ValueError, match="need speculative"):
        LLM(m, speculative_threshold=0.5)
    with pytest.raises(ValueError, match="need speculative"):
        LLM(m, speculative_policy="always")
    with pytest.raises(ValueError, match="speculative_policy"):
        LLM(m, speculative="dspark", speculative_policy="sometimes")
    llm = LLM(m, num_threads=1, speculative="dspark", speculative_policy="always")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0))
    assert llm.stats()["spec_policy"] == "always" and llm.stats()["spec_plain_steps"] == 0


@pytest.mark.parametrize("args,msg", [
    (["--speculative", "medusa"], "speculative: unknown method"),
    (["--speculative", "--speculative-threshold", "3"], "speculative_threshold"),
    (["--speculative-policy", "always"], "need speculative"),
    (["--speculative"], "speculative: this model has no DSpark drafter"),
])
def test_cli_errors_are_one_line(args, msg, capsys):
    from cedlm.cli import main
    rc = main(["generate", "--model", "tiny", "--random-weights", "--prompt", "hi", "--max-tokens", "2",
               "--threads", "1", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert msg in err and len(err.strip().splitlines()) == 1, err
