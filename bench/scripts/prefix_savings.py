"""Prefix-hit savings on the small preset: encoder tokens and wall time, hit vs cold."""
import json, time, torch
torch.set_num_threads(1)
from cedlm import CEDModel, ModelConfig, LLM, SamplingParams
torch.manual_seed(0)
model = CEDModel(ModelConfig.preset("small")).eval()
shared = torch.randint(20, 4000, (1024,), generator=torch.Generator().manual_seed(1)).tolist()
sp = SamplingParams(max_tokens=1, temperature=0)
res = {}
for mode in ("bounded", "exact"):
    llm = LLM(model, block_tokens=64, replay_mode=mode, prefill_mode="bounded")
    llm.generate([shared + [5, 6, 7]], sp)                       # warm: publishes 16 blocks
    times_cold, times_hit = [], []
    for i in range(3):
        cold = LLM(model, block_tokens=64, enable_prefix_cache=False, prefill_mode="bounded")
        t = time.perf_counter(); cold.generate([shared + [9, 10 + i]], sp); times_cold.append(time.perf_counter() - t)
        c0 = dict(llm.engine.counters)
        t = time.perf_counter(); o = llm.generate([shared + [9, 10 + i]], sp)[0]; times_hit.append(time.perf_counter() - t)
        enc = llm.engine.counters["encoder_tokens"] - c0["encoder_tokens"]
        rep = llm.engine.counters["replay_tokens"] - c0["replay_tokens"]
    times_cold.sort(); times_hit.sort()
    res[mode] = {"prompt_tokens": len(shared) + 2, "cached_tokens": o.num_cached_tokens,
                 "encoder_tokens_with_hit": enc, "replay_tokens": rep,
                 "median_s_cold": times_cold[1], "median_s_hit": times_hit[1],
                 "speedup": times_cold[1] / times_hit[1]}
print(json.dumps(res, indent=2))
