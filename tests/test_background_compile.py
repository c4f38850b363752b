"""The compiled decode step off the serving path: built in a background thread while the engine
steps on the same step uncompiled, adopted at a step boundary, the same tokens either way; and one
captured graph per batch kind (1, >= 2) whatever the context length, so that no prompt recompiles
mid-request. Both run with dynamo's capture and guards alone (backend "eager": seconds, no code
generation; inductor compiles the same captures, and the step's pools are padded so that its own
shape decisions hold at every length: `CompiledDecode.min_entries`)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cedlm.config import ModelConfig
from cedlm.model import CEDModel
from cedlm.engine.llm import LLM
from cedlm.engine.sampling_params import SamplingParams
from cedlm.model import compiled_step


@pytest.fixture
def eager_backend(monkeypatch):
    monkeypatch.setattr(compiled_step, "BACKEND", "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()          # graphs counted from here (other tests compile too)
    yield
    torch._dynamo.reset()


def test_background_compile_is_adopted_at_a_step_boundary_and_never_recompiles(eager_backend):
    # the tiny preset with a candidate pool of 12 blocks and 8-token KV blocks: the pool outgrows
    # one KV block within the first prompts (as the shipped model's 32 x 8 entries outgrow its
    # 64-token blocks at a few hundred tokens)
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), candidate_topk_blocks=12)
    opts = dict(num_threads=1, enable_prefix_cache=False, block_tokens=8)

    def model():
        torch.manual_seed(0)
        return CEDModel(cfg)
    p = SamplingParams(max_tokens=6, temperature=0)
    prompts = [list(range(5, 25)), list(range(9, 13))]
    want = [o.outputs[0].token_ids for o in LLM(model(), decode_step="static", **opts).generate(prompts, p)]

    llm = LLM(model(), decode_step="compiled", **opts)      # starts compiling in the background
    eng = llm.engine
    bg = eng.compile_in_background()                        # the running one
    assert bg is not None and eng.decoder.active_mode == "static"
    assert eng.compile_status()["decode_step"] == "static"
    kv = eng.kv_stats()                                      # the scratch sequences' blocks,
    assert kv["blocks_compiling"] > 0 and kv["blocks_in_use"] == 0      # not counted as in use
    assert eng.pool.num_used == kv["blocks_compiling"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == want   # while it compiles
    assert bg.wait(600) and not bg.failed, bg.failed
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 2                                       # batch 1, batch >= 2
    # adopted at a step boundary (during the generate above if the compile finished by then)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == want
    assert eng.decoder.active_mode == "compiled"
    assert eng.compile_status() == {"decode_step": "compiled", "compiling": None}
    assert eng.kv_stats()["blocks_compiling"] == 0 and eng.pool.num_used == 0   # freed on adoption

    # prompts from a few entries to well past index_topk and the candidate pool's blocks
    # (candidate_topk_blocks x candidate_block_size entries), where a width-dependent top-k
    # would be a new constant; then batches of other sizes and lengths: no new graph
    p = SamplingParams(max_tokens=3, temperature=0)
    longest = 4 * cfg.candidate_topk_blocks * cfg.candidate_block_size * max(cfg.compress_ratios) + 40
    for n in (3, 9, 17, 40, longest):
        llm.generate([list(range(5, 5 + n))], p)
    llm.generate([list(range(5, 12)), list(range(7, 7 + longest))], p)
    llm.generate([list(range(5, 9)), list(range(6, 30)), list(range(9, 9 + longest))], p)
    assert eng.decoder.active_mode == "compiled"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, dict(torch._dynamo.utils.counters["stats"])


def test_speculative_shadows_build_their_inputs_as_compiled(monkeypatch, eager_backend):
    """With DSpark, the verify step's shadow reads its inputs through the decode step's shadow
    (compiled: dynamic dimensions marked as in the graphs it will serve), and the pending compile
    is on the shared step object, so that any engine of the model adopts it."""
    from cedlm.engine.warmup import BackgroundCompile
    monkeypatch.setattr(BackgroundCompile, "start", lambda self: self)      # nothing runs
    torch.manual_seed(0)
    llm = LLM(CEDModel(ModelConfig.preset("tiny"), dspark=True), decode_step="compiled", num_threads=1,
              speculative="dspark", speculative_policy="always")
    eng = llm.engine
    bg, pairs = eng.decoder.pending
    assert [type(step).__name__ for step, _ in pairs] == ["CompiledDecode", "VerifyStep", "DraftStep"]
    assert all(not step.compile and shadow.compile for step, shadow in pairs)
    assert pairs[1][1].decoder is pairs[0][1]
    assert len(bg.jobs) == 6 and eng.compile_in_background() is bg
    assert eng.compile_status()["decode_step"] == "static"


def test_warm_up_waits_for_the_background_compile_and_adopts_it(monkeypatch):
    """`Engine.warm_up` (what `cedlm warmup` and a foreground start call) on an engine whose
    graphs are being built in the background waits for them and switches to them."""
    from cedlm.engine.warmup import BackgroundCompile
    ran = []
    monkeypatch.setattr(BackgroundCompile, "start", lambda self: ran.append(self) or self)  # held
    llm = LLM("tiny", decode_step="compiled", num_threads=1)
    eng = llm.engine
    bg, pairs = eng.decoder.pending
    assert ran == [bg] and eng.decoder.active_mode == "static" and eng.kv_stats()["blocks_compiling"] > 0
    bg.jobs = [("decode graph for batch 1", lambda: None)]      # stands in for the compile
    monkeypatch.undo()
    bg.start()
    assert eng.warm_up() == {"decode graph for batch 1": bg.seconds["decode graph for batch 1"]}
    assert eng.decoder.pending is None and eng.decoder.active_mode == "compiled"
    assert eng.kv_stats()["blocks_compiling"] == 0 and eng.pool.num_used == 0
