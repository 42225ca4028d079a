"""The reference engine on a CPU with torch_naive in fp32: greedy speculative decoding produces
exactly the tokens of greedy decoding without it, for every drafter and acceptance pattern, with
chunked prefill and with preemption; no KV block leaks; bad input is refused clearly."""

import math

import pytest
import torch

from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.kv_cache import BlockManager, OutOfBlocks
from reference_engine.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7], list(range(100, 117))]
GREEDY = SamplingParams(max_tokens=14)


@pytest.fixture(scope="module")
def plain_tokens():
    return [out.tokens for out in Engine(EngineConfig()).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "drafter",
    [
        "scripted:all",
        "scripted:none",
        "scripted:first:1",
        "scripted:random:0.6",
        "layer-skip:1",
        "eagle",
        "ngram",
        "ngram:1",
    ],
)
def test_greedy_speculative_equals_greedy_plain(plain_tokens, k, drafter):
    outputs = Engine(EngineConfig(num_spec_tokens=k, drafter=drafter)).generate(PROMPTS, GREEDY)
    assert [out.tokens for out in outputs] == plain_tokens
    if drafter == "scripted:all":
        assert all(out.accepted == out.drafted for out in outputs)
        assert all(out.acceptance_length > 1.5 for out in outputs)
    if drafter == "scripted:none":
        assert all(out.accepted == 0 and out.drafted > 0 for out in outputs)


def test_chunked_prefill_and_a_tight_budget_change_nothing(plain_tokens):
    outputs = Engine(EngineConfig(max_num_tokens=8, num_spec_tokens=3, drafter="scripted:random:0.5")).generate(
        PROMPTS, GREEDY
    )
    assert [out.tokens for out in outputs] == plain_tokens


def test_preemption_by_recompute_changes_nothing(plain_tokens):
    engine = Engine(
        EngineConfig(
            num_blocks=6, block_size=16, num_spec_tokens=2, drafter="scripted:first:1", check_device_state=True
        )
    )
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [out.tokens for out in outputs] == plain_tokens
    assert sum(out.preemptions for out in outputs) > 0  # the pool really was too small for all at once
    engine.blocks.assert_all_free()


def test_block_manager_reserves_block_zero_and_detects_leaks():
    blocks = BlockManager(4, 16)
    owned: list[int] = []
    blocks.allocate(owned, 40)
    assert owned == [1, 2, 3] and 0 not in owned
    with pytest.raises(OutOfBlocks):
        blocks.allocate(owned, 70)
    with pytest.raises(AssertionError, match="3 KV blocks still allocated"):
        blocks.assert_all_free()
    blocks.free(owned)
    blocks.assert_all_free()


def test_stop_on_eos_and_max_tokens(plain_tokens):
    eos = plain_tokens[0][3]
    outputs = Engine(EngineConfig(num_spec_tokens=3, drafter="scripted:all")).generate(
        PROMPTS[:1], SamplingParams(max_tokens=14, eos_token_id=eos)
    )
    assert outputs[0].tokens == plain_tokens[0][: plain_tokens[0].index(eos) + 1]


def test_seeded_sampling_is_reproducible_and_temperature_changes_tokens(plain_tokens):
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=14)
    first = Engine(EngineConfig(num_spec_tokens=2, drafter="layer-skip:1")).generate(PROMPTS, params)
    again = Engine(EngineConfig(num_spec_tokens=2, drafter="layer-skip:1")).generate(PROMPTS, params)
    assert [o.tokens for o in first] == [o.tokens for o in again]
    assert [o.tokens for o in first] != plain_tokens


def test_random_weights_give_non_degenerate_distributions():
    engine = Engine(EngineConfig())
    probabilities = engine.score(list(range(3, 40))).softmax(dim=-1)
    entropy = -(probabilities * probabilities.clamp(min=1e-30).log()).sum(dim=-1).mean().item()
    assert 1.0 < entropy < math.log(engine.config.model.vocab_size) - 1.0


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: Engine(EngineConfig()).generate([[]], GREEDY), "empty prompt"),
        (lambda: Engine(EngineConfig()).generate([[1] * 2000], GREEDY), "does not fit max_model_len"),
        (lambda: Engine(EngineConfig()).generate([[9999]], GREEDY), "token ids must be in"),
        (lambda: Engine(EngineConfig(num_spec_tokens=-1, drafter="scripted:all")), ">= 0"),
        (lambda: Engine(EngineConfig(num_spec_tokens=2, drafter="medusa")), "unknown drafter"),
        (lambda: Engine(EngineConfig(num_spec_tokens=2)), "needs a drafter"),
        (lambda: Engine(EngineConfig(num_spec_tokens=2, drafter="scripted:sometimes")), "acceptance pattern"),
        (lambda: Engine(EngineConfig(num_spec_tokens=2, drafter="ngram:0")), "whole N >= 1"),
        (lambda: Engine(EngineConfig(backend="triton")), "cannot run this model here"),
        (lambda: Engine(EngineConfig(num_blocks=2)).generate([list(range(40))], GREEDY), "raise num_blocks"),
    ],
)
def test_bad_input_is_refused_clearly(make, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        make()


def test_eagle_with_chunked_prefill_and_preemption(plain_tokens):
    engine = Engine(EngineConfig(num_blocks=6, max_num_tokens=8, num_spec_tokens=3, drafter="eagle"))
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [out.tokens for out in outputs] == plain_tokens
    assert sum(out.preemptions for out in outputs) > 0


@pytest.mark.parametrize("drafter", ["scripted:random:0.5", "layer-skip:1", "eagle"])
def test_device_state_is_the_truth_the_host_mirrors(plain_tokens, drafter):
    """Decode rows take their first input token from the device state; after every step the
    device's computed count and last token equal the host's mirror, and all slots are free at the end."""
    engine = Engine(EngineConfig(num_spec_tokens=3, drafter=drafter, max_num_tokens=16, check_device_state=True))
    assert [out.tokens for out in engine.generate(PROMPTS, GREEDY)] == plain_tokens
    engine.blocks.assert_all_free()
    assert sorted(engine.state.free_slots) == list(range(engine.config.max_num_reqs))


def test_equality_tool_finds_and_explains_a_divergence():
    from reference_engine.equality import explain, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    engine = Engine(EngineConfig())
    prompt = [1, 2, 3, 4, 5]
    logits = engine.score(prompt)[-1]
    top, second = logits.topk(2).indices.tolist()
    why = explain(engine, prompt[:-1], prompt[-1:], top, second)
    assert (why.rank_of_plain, why.rank_of_spec) == (0, 1)
    assert why.magnitude == pytest.approx(float(logits[[top, second]].abs().max()), rel=1e-5)
    assert (
        why.margin
        == pytest.approx(float(logits[top] - logits[second]), rel=1e-5)
        == pytest.approx(why.behind_top, rel=1e-5)
    )
    third = logits.topk(3).indices[2].item()  # two choices, neither the top: how far the further one is below it
    assert explain(engine, prompt[:-1], prompt[-1:], second, third).behind_top == pytest.approx(
        float(logits[top] - logits[third]), rel=1e-5
    )


def test_near_tie_rule():
    from reference_engine.equality import Explanation

    def explained(behind_top, dtype=torch.bfloat16, magnitude=12.0):
        return Explanation(0.0, 1, 2, magnitude, behind_top).is_near_tie(dtype)

    assert explained(0.1 + 2 * 0.0625) and not explained(0.1 + 2 * 0.0625 + 1e-3)  # bf16 at 8-16: 0.0625 a step
    assert not explained(1e-6, torch.float32)  # fp32 runs have no rounding excuse
    assert explained(0.2, torch.float16, 12.0) is False and explained(0.11, torch.float16, 12.0)


def test_drafter_specs_parse_into_their_drafters_and_oracle_is_no_longer_one():
    from reference_engine.drafters.layer_skip import LayerSkipDrafter
    from reference_engine.drafters.ngram import NgramDrafter
    from reference_engine.drafters.scripted import AcceptancePattern, ScriptedDrafter

    scripted = Engine(EngineConfig(num_spec_tokens=3, drafter="scripted:first:2")).drafter
    assert type(scripted) is ScriptedDrafter and scripted.pattern == AcceptancePattern("first", 2.0)
    ngram = Engine(EngineConfig(num_spec_tokens=3, drafter="ngram:2")).drafter
    assert type(ngram) is NgramDrafter and ngram.max_n == 2
    layer_skip = Engine(EngineConfig(num_spec_tokens=3, drafter="layer-skip")).drafter  # a quarter of 4 layers
    assert type(layer_skip) is LayerSkipDrafter and layer_skip.num_layers == 1
    with pytest.raises(ValueError, match="unknown drafter 'oracle:first:2'"):  # the scripted drafter's former name
        Engine(EngineConfig(num_spec_tokens=3, drafter="oracle:first:2"))
    for spec, message in (("scripted", "needs a pattern"), ("eagle:x", "no argument")):
        with pytest.raises(ValueError, match=message):
            Engine(EngineConfig(num_spec_tokens=3, drafter=spec))


def test_ngram_rule_and_its_device_version_agree():
    """Prompt lookup: the longest suffix (<= N) seen before, its most recent earlier occurrence, the
    tokens after it (past the end: the last token); the device version agrees on random histories
    with garbage past each row's length."""
    import random

    from reference_engine.drafters.ngram import ngram_drafts, ngram_drafts_on_device

    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3], 3, 3) == [9, 1, 2]  # "1 2 3" seen at 0
    assert ngram_drafts([4, 2, 3, 5, 1, 2, 3, 6, 2, 3], 2, 3) == [6, 2]  # "2 3" most recently at 5; no "6 2 3" before
    assert ngram_drafts([7, 8, 7, 8], 4, 2) == [7, 8, 8, 8]  # runs past the end: the last token
    assert ngram_drafts([5, 6, 7], 2, 3) == [7, 7] and ngram_drafts([5], 2, 3) == [5, 5]  # no match
    rng = random.Random(0)
    for _ in range(100):
        width, lengths = 20, [rng.randint(1, 20) for _ in range(6)]
        history = [[rng.randint(0, 3) for _ in range(width)] for _ in lengths]
        k, max_n = rng.randint(1, 5), rng.randint(1, 4)
        on_device = ngram_drafts_on_device(torch.tensor(history), torch.tensor(lengths), k, max_n).tolist()
        assert on_device == [ngram_drafts(row[:length], k, max_n) for row, length in zip(history, lengths)]


def test_rounding_step_is_the_dtype_spacing_at_the_magnitude():
    from reference_engine.equality import rounding_step

    assert rounding_step(torch.bfloat16, 8.0) == 0.0625 and rounding_step(torch.bfloat16, 15.9) == 0.0625
    assert rounding_step(torch.float16, 8.0) == 2.0**-7 and rounding_step(torch.bfloat16, 0.0) == 0.0
    assert float(torch.tensor(8.0 + 0.0625 / 2.1, dtype=torch.bfloat16)) == 8.0  # below half a step: rounds away
