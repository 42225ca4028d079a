"""A model's attention in the engine: MLA's prefill decompressed through the backend that claims
that layer (beside the absorbed decode, or beside a built-in that decodes), and windowed layers
alternating with full ones, each group with a backend and metadata of its own."""

import dataclasses

import pytest
import torch

from backends.features import VALUE_HEAD_DIM
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.checks.engine import EngineCheck, model_for
from conformance.results import Verdict
from conformance.run.execution import judge
from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.model_attention import plan_attention
from reference_engine.sampling import SamplingParams
from tests.planted.value_dim_defects import ValueOffsetFromValueDim

HERE = "tests.reference_engine.test_model_attention"
CPU = torch.device("cpu")
MLA = PRESETS["tiny-mla"]  # prefill layer: qk 48 (32 + 16 rope), v 32
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7], list(range(100, 117))]
GREEDY = SamplingParams(max_tokens=12)


class AbsorbedOnly(TorchNaiveBackend):
    """An MLA decode kernel and nothing else: no MHA layer, so no decompressed prefill."""

    name = "absorbed_only"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, kinds=frozenset({"mla"}))


class PrefillOnly(TorchNaiveBackend):
    """A prefill kernel (MHA, qk != v) and no MLA: a built-in must decode beside it."""

    name = "prefill_only"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, kinds=frozenset({"mha"}))


class PrefillValueOffset(PrefillOnly, ValueOffsetFromValueDim):
    """The prefill kernel reading each value at the value dim's offset, not the key's."""

    name = "prefill_value_offset"


def tokens(engine_cls, backend: str, **changes) -> list[list[int]]:
    config = EngineConfig(model=MLA, backend=backend, max_num_tokens=32, **changes)
    return [out.tokens for out in engine_cls(config).generate(PROMPTS, GREEDY)]


def test_plans_follow_the_claims():
    def roles(backend_cls, **options):
        return [
            (plan.backend_cls.name, plan.prefill_cls and plan.prefill_cls.name)
            for plan in plan_attention(backend_cls, MLA, torch.float32, 16, None, CPU, **options)
        ]

    assert roles(TorchNaiveBackend) == [("torch_naive", "torch_naive")]
    assert roles(AbsorbedOnly) == [("absorbed_only", None)]
    assert roles(PrefillOnly) == [("torch_naive", "prefill_only")]  # a built-in decodes
    assert roles(PrefillOnly, decompressed_prefill=False) == [("torch_naive", None)]

    class OneHeadDim(PrefillOnly):  # claims neither MLA nor a value dim of its own
        capabilities = dataclasses.replace(
            PrefillOnly.capabilities, features=PrefillOnly.capabilities.features - {VALUE_HEAD_DIM}
        )

    with pytest.raises(ValueError, match="MLA not supported"):
        plan_attention(OneHeadDim, MLA, torch.float32, 16, None, CPU)


@pytest.mark.parametrize("engine_cls", [Engine, BatchedEngine])
def test_decompressed_prefill_equals_absorbed(engine_cls):
    absorbed = tokens(engine_cls, f"{HERE}:AbsorbedOnly")
    assert tokens(engine_cls, "torch_naive") == absorbed
    assert tokens(engine_cls, f"{HERE}:PrefillOnly") == absorbed
    assert tokens(engine_cls, f"{HERE}:PrefillOnly", num_spec_tokens=3, drafter="layer-skip:1") == absorbed


def test_prefills_go_decompressed_and_decodes_absorbed():
    engine = BatchedEngine(
        EngineConfig(
            model=MLA, backend=f"{HERE}:PrefillOnly", max_num_tokens=32, num_spec_tokens=3, drafter="layer-skip:1"
        )
    )
    engine.generate(PROMPTS, GREEDY)
    served = engine.backend.routing.to_dict()
    prefill, absorbed = served["prefill_only (MLA prefill, decompressed)"], served["torch_naive (absorbed)"]
    # 59 prompt tokens in chunks of up to 32 tokens; a chunk of at most 1 + k tokens (the 3-token
    # prompt, a chunk's tail) is absorbed as a verify is.
    assert 40 <= prefill["tokens"] <= 59 - 3 and absorbed["batches"] > 10, served
    mirror = engine.kv_caches[0].prefill
    assert mirror.shape[-1] == 48 + 32  # the prefill backend's [key | value] rows


def test_an_fp8_latent_cache_is_decompressed_as_stored():
    fp8 = dict(kv_cache_dtype=torch.float8_e4m3fn, kv_scales=(0.05, 0.05))
    assert tokens(BatchedEngine, "torch_naive", **fp8) == tokens(BatchedEngine, f"{HERE}:AbsorbedOnly", **fp8)


@pytest.mark.slow
def test_the_engine_check_catches_a_prefill_defect_through_the_mla_model():
    case = parse_case("mha-h4-d48/32-fp32-p16:30+1@0")
    assert model_for(case).attention == "mla"
    check = EngineCheck()
    assert check.case_skip_reason(PrefillOnly, case, CPU) is None
    result = judge(check, PrefillOnly, case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
    assert "prefill_only (MLA prefill, decompressed) served" in result.reason
    # The independent reference (torch_naive's engine) is judged first and catches it; so does the
    # comparison of MLA's two paths, the check's own, without it.
    result = judge(EngineCheck(), PrefillValueOffset, case, CPU)
    assert result.verdict == Verdict.FAIL and "plain vs torch_naive" in result.reason, result.reason
    from tests.conformance.checks.test_engine_reference import SelfComparisonsOnly

    result = judge(SelfComparisonsOnly(), PrefillValueOffset, case, CPU)
    assert result.verdict == Verdict.FAIL and "MLA prefill decompressed vs every request absorbed" in result.reason, (
        result.reason
    )


def test_an_mla_case_is_an_mla_backends_even_where_another_claims_its_models_prefill():
    reason = EngineCheck().case_skip_reason(PrefillOnly, parse_case("mla-h4-d64+16-fp32-p16:30+1@0"), CPU)
    assert reason.startswith("MLA not supported"), reason


def test_a_gqa_layer_with_its_own_value_dim_is_not_mla_prefill():
    reason = EngineCheck().case_skip_reason(TorchNaiveBackend, parse_case("gqa-h4/2-d48/32-fp32-p16:30+1@0"), CPU)
    assert "as many KV heads as query heads" in reason


def test_windowed_layers_alternate_with_full_ones():
    config = dataclasses.replace(PRESETS["tiny"], sliding_window=8, alternating_window=True)
    engine = BatchedEngine(EngineConfig(model=config))
    windows = [group.plan.spec.sliding_window for group in engine.backend.groups]
    assert windows == [8, None] and [group.plan.layers for group in engine.backend.groups] == [(0, 2), (1, 3)]
    model = LlamaModel.random(config, 0, torch.float32, CPU)

    def run(model_config, **changes):
        return [
            out.tokens
            for out in BatchedEngine(EngineConfig(model=model_config, **changes), model).generate(PROMPTS, GREEDY)
        ]

    alternating = run(config)
    assert alternating != run(dataclasses.replace(config, sliding_window=None))  # the window bites
    assert alternating != run(dataclasses.replace(config, alternating_window=False))  # and only on even layers
    assert run(config, num_spec_tokens=3, drafter="layer-skip:1") == alternating
    assert run(config, num_spec_tokens=3, drafter="layer-skip:1", async_scheduling=False) == alternating


def test_the_engine_check_runs_a_windowed_layer_alternating():
    case = parse_case("gqa-h4/2-d32-fp32-p16-w128-attnsinks:30+1@0")
    config = model_for(case)
    assert config.alternating_window and config.sliding_window < 64 and config.attention_sinks
    result = judge(EngineCheck(), TorchNaiveBackend, case, CPU)
    assert result.verdict == Verdict.PASS, result.reason
