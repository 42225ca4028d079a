"""The prefill/decode split on a CPU: a backend serving only some batches (decode-only as trtllm was,
uniform-only as flashmla, verify-only as triton_mla) runs under both engine loops beside a
companion; each sees only what it claims (the planted backends below refuse anything else, as
their kernels would); tokens equal plain decoding through one backend; the engine check runs
them, reports the routing, and still fails a defect in the backend under test."""

import dataclasses

import pytest
import torch

from backends.base import CommonAttentionMetadata, DeviceInfo, LayerParameters
from backends.torch_indexer import TorchIndexerBackend
from backends.torch_naive import TorchNaiveBackend
from backends.utils import sub_batch
from conformance.cases.grammar import parse_case
from conformance.checks.engine import EngineCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from reference_engine.attention_split import (
    Part,
    SplitAttention,
    companion_candidates,
    first_claiming,
    plan_parts,
    resolve_companion,
)
from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.sampling import SamplingParams
from tests.planted.defects import ForgetsLastToken

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7], list(range(100, 117))]
GREEDY = SamplingParams(max_tokens=14)
CPU = torch.device("cpu")
HERE = "tests.reference_engine.test_attention_split"


class RefusesWhatItDoesNotClaim(TorchNaiveBackend):
    """torch_naive whose build raises, like a decode kernel, on a batch outside its claims."""

    def build(self, common: CommonAttentionMetadata):
        reason = self.capabilities.query_len_reason(common.max_query_len, common.query_lens_cpu.tolist())
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        return super().build(common)


class DecodeOnly(RefusesWhatItDoesNotClaim):  # trtllm's claim
    name = "decode_only"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, max_query_len=1)


class UniformOnly(RefusesWhatItDoesNotClaim):  # flashmla's claim
    name = "uniform_only"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, max_query_len=8, uniform_query_len=True)


class VerifyOnly(RefusesWhatItDoesNotClaim):  # triton_mla's claim
    name = "verify_only"
    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, max_query_len=4)


class UniformForgetsLastToken(UniformOnly, ForgetsLastToken):
    """A uniform-only backend with a real defect: the batch's last output row is never written."""

    name = "uniform_forgets_last_token"


@pytest.fixture(scope="module")
def plain_tokens():
    return [out.tokens for out in Engine(EngineConfig()).generate(PROMPTS, GREEDY)]


def test_plan_parts_routes_by_what_the_backend_claims():
    assert plan_parts([1, 1, 30, 4], DecodeOnly.capabilities) == [Part(0, 2, False), Part(2, 4, True)]
    assert plan_parts([4, 4, 1, 4, 30], UniformOnly.capabilities) == [
        Part(0, 2, False),
        Part(2, 3, False),
        Part(3, 4, False),
        Part(4, 5, True),
    ]
    assert plan_parts([4, 4, 4], UniformOnly.capabilities) == [Part(0, 3, False)]  # a uniform step: one part, whole
    assert plan_parts([30, 9, 2, 4], VerifyOnly.capabilities) == [Part(0, 2, True), Part(2, 4, False)]


@pytest.mark.parametrize("backend,k", [("DecodeOnly", 3), ("UniformOnly", 3), ("VerifyOnly", 3), ("VerifyOnly", 5)])
def test_split_engines_equal_plain_decoding(plain_tokens, backend, k):
    config = EngineConfig(backend=f"{HERE}:{backend}", num_spec_tokens=k, drafter="layer-skip:1", check_inputs=True)
    for scheduling in (False, True):
        engine = BatchedEngine(dataclasses.replace(config, async_scheduling=scheduling))
        (split,) = engine.backend.splits
        assert isinstance(split, SplitAttention) and split.companion.name == "torch_naive"
        assert [out.tokens for out in engine.generate(PROMPTS, GREEDY)] == plain_tokens
        served = split.routing.to_dict()
        assert served[split.backend.name]["batches"] > 0 and served["torch_naive"]["batches"] > 0, served
    sync_reference = Engine(dataclasses.replace(config, drafter="scripted:random:0.5"))
    assert [out.tokens for out in sync_reference.generate(PROMPTS, GREEDY)] == plain_tokens


def test_a_backend_serving_every_batch_runs_alone():
    assert resolve_companion(TorchNaiveBackend, EngineConfig().model.attention_spec(torch.float32, 16), CPU) is None
    assert not isinstance(BatchedEngine(EngineConfig()).backend.splits[0], SplitAttention)


def test_bad_prefill_backends_are_one_line_errors():
    spec = EngineConfig().model.attention_spec(torch.float32, 16)
    with pytest.raises(ValueError, match="prefill backend: .*no_such_backend"):
        resolve_companion(DecodeOnly, spec, CPU, "no_such_backend")
    with pytest.raises(ValueError, match="VerifyOnly: does not serve every query length itself"):
        resolve_companion(DecodeOnly, spec, CPU, f"{HERE}:VerifyOnly")
    with pytest.raises(ValueError, match="no prefill backend can serve the rest"):
        BatchedEngine(EngineConfig(backend=f"{HERE}:DecodeOnly", prefill_backend=f"{HERE}:UniformOnly"))


def test_sub_batch_keeps_unknown_host_lengths_unknown_and_syncs_nothing():
    common = CommonAttentionMetadata.from_lengths(
        query_start_loc=torch.tensor([0, 1, 5, 35], dtype=torch.int32),
        seq_lens=torch.tensor([9, 20, 30], dtype=torch.int32),
        block_table=torch.zeros(3, 4, dtype=torch.int32),
        slot_mapping=torch.arange(35),
        query_starts=[0, 1, 5, 35],
        host_seq_lens=[12, 23, 30],
        lengths_known=False,
    )
    part = sub_batch(common, 1, 3)
    assert not part.has_host_seq_lens and part.max_seq_len == 30 and part.query_start_loc_cpu.tolist() == [0, 4, 34]
    assert part.slot_mapping[0] == 1 and common.device_to_host_copies == [] and part.device_to_host_copies == []


@pytest.mark.slow
def test_engine_check_runs_decode_only_and_uniform_only_backends():
    case = parse_case("gqa-h4/2-d32-fp32-p16:30+1@0")
    for backend in (DecodeOnly, UniformOnly):
        check = EngineCheck()
        assert check.case_skip_reason(backend, case, CPU) is None
        # The case's batch is not the engine's: a mixed one is runnable too (a companion prefills).
        assert check.case_skip_reason(backend, parse_case("gqa-h4/2-d32-fp32-p16:0+20,30+4,7+1"), CPU) is None
        result = judge(check, backend, case, CPU)
        assert result.verdict == Verdict.PASS, result.reason
        served = result.evidence["attention_routing"]
        assert served[backend.name]["batches"] > 0 and served["torch_naive"]["batches"] > 0, served
        assert f"{backend.name} served" in result.reason
    result = judge(EngineCheck(), UniformForgetsLastToken, case, CPU)
    assert result.verdict == Verdict.FAIL, result.reason
    assert "attention_routing" in result.evidence


def test_engine_check_skips_with_the_reason_when_no_companion_fits():
    case = parse_case("gqa-h4/2-d32-fp32-p16:30+1@0")
    reason = EngineCheck({"prefill_backend": f"{HERE}:VerifyOnly"}).case_skip_reason(DecodeOnly, case, CPU)
    assert "does not serve every query length itself" in reason


def test_trtllm_mla_claims_route_prefill_to_a_companion():
    """trtllm_mla cannot run on Hopper; its engine path — the split its claims ask for — is checked here."""
    from backends.flashinfer.trtllm_mla import TrtllmMLABackend
    from conformance.checks.engine import model_for

    claims = TrtllmMLABackend.capabilities
    spec = model_for(parse_case("mla-h16-d512+64-bf16-p64:1+1@0")).attention_spec(torch.bfloat16, 64)
    assert resolve_companion(TrtllmMLABackend, spec, CPU).name == "torch_naive"
    # triton_mla is tried first on a GPU but verifies only up to 4 tokens: torch_naive takes the prefills.
    assert companion_candidates(spec, torch.device("cuda")) == ["triton_mla", "torch_naive"]
    hopper = DeviceInfo("cuda", "NVIDIA H200", (9, 0))
    assert (
        first_claiming(["triton_mla"], spec, hopper, every_batch=True)[1]
        == "triton_mla: does not serve every query length itself"
    )
    assert plan_parts([4, 4, 4, 37, 1], claims) == [Part(0, 3, False), Part(3, 4, True), Part(4, 5, False)]


def test_an_empty_request_joins_its_neighbours_run():
    """vLLM's graph padding in a uniform step: the empty requests do not cut it in two."""
    assert plan_parts([4, 4, 0, 0], UniformOnly.capabilities) == [Part(0, 4, False)]
    assert plan_parts([0, 4, 4], UniformOnly.capabilities) == [Part(0, 3, False)]
    assert plan_parts([30, 0, 1], DecodeOnly.capabilities) == [Part(0, 2, True), Part(2, 3, False)]


def test_a_split_sparse_model_hands_each_backend_its_own_rows_of_indices(monkeypatch):
    """A sparse model (``tiny-dsa``) through a backend that serves verify batches beside
    torch_naive: each part of a step gets the index rows of its own tokens, one a query row (a
    companion handed the whole step's rows attends other tokens' positions, some with none left:
    NaN, seen on an H200), and the split engine decodes as torch_naive alone does."""
    from reference_engine.model import PRESETS

    handed = []
    forward = TorchNaiveBackend.forward

    def counting(self, query, kv_cache, metadata, out, layer=None):
        handed.append((query.shape[0], layer.topk_indices.shape[0]))
        forward(self, query, kv_cache, metadata, out, layer=layer)

    prompts = [list(range(3, 6)), list(range(10, 33)), list(range(40, 80)), list(range(100, 164))]
    params = SamplingParams(max_tokens=6)
    config = EngineConfig(model=PRESETS["tiny-dsa"], max_num_reqs=4, max_num_tokens=128, async_scheduling=False)
    plain = [out.tokens for out in BatchedEngine(config).generate(prompts, params)]
    monkeypatch.setattr(TorchNaiveBackend, "forward", counting)
    engine = BatchedEngine(dataclasses.replace(config, backend=f"{HERE}:VerifyOnly"))
    assert [out.tokens for out in engine.generate(prompts, params)] == plain
    assert handed and all(rows == indices for rows, indices in handed), handed
    (split, _) = engine.backend.splits  # the attention's split, then the indexer
    assert split.routing.to_dict()["torch_naive"]["batches"] > 0


def test_a_part_of_a_step_gets_its_rows_of_every_per_row_parameter():
    layer = LayerParameters(
        sinks=torch.zeros(4),
        lse=torch.arange(10.0)[:, None],
        topk_indices=torch.arange(10)[:, None],
        index_weights=torch.arange(10.0)[:, None],
    )
    part = layer.rows_of(lambda rows: rows[3:5])
    assert part.sinks is layer.sinks
    for rows in (part.lse, part.topk_indices, part.index_weights):
        assert rows.flatten().tolist() == [3, 4]


class DecodeOnlyIndexer(TorchIndexerBackend):  # an indexer kernel of decode batches only (paged logits)
    name = "decode_only_indexer"
    capabilities = dataclasses.replace(TorchIndexerBackend.capabilities, max_query_len=1)

    def build(self, common: CommonAttentionMetadata):
        reason = self.capabilities.query_len_reason(common.max_query_len, common.query_lens_cpu.tolist())
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        return super().build(common)


def test_an_indexer_serving_decodes_only_runs_beside_a_built_in_indexer():
    """The backend under test a sparse model's indexer that serves decode batches only: the model's
    attention goes to a built-in, its prefills' choices to torch_indexer beside it, and the tokens
    are torch_naive's with torch_indexer alone."""
    from reference_engine.model import PRESETS

    prompts = [list(range(3, 60)), list(range(10, 50))]
    params = SamplingParams(max_tokens=6)
    config = EngineConfig(model=PRESETS["tiny-dsa"], async_scheduling=False)
    plain = [out.tokens for out in BatchedEngine(config).generate(prompts, params)]
    engine = BatchedEngine(dataclasses.replace(config, backend=f"{HERE}:DecodeOnlyIndexer"))
    assert [out.tokens for out in engine.generate(prompts, params)] == plain
    (_, indexer) = engine.backend.splits
    assert isinstance(indexer, SplitAttention) and indexer.companion.name == "torch_indexer"
    served = indexer.routing.to_dict()
    assert served["decode_only_indexer"]["batches"] > 0 and served["torch_indexer"]["batches"] > 0, served
