"""The MLA variant: absorbed attention through the backend equals the non-absorbed formula, and
greedy speculative decoding stays exact with it."""

import dataclasses
import math

import pytest
import torch

from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.model import PRESETS, rms_norm
from reference_engine.sampling import SamplingParams

CONFIG = dataclasses.replace(PRESETS["tiny-mla"], num_layers=1)


def non_absorbed_logits(model, ids):
    """Keys and values materialised per head from the latent (no absorption), plain attention."""
    config, layer = model.config, model.layers[0]
    mla = layer.mla
    heads, nope, rope, rank = config.num_heads, config.qk_nope_dim, config.qk_rope_dim, config.kv_lora_rank
    positions = torch.arange(len(ids))

    def rotate(x):  # half-split rotary, as the model's apply_rope
        half = x.shape[-1] // 2
        frequencies = config.rope_theta ** (-torch.arange(half).float() / half)
        angles = positions.float()[:, None, None] * frequencies
        return torch.cat(
            [
                x[..., :half] * angles.cos() - x[..., half:] * angles.sin(),
                x[..., :half] * angles.sin() + x[..., half:] * angles.cos(),
            ],
            dim=-1,
        )

    x = model.embed.weight[ids]
    h = rms_norm(x, layer.input_norm, config.rms_norm_eps)
    q = (h @ mla.q_proj.weight.T).view(len(ids), heads, nope + rope)
    q = torch.cat([q[..., :nope], rotate(q[..., nope:])], dim=-1)
    down = h @ mla.kv_down.weight.T
    latent = rms_norm(down[:, :rank], mla.kv_norm, config.rms_norm_eps)
    k_pe = rotate(down[:, None, rank:])
    keys = torch.cat([torch.einsum("tr,hnr->thn", latent, mla.w_uk), k_pe.expand(-1, heads, -1)], dim=-1)
    values = torch.einsum("tr,hrv->thv", latent, mla.w_uv)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(nope + rope)
    scores = scores.masked_fill(torch.ones(len(ids), len(ids)).triu(1).bool(), float("-inf"))
    x = x + torch.einsum("hqk,khv->qhv", scores.softmax(-1), values).reshape(len(ids), -1) @ mla.o_proj.weight.T
    h = rms_norm(x, layer.post_norm, config.rms_norm_eps)
    gate, up = (h @ layer.gate_up.weight.T).chunk(2, dim=-1)
    x = x + (torch.nn.functional.silu(gate) * up) @ layer.down.weight.T
    return rms_norm(x, model.final_norm, config.rms_norm_eps) @ model.lm_head.weight.T


def test_absorbed_mla_equals_the_non_absorbed_formula():
    engine = Engine(EngineConfig(model=CONFIG))
    prompt = list(range(5, 30))
    torch.testing.assert_close(engine.score(prompt), non_absorbed_logits(engine.model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("drafter", ["scripted:random:0.5", "layer-skip:1", "eagle"])
def test_greedy_speculative_equals_plain_with_mla(drafter):
    config = PRESETS["tiny-mla"]
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40))]
    params = SamplingParams(max_tokens=10)
    plain = Engine(EngineConfig(model=config)).generate(prompts, params)
    speculative = Engine(EngineConfig(model=config, num_spec_tokens=3, drafter=drafter)).generate(prompts, params)
    assert [o.tokens for o in speculative] == [o.tokens for o in plain]


@pytest.mark.parametrize("drafter", ["scripted:random:0.5", "layer-skip:1", "eagle", "mtp"])
def test_greedy_speculative_equals_plain_with_sparse_mla(drafter):
    """DeepSeek's sparse MLA (``tiny-dsa``: a top-32 of each layer's indexer and a window part of 8)
    over prompts longer than both: drafting through the sparse layers stays exact, and the layers
    are sparse (their logits differ from the dense model's)."""
    config = PRESETS["tiny-dsa"]
    prompts = [list(range(3, 80)), list(range(10, 110)), [1, 2, 3]]
    params = SamplingParams(max_tokens=12)
    plain = Engine(EngineConfig(model=config)).generate(prompts, params)
    speculative = Engine(EngineConfig(model=config, num_spec_tokens=3, drafter=drafter)).generate(prompts, params)
    assert [o.tokens for o in speculative] == [o.tokens for o in plain]
    dense = dataclasses.replace(config, index_topk=None, index_window=None)
    prompt = list(range(3, 80))
    assert not torch.allclose(
        Engine(EngineConfig(model=config)).score(prompt), Engine(EngineConfig(model=dense)).score(prompt)
    )


@pytest.mark.parametrize("k", [1, 4])
def test_mtp_drafting_through_sparse_layers_async_equals_sync_equals_plain(k):
    """DeepSeek's MTP module drafting k tokens (one module reused, as vLLM runs it) through the
    sparse layers, in the batched engine: async scheduling and sync both give plain decoding's
    tokens, and every draft step runs the head through the backend (drafts are proposed)."""
    from reference_engine.batched_engine import BatchedEngine

    config = PRESETS["tiny-dsa"]
    prompts = [list(range(3, 80)), list(range(10, 110)), [1, 2, 3]]
    params = SamplingParams(max_tokens=12)
    plain = [o.tokens for o in Engine(EngineConfig(model=config)).generate(prompts, params)]
    for scheduling in (False, True):
        engine = BatchedEngine(
            EngineConfig(model=config, num_spec_tokens=k, drafter="mtp", async_scheduling=scheduling, check_inputs=True)
        )
        outputs = engine.generate(prompts, params)
        assert [o.tokens for o in outputs] == plain
        assert all(o.drafted > 0 for o in outputs)


@pytest.mark.gpu
def test_mtp_drafting_through_sparse_layers_on_a_gpu():
    """The same on a CUDA device, fp32 through torch_naive (exact), with async scheduling and
    the MTP module drafting 4 tokens a step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from reference_engine.batched_engine import BatchedEngine

    config = PRESETS["tiny-dsa"]
    prompts = [list(range(3, 80)), list(range(10, 110)), [1, 2, 3]]
    params = SamplingParams(max_tokens=12)
    plain = [o.tokens for o in Engine(EngineConfig(model=config, device="cuda")).generate(prompts, params)]
    engine = BatchedEngine(
        EngineConfig(model=config, device="cuda", num_spec_tokens=4, drafter="mtp", async_scheduling=True)
    )
    outputs = engine.generate(prompts, params)
    assert [o.tokens for o in outputs] == plain and all(o.drafted > 0 for o in outputs)


def test_each_sparse_layers_lightning_indexer_chooses_from_the_tokens_and_leaves_the_window_part_alone():
    """``tiny-dsa``'s rows come from a learned indexer (an fp8 key cache of its own, through
    torch_indexer on a CPU): they depend on the prompt, and hold no position inside the window part
    (the window attends those itself)."""
    from reference_engine.lightning_indexer import LightningIndexer

    config = PRESETS["tiny-dsa"]
    chosen = []
    original = LightningIndexer.forward

    def recording(self, normed, positions, view, slot_mapping):
        rows = original(self, normed, positions, view, slot_mapping)
        chosen.append((positions.clone(), rows.clone(), type(view.backend).__name__))
        return rows

    LightningIndexer.forward = recording
    try:
        for prompt in (list(range(3, 80)), list(range(200, 277))):
            Engine(EngineConfig(model=config)).generate([prompt], SamplingParams(max_tokens=2))
    finally:
        LightningIndexer.forward = original
    assert {name for _, _, name in chosen} == {"TorchIndexerBackend"}
    assert len(chosen) == 2 * 2 * config.num_layers  # two prompts, a prefill and a decode step, every layer
    for positions, rows, _ in chosen:
        entries = rows >= 0
        assert bool((rows[entries] <= (positions[:, None] - config.index_window).expand_as(rows)[entries]).all())
        late = positions >= config.index_topk + 2 * config.index_window
        assert bool(entries[late].any(dim=1).all())  # a long context's token indexes some older position
    first, second = chosen[0][1], chosen[2 * config.num_layers][1]
    assert not torch.equal(first, second)  # another prompt, other keys, another choice
