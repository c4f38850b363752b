"""The server against its own OpenAPI schema, fuzzed by schemathesis.

The app runs in-process over ASGI (schemathesis starts its lifespan, so the engine thread runs),
serving the `tiny` preset with a short context and a one-token default `max_tokens`, so that any
generated request is either refused (400) or cheap to honour. Every documented operation gets
schemathesis' coverage phase (boundary and invalid values of every field, one of each) and a
bounded fuzzing phase (`MAX_EXAMPLES` generated requests, derandomised: the same requests on
every run, as CI needs). Every response must pass:

- `not_a_server_error`: no 5xx (but the documented 501 of a Responses feature cedlm does not serve);
- `status_code_conformance`: the status is one the schema documents for that operation;
- `response_schema_conformance`: the body matches the documented schema of that status;
- `positive_data_acceptance`: a request valid under the published schema is
  accepted (no 400), on every operation but `/v1/responses`; the exception is a 400 whose code
  names a rule between fields or a run-time limit that the operation's description documents
  (`openapi_rules.RUNTIME_CODES`: JSON schema cannot state them).

schemathesis comes with the `eval` extra, its version pinned in requirements.lock. The module
takes about 40 s on a busy 2-core CPU machine (about 1,300 requests).
"""
from __future__ import annotations

import collections
import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    positive_data_acceptance, response_schema_conformance, status_code_conformance,
)

from cedlm.server.openapi_rules import RUNTIME_CODES  # noqa: E402

torch.set_num_threads(1)

# fuzzed requests per operation (the coverage phase adds its own); a longer campaign:
# CEDLM_SCHEMATHESIS_EXAMPLES=400 pytest tests/test_schemathesis.py (RELIABILITY.md)
MAX_EXAMPLES = int(os.environ.get("CEDLM_SCHEMATHESIS_EXAMPLES", "10"))
MAX_MODEL_LEN = 32                      # a larger max_tokens or prompt is a 400; a smaller one is cheap
DOCUMENTED = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("GET", "/health"), ("GET", "/metrics")}


def not_a_server_error_but_unsupported(ctx, response, case):
    """not_a_server_error, except the documented 501 naming a Responses feature cedlm does not
    serve (code `unsupported_feature`; status_code_conformance checks that the route documents it)."""
    if response.status_code == 501 and response.json().get("error", {}).get("code") == "unsupported_feature":
        return None
    return not_a_server_error(ctx, response, case)


# responses checked, by operation and status; the 400s let pass for a documented rule also by code
CHECKED: collections.Counter = collections.Counter()


def schema_valid_is_accepted(ctx, response, case):
    """positive_data_acceptance, but for a 400 naming a documented rule between fields or a
    run-time limit (its code in RUNTIME_CODES, the rule in the operation's description); the
    Responses API (a schema of its own) is left out."""
    CHECKED[f"{case.operation.label} {response.status_code}"] += 1
    if case.operation.path == "/v1/responses":
        return None
    if response.status_code == 400:
        code = response.json().get("error", {}).get("code")
        if code in RUNTIME_CODES and "Rules between fields" in (case.operation.definition.raw.get("description") or ""):
            CHECKED[f"{case.operation.label} 400 {code}"] += 1
            return None
    return positive_data_acceptance(ctx, response, case)


CHECKS = [not_a_server_error_but_unsupported, status_code_conformance, response_schema_conformance,
          schema_valid_is_accepted]


@pytest.fixture(scope="module")
def _app_schema():
    """The schema of an app serving the `tiny` preset, loaded over ASGI: built when the first test
    of this module runs, not at collection."""
    from cedlm.engine.llm import LLM
    from cedlm.server.app import create_app

    llm = LLM("tiny", kv_budget_bytes=16 << 20, replay_mode="exact", num_threads=1, max_num_seqs=4,
              max_model_len=MAX_MODEL_LEN)
    # no request may wait long for admission, so one slow example cannot stall the run
    app = create_app(llm, served_model_name="cedlm-tiny", queue_timeout=5.0, max_waiting=16,
                     default_max_tokens=1)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # coverage + fuzzing; the examples phase repeats coverage's work and there are no links to
    # follow statefully
    schema.config.phases.update(phases=["coverage", "fuzzing"])
    return schema


@pytest.fixture
def api_schema(_app_schema, request):
    """The schema, for schemathesis' lazy loader (`from_fixture`): each documented operation runs
    as a subtest of test_api_conforms_to_its_schema, labelled with its method and path. The loader
    reads and relabels the test's `_nodeid`, which pytest 9's items no longer have: given here."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid
    return _app_schema


schema = schemathesis.pytest.from_fixture("api_schema")


def test_every_documented_endpoint_is_in_the_schema(_app_schema):
    ops = {(op.method.upper(), op.path) for op in (r.ok() for r in _app_schema.get_all_operations())}
    missing = sorted(f"{m} {p}" for m, p in DOCUMENTED if (m, p) not in ops)
    assert not missing, f"operations missing from /openapi.json: {missing}"


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    case.call_and_validate(checks=CHECKS)


def teardown_module():
    """With CEDLM_SCHEMATHESIS_COUNT=<file>: write the responses checked, by operation and status
    (the campaign's count in RELIABILITY.md)."""
    path = os.environ.get("CEDLM_SCHEMATHESIS_COUNT")
    if path:
        with open(path, "w") as f:
            total = sum(v for k, v in CHECKED.items() if len(k.split()) == 3)   # "METHOD path status"
            json.dump({"total": total, **dict(sorted(CHECKED.items()))}, f, indent=1)
