"""steady: 256 consecutive decode steps, every one watched. On the CPU its output path (a host
cache refreshed now and then shows at the step it skips); on a GPU its syncs and memory (a sync
every 64th step, a workspace regrown and kept), and the built-in backends passing."""

import pytest
import torch

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.cases.suites import suite
from conformance.checks import default_checks
from conformance.checks.steady import SteadyCheck, steady_look
from conformance.results import Verdict
from tests.planted import steady_defects
from tests.planted.graph_backends import TorchGraphSafe

CPU = torch.device("cpu")
DECODE = parse_case("gqa-h8/2-d64-fp16-p16:100+1,30+1,250+1")


def test_a_cache_refreshed_now_and_then_fails_at_the_step_it_skips():
    assert steady_look(TorchGraphSafe, DECODE, CPU, steps=70).verdict == Verdict.PASS
    result = steady_look(steady_defects.SkipsRefreshEveryNthBuild, DECODE, CPU, steps=70)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("decode step 63 of 70 differs"), result.reason


def test_it_runs_by_default_once_per_kind_and_cache_format_on_small_decode_batches():
    assert "steady" in default_checks()
    check = SteadyCheck()
    assert "CUDA" in check.skip_reason(TorchGraphSafe, CPU)
    torch_naive = registry.load("torch_naive")
    chosen = [case for case in suite("standard") if check.case_skip_reason(torch_naive, case, CPU) is None]
    assert {(case.spec.kind, case.spec.fp8_kv_cache) for case in chosen} == {
        ("mha", False),
        ("mha", True),
        ("mla", False),
        ("mla", True),
    }
    assert all(case.max_query_len == 1 and case.num_reqs <= 8 for case in chosen)
    assert len(chosen) == len({(case.spec.kind, case.spec.kv_cache_dtype) for case in chosen})


@pytest.mark.gpu
@pytest.mark.parametrize(
    "defect,expected",
    [
        (steady_defects.SyncsEveryNthBuild, "host sync(s) over 256 decode steps, in steps 63, 127, 191, 255"),
        (steady_defects.KeepsEveryWorkspace, "device memory held after a step grew"),
        (steady_defects.SkipsRefreshEveryNthBuild, "decode step 63 of 256 differs"),
        (steady_defects.SyncsOnTheSecondBuild, "host sync(s) over 256 decode steps, in steps 1;"),
    ],
)
def test_planted_defects_fail_on_a_gpu(defect, expected):
    cuda = torch.device("cuda")
    assert steady_look(TorchGraphSafe, DECODE, cuda).verdict == Verdict.PASS
    result = steady_look(defect, DECODE, cuda)
    assert result.verdict == Verdict.FAIL and expected in result.reason, result.reason


@pytest.mark.gpu
def test_a_sync_on_the_first_call_only_is_lazy_initialisation_and_passes():
    """What a fresh process's first call of a JIT-loaded module does (FlashInfer's xqa kernels load
    on trtllm's first forward): not the steady state, so the verdict does not depend on what else
    the process ran first."""
    result = steady_look(steady_defects.SyncsOnTheFirstBuild, DECODE, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton", "triton_mla", "flashinfer"])
def test_built_in_backends_hold_steady(name):
    backend = registry.load(name)
    cuda = torch.device("cuda")
    check = SteadyCheck()
    for case in suite("standard"):
        if check.case_skip_reason(backend, case, cuda) is None:
            result = check.run_case(backend, case, cuda)
            assert result.verdict == Verdict.PASS, (case.id, result.reason)


def test_an_input_changed_in_place_fails_naming_the_step_and_call():
    from tests.planted.input_defects import ScalesQueryInPlace

    result = steady_look(ScalesQueryInPlace, DECODE, CPU, steps=8)
    assert result.verdict == Verdict.FAIL and result.reason.startswith(
        "the backend changed an input it was handed: step 0: forward changed query"
    ), result.reason
