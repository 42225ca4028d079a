"""Where the batched engine's host time per step goes (GPU machine): the tiny-d128 workload of
``conformance engine bench`` through triton, warmed up, measured twice, the second run under
cProfile. Used to find one-time compiles inside measured steps.

    python tests/benchmarks/profile_engine_host.py oracle:random:0.7 async
"""
import cProfile, pstats, sys, io, json, time
import torch
from reference_engine.batched_engine import BatchedEngine
from reference_engine.engine import EngineConfig
from reference_engine.metrics import measure
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.sampling import SamplingParams
drafter, loop = sys.argv[1], sys.argv[2]
model = LlamaModel.random(PRESETS["tiny-d128"], 0, torch.bfloat16, torch.device("cuda"))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 512, (128,), generator=g).tolist() for _ in range(8)]
cfg = EngineConfig(model=model.config, backend="triton", device="cuda", dtype=torch.bfloat16, num_blocks=1024, max_num_tokens=512,
                   max_num_reqs=8, num_spec_tokens=3, drafter=drafter, async_scheduling=loop == "async", cuda_graphs=True)
engine = BatchedEngine(cfg, model)
params = SamplingParams(max_tokens=128, ignore_eos=True)
engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
for attempt in range(2):
    profiler = cProfile.Profile() if attempt else None
    if profiler: profiler.enable()
    outputs, m = measure(engine, prompts, params)
    if profiler: profiler.disable()
    launches = [round(1e3 * r.host_launch_s, 2) for r in engine.steps]
    print(drafter, loop, "attempt", attempt, "tpot", round(m.tpot_ms, 3), "ttft", round(m.ttft_ms, 1), "tok/s", round(m.tokens_per_s), "idle", round(m.gpu_idle_fraction, 4), m.host_ms_per_step)
    print("  launch ms per step:", launches[:12], "... max", max(launches), "captured", sum(r.captured for r in engine.steps))
stream = io.StringIO()
pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(22)
print(stream.getvalue()[:6000])
