"""fp8 KV cache on a real GPU: the triton backend's kernels quantize and dequantize as the
contract says on every path (eager, CUDA graphs, the draft loop, the engine), a device scale read
on the host is a sync the syncs check reports, and a write_kv that stores by truncation fails."""

import pytest
import torch

from backends.triton.backend import TritonAttentionBackend
from backends.triton.mla_backend import TritonMLABackend
from conformance.cases.grammar import parse_case
from conformance.checks.draft_loop import DraftLoopCheck
from conformance.checks.engine import EngineCheck
from conformance.checks.graphs import GraphsCheck
from conformance.checks.numerics import NumericsCheck
from conformance.checks.syncs import SyncsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import fp8_defects

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
CASES = [
    "gqa-h8/2-d128-bf16-fp8e4m3-p16:100+1,30+4,0+40,2000+1",
    "gqa-h8/2-d64-fp16-fp8e5m2-p32:300+4,17+1",
    "gqa-h8/2-d128-bf16-fp8e4m3-p16-w64-cap30-strided:500+4,20+1",
]


@pytest.mark.parametrize("case_text", CASES)
def test_triton_stores_and_attends_fp8_as_the_contract_says(case_text):
    result = judge(NumericsCheck(), TritonAttentionBackend, parse_case(case_text), CUDA)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize(
    "case_text",
    ["mla-h16-d512+64-bf16-fp8e4m3-p64:1+1,700+1,64+4,2500+8", "mla-h128-d512+64-bf16-fp8e5m2-p64:900+4,63+1"],
)
def test_triton_mla_stores_and_attends_an_fp8_latent_cache(case_text):
    result = judge(NumericsCheck(), TritonMLABackend, parse_case(case_text), CUDA)
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.parametrize("check", [GraphsCheck, DraftLoopCheck, EngineCheck])
def test_triton_fp8_under_graphs_in_the_draft_loop_and_in_the_engine(check):
    result = judge(check(), TritonAttentionBackend, parse_case("gqa-h8/2-d128-bf16-fp8e4m3-p16:100+1,30+1,250+1"), CUDA)
    assert result.verdict == Verdict.PASS, result.reason


def test_a_device_scale_read_on_the_host_is_a_sync():
    case = parse_case("gqa-h8/2-d128-bf16-fp8e4m3-p16:100+1,30+4")
    result = judge(SyncsCheck(), fp8_defects.ReadsDeviceScaleOnHost, case, CUDA)
    assert result.verdict == Verdict.FAIL and "forward" in result.reason, result.reason


def test_truncation_fails_on_a_gpu_too():
    result = judge(NumericsCheck(), fp8_defects.TruncatesOnWrite, parse_case(CASES[0]), CUDA)
    assert result.verdict == Verdict.FAIL and "write_kv rounded" in result.reason, result.reason


@pytest.mark.parametrize("cache", ["fp8e4m3", "fp8e5m2"])
def test_the_write_kernel_quantizes_every_kind_of_number_as_the_contract_says(cache):
    """Saturation at both ends, subnormals, signed zeros and NaN (kept NaN), against the
    harness's own quantizer, through the kernel that runs on a GPU (the CPU interpreter's path
    quantizes with torch)."""
    from backends.base import BackendLimits, Fp8Scales, LayerParameters
    from conformance.cases.kv_quantization import quantize, ulps_apart

    spec = parse_case(f"gqa-h1-d64-bf16-{cache}-p16:1+1").spec
    backend = TritonAttentionBackend(spec, BackendLimits(4, 64, 64), CUDA)
    pool = backend.allocate_kv_cache(8)
    scales = Fp8Scales.on(CUDA, 0.1, 4.0)
    special = torch.tensor([0.0, -0.0, 1e-5, 3e-4, -3e-4, 44.8, -44.8, 50.0, -1e6, 1e6, float("nan"), 0.37])
    rows = torch.randn(64, 1, 64)
    rows.view(-1)[: special.numel()] = special
    rows = rows.to(torch.bfloat16).to(CUDA)
    slots = torch.arange(16, 80, device=CUDA)
    backend.write_kv(pool, rows, rows.neg(), slots, layer=LayerParameters(scales=scales))
    key, value = backend.read_kv(pool, slots)
    for stored, given, scale in ((key, rows, 0.1), (value, rows.neg(), 4.0)):
        expected = quantize(given, scale, spec.kv_cache_dtype)
        nan = torch.isnan(expected.float())
        assert torch.equal(torch.isnan(stored.float()), nan)
        assert int(ulps_apart(stored[~nan], expected[~nan]).max()) <= 1


FP8_GRAPH_CASE = "gqa-h8/2-d128-bf16-fp8e4m3-p16:100+1,30+1,250+1"


def test_scales_read_on_the_device_replay_and_scales_made_per_step_cannot_be_captured():
    from tests.planted import graph_backends

    control = judge(GraphsCheck(), graph_backends.TorchGraphSafe, parse_case(FP8_GRAPH_CASE), CUDA)
    assert control.verdict == Verdict.PASS, control.reason
    result = judge(GraphsCheck(), graph_backends.CopiesScalesPerStep, parse_case(FP8_GRAPH_CASE), CUDA)
    assert result.verdict == Verdict.FAIL and "capture" in result.reason, result.reason


VENDOR_FP8 = [
    ("flashinfer", "gqa-h32/8-d128-bf16-fp8e4m3-kscale0.03-vscale7-p16:100+1,30+4,0+40,2000+1"),
    ("flashinfer", "gqa-h32/8-d128-bf16-fp8e4m3-kscale0.03-vscale7-p16:100+1,30+1,2000+1"),
    ("flashinfer", "gqa-h8/2-d128-fp16-fp8e5m2-p16-w64:300+4,17+1,0+90"),
]


@pytest.mark.parametrize(("name", "case_text"), VENDOR_FP8)
def test_vendor_adapters_store_and_attend_fp8_as_the_contract_says(name, case_text):
    from backends.registry import load

    backend = load(name)
    case = parse_case(case_text)
    reason = backend.unsupported_reason(case.spec, CUDA)
    if reason:
        pytest.skip(reason)
    for check in (NumericsCheck(), GraphsCheck()):
        if check.skip_reason(backend, CUDA) or check.case_skip_reason(backend, case, CUDA):
            continue  # as a run skips it (flashinfer graphs decode batches only; flashinfer_mla none)
        result = judge(check, backend, case, CUDA)
        assert result.verdict == Verdict.PASS, (type(check).__name__, result.reason)


def test_flashinfer_mla_rounds_its_fp8_scale_to_bf16():
    """Why flashinfer_mla does not claim its e4m3 cache (docs/findings.md): with normal data and
    with a scale exact in bf16 it passes; with edges data and k_scale 0.1 it does not."""
    claiming = fp8_defects.FlashInferMLAClaimingE4M3
    edges = "mla-h16-d512+64-bf16-fp8e4m3-{}p64-edges:{}"
    reason = claiming.unsupported_reason(parse_case(edges.format("", "700+1")).spec, CUDA)
    if reason:
        pytest.skip(reason)
    for text in (
        "mla-h16-d512+64-bf16-fp8e4m3-p64:1+1,700+1,64+4,2500+4",
        edges.format("kscale0.125-", "63+1,64+1,127+1,700+1"),
        edges.format("kscale0.125-", "700+1,2500+1,3000+1"),
    ):
        result = judge(NumericsCheck(), claiming, parse_case(text), CUDA)
        assert result.verdict == Verdict.PASS, (text, result.reason)
    result = judge(NumericsCheck(), claiming, parse_case(edges.format("", "700+1,2500+1,3000+1")), CUDA)
    assert result.verdict == Verdict.FAIL and "beyond tolerance" in result.reason, result.reason
