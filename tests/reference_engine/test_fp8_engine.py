"""The reference engine over an fp8 KV cache: fp8 pools, each layer its own scales, and greedy
speculative decoding (sync and async) emitting the plain greedy tokens."""

import dataclasses

import torch

from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.sampling import SamplingParams

CONFIG = EngineConfig(
    model=PRESETS["tiny"],
    backend="torch_naive",
    kv_cache_dtype=torch.float8_e4m3fn,
    num_blocks=64,
    max_num_reqs=4,
    max_num_tokens=128,
)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def tokens(config: EngineConfig, model) -> list[list[int]]:
    return [out.tokens for out in BatchedEngine(config, model).generate(PROMPTS, PARAMS)]


def test_an_fp8_engine_keeps_fp8_pools_with_scales_per_layer_and_spec_equals_plain():
    model = LlamaModel.random(CONFIG.model, 0, torch.float32, torch.device("cpu"))
    engine = BatchedEngine(CONFIG, model)
    assert all(caches.attention.dtype == torch.float8_e4m3fn for caches in engine.kv_caches)
    assert len({scales.k_scale for scales in engine.kv_scales}) == CONFIG.model.num_layers
    plain = tokens(CONFIG, model)
    for drafter in ("layer-skip", "scripted:random:0.5"):
        for async_scheduling in (False, True):
            spec = dataclasses.replace(CONFIG, num_spec_tokens=3, drafter=drafter, async_scheduling=async_scheduling)
            assert tokens(spec, model) == plain, (drafter, async_scheduling)


def test_the_layers_scales_reach_the_backend():
    """A backend that keeps the first layer's scales for every layer changes what the model emits."""
    model = LlamaModel.random(CONFIG.model, 0, torch.float32, torch.device("cpu"))
    kept = dataclasses.replace(CONFIG, backend="tests.planted.fp8_defects:KeepsFirstLayerScales")
    assert tokens(kept, model) != tokens(CONFIG, model)


def test_an_fp8_query_engine_quantizes_each_layers_query_and_spec_equals_plain():
    """``--fp8-query``: each layer's q scale its own (k and v 1 without an fp8 cache), spec == plain,
    and a backend that drops the scale emits other tokens."""
    model = LlamaModel.random(CONFIG.model, 0, torch.float32, torch.device("cpu"))
    query = dataclasses.replace(CONFIG, kv_cache_dtype=None, query_dtype=torch.float8_e4m3fn)
    engine = BatchedEngine(query, model)
    layers = range(CONFIG.model.num_layers)
    assert [(s.q_scale, s.k_scale) for s in engine.kv_scales] == [(0.05 * (1 + layer / 2), 1.0) for layer in layers]
    plain = tokens(query, model)
    spec = dataclasses.replace(query, num_spec_tokens=3, drafter="layer-skip")
    assert tokens(spec, model) == plain
    dropped = dataclasses.replace(query, backend="tests.planted.fp8_query_defects:QScaleDropped")
    assert tokens(dropped, model) != plain
