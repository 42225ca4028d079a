import pytest
import torch

from backends.base import AttentionSpec, Capabilities, CGSupport, DeviceInfo
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import parse_case
from conformance.harness.batch import materialize
from conformance.harness.step import prepare_case, run_step
from tests.planted.defects import NeedsBlackwell, NeedsMissingPackage

H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0))


def test_spec_validation():
    with pytest.raises(ValueError):
        AttentionSpec(kind="gqa", num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    with pytest.raises(ValueError):
        AttentionSpec(
            kind="mla", num_heads=8, num_kv_heads=1, head_dim=100, dtype=torch.float16, kv_lora_rank=64, rope_dim=16
        )
    spec = AttentionSpec(kind="mha", num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    assert spec.softmax_scale == pytest.approx(0.125) and spec.query_group_size == 4


def test_unsupported_reason_names_what_is_missing():
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),
        dtypes=frozenset({torch.bfloat16}),
        head_dims=frozenset({128}),
        block_sizes=frozenset({16}),
        max_query_len=8,
        devices=frozenset({"cuda"}),
        compute_capabilities=frozenset({(9, 0)}),
    )
    spec = parse_case("gqa-h32/8-d128-bf16-p16:1+1").spec
    assert capabilities.unsupported_reason(spec, H100) is None
    assert "fp16" in capabilities.unsupported_reason(parse_case("gqa-fp16:1+1").spec, H100)
    assert "head_dim 64" in capabilities.unsupported_reason(parse_case("gqa-d64:1+1").spec, H100)
    assert "block size 32" in capabilities.unsupported_reason(parse_case("gqa-p32:1+1").spec, H100)
    assert "MLA" in capabilities.unsupported_reason(parse_case("mla:1+1").spec, H100)
    assert "sliding window" in capabilities.unsupported_reason(parse_case("gqa-w8:1+1").spec, H100)
    assert "not cpu" in capabilities.unsupported_reason(spec, DeviceInfo("cpu"))
    assert (
        capabilities.unsupported_reason(spec, B200) == "needs compute capability SM90; this GPU (NVIDIA B200) is SM100"
    )
    assert capabilities.query_len_reason(9) and capabilities.query_len_reason(8) is None


def test_uniform_query_len_claim_skips_mixed_batches_and_the_engine():
    import dataclasses

    from backends.torch_naive import TorchNaiveBackend
    from conformance.checks.engine import EngineCheck
    from conformance.checks.numerics import NumericsCheck

    class UniformOnly(TorchNaiveBackend):
        capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, uniform_query_len=True)

    cpu = torch.device("cpu")
    assert "mixed query lengths" in UniformOnly.capabilities.query_len_reason(4, [4, 1])
    assert UniformOnly.capabilities.query_len_reason(4, [4, 4]) is None
    assert "mixed query lengths" in NumericsCheck().case_skip_reason(UniformOnly, parse_case("gqa-fp32:30+4,10+1"), cpu)
    assert NumericsCheck().case_skip_reason(UniformOnly, parse_case("gqa-fp32:30+4,10+4"), cpu) is None
    assert EngineCheck().case_skip_reason(UniformOnly, parse_case("gqa-fp32:30+4"), cpu) is None  # the engine splits
    assert UniformOnly.capabilities.to_dict()["uniform_query_len"] is True


def test_availability_reasons():
    assert NeedsBlackwell.availability_reason(H100) == (
        "needs compute capability SM100, SM103; this GPU (NVIDIA H100 80GB HBM3) is SM90"
    )
    assert NeedsBlackwell.availability_reason(B200) is None
    reason = NeedsMissingPackage.availability_reason(DeviceInfo("cpu"))
    assert "no_such_vendor_package" in reason and "pip install 'specdec-conformance[no_such_extra]'" in reason


def test_claims_serialize():
    claims = TorchNaiveBackend.capabilities.to_dict()
    assert claims["cuda_graphs"] == "NEVER" and claims["needs_cpu_seq_lens"] is True
    assert CGSupport.ALWAYS > CGSupport.UNIFORM_BATCH > CGSupport.UNIFORM_SINGLE_TOKEN_DECODE > CGSupport.NEVER


@pytest.mark.parametrize("layer", ["gqa-h4/2-d16-fp32-p4", "mla-h2-d8+4-fp32-p4"])
def test_write_kv_skips_slot_minus_one_and_touches_only_its_slots(layer):
    batch = materialize(parse_case(f"{layer}:9+3,2+1"), "cpu")
    backend = TorchNaiveBackend(batch.spec, batch.limits(), torch.device("cpu"))
    cache = backend.allocate_kv_cache(batch.num_blocks).normal_()
    before = cache.clone()
    key, value, slots = batch.step_rows()
    backend.write_kv(cache, key, value, slots)
    changed = set()
    for plane_before, plane_after in zip(backend.slot_planes(before), backend.slot_planes(cache)):
        changed |= set((plane_before != plane_after).flatten(1).any(1).nonzero().flatten().tolist())
    assert changed == set(slots[slots >= 0].tolist())


def test_seq_lens_cpu_records_the_device_copy_when_the_host_lacks_lengths():
    batch = materialize(parse_case("gqa-h4/2-d16-fp32:9+3"), "cpu")
    with_lengths = batch.common_metadata(with_host_lengths=True)
    assert with_lengths.seq_lens_cpu.tolist() == [12] and with_lengths.device_to_host_copies == []
    without = batch.common_metadata(with_host_lengths=False)
    assert without.seq_lens_cpu.tolist() == [12] and without.device_to_host_copies == ["seq_lens"]


def test_torch_naive_runs_without_host_lengths_too():
    prepared = prepare_case(TorchNaiveBackend, parse_case("gqa-h4/2-d16-fp32:9+3,4+1"), torch.device("cpu"))
    out = run_step(prepared, with_host_lengths=False)
    torch.testing.assert_close(out.double(), prepared.batch.reference_output(), atol=1e-5, rtol=1e-5)


def test_common_metadata_from_lengths_derives_the_host_values():
    import torch

    from backends.base import CommonAttentionMetadata

    device = dict(
        query_start_loc=torch.tensor([0, 1, 5, 6]),
        seq_lens=torch.tensor([9, 20, 3]),
        block_table=torch.zeros(3, 2, dtype=torch.int32),
        slot_mapping=torch.arange(6),
    )
    exact = CommonAttentionMetadata.from_lengths(**device, query_starts=[0, 1, 5, 6], host_seq_lens=[9, 20, 3])
    assert (exact.num_reqs, exact.num_actual_tokens, exact.max_query_len, exact.max_seq_len) == (3, 6, 4, 20)
    assert exact.query_start_loc_cpu.tolist() == [0, 1, 5, 6] and exact.host_seq_lens.tolist() == [9, 20, 3]
    bound = CommonAttentionMetadata.from_lengths(
        **device, query_starts=[0, 1, 5, 6], host_seq_lens=[12, 23, 3], lengths_known=False
    )
    assert bound.host_seq_lens is None and bound.max_seq_len == 23  # async: an upper bound only
    graph = CommonAttentionMetadata.from_lengths(
        **device, query_starts=[0, 1, 5, 6], host_seq_lens=[9, 20, 3], max_seq_len=4096
    )
    assert graph.max_seq_len == 4096
