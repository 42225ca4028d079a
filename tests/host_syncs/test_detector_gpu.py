"""The detector on a real GPU: every planted sync caught at its line, no control flagged."""

import pytest
import torch

from conformance.cases.grammar import parse_case
from conformance.checks.syncs import SyncsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from host_syncs import detect_host_syncs
from tests.planted import syncs as planted

pytestmark = pytest.mark.gpu
PLANTED_FILE = planted.__file__.removesuffix("c")  # .pyc → .py


def marker_line(name: str) -> int:
    with open(PLANTED_FILE) as source:
        for number, line in enumerate(source, 1):
            if line.rstrip().endswith(f"# planted: {name}"):
                return number
    raise AssertionError(f"no marker for {name}")


@pytest.fixture
def x():
    tensor = torch.arange(4096, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    return tensor


def caught_at(events, line):
    return [
        e for e in events if e.blocking and e.source and e.source.filename == PLANTED_FILE and e.source.lineno == line
    ]


@pytest.mark.parametrize("planted_sync", planted.PLANTED, ids=lambda f: f.__name__)
def test_cupti_catches_each_planted_sync_at_its_line(planted_sync, x):
    planted_sync(x)  # warm-up: library loading is not the thing under test
    torch.cuda.synchronize()
    with detect_host_syncs("cupti") as detector:
        planted_sync(x)
    assert caught_at(detector.events, marker_line(planted_sync.__name__)), [e.describe() for e in detector.events]


@pytest.mark.parametrize("control", planted.CONTROLS, ids=lambda f: f.__name__)
def test_controls_are_not_flagged(control, x):
    control(x)  # warm-up (Triton compiles, the caching allocator grows)
    torch.cuda.synchronize()
    with detect_host_syncs("cupti") as detector:
        control(x)
    assert detector.blocking_events == [], [e.describe() for e in detector.blocking_events]
    torch.cuda.synchronize()


def test_torch_strategy_sees_pytorch_syncs_and_misses_raw_cuda(x):
    for planted_sync in (planted.item, planted.cpu, planted.tolist):
        with detect_host_syncs("torch") as detector:
            planted_sync(x)
        assert caught_at(detector.events, marker_line(planted_sync.__name__)), planted_sync.__name__
    with detect_host_syncs("torch") as detector:
        planted.raw_cuda_memcpy_d2h(x)
    assert detector.blocking_events == []  # the blind spot CUPTI exists for


def test_syncs_check_fails_a_backend_that_copies_seq_lens_in_build_naming_the_line():
    case = parse_case("gqa-h8/2-d64-bf16-p16:100+1,30+4")
    result = judge(SyncsCheck(), planted.SeqLensCpuInBuild, case, torch.device("cuda"))
    assert result.verdict == Verdict.FAIL
    assert f"syncs.py:{marker_line('seq_lens_cpu_in_build')}" in result.reason


def test_syncs_check_reports_torch_naive_host_copies_without_failing_it():
    case = parse_case("gqa-h8/2-d64-bf16-p16:100+1,30+4")
    from backends.torch_naive import TorchNaiveBackend

    result = judge(SyncsCheck(), TorchNaiveBackend, case, torch.device("cuda"))
    assert result.verdict == Verdict.PASS, result.reason
    assert sum(result.metrics["with_host_lengths_blocking"].values()) == 0
    assert result.metrics["without_host_lengths_blocking"]["build"] >= 1
    assert any("torch_naive.py" in source for source in result.metrics["sources"])


def test_forbid_host_syncs_fixture_fails_listing_the_line(pytester):
    pytester.makepyfile(
        """
        import torch

        def test_syncs(forbid_host_syncs):
            x = torch.ones(4, device="cuda")
            x.sum().item()
        """
    )
    result = pytester.runpytest_subprocess("-p", "conformance.pytest_plugin")
    result.assert_outcomes(failed=1, errors=0)
    result.stdout.fnmatch_lines(
        ["*host-blocking CUDA call*", "*test_forbid_host_syncs_fixture_fails_listing_the_line.py:5*"]
    )


def test_forbid_host_syncs_imported_alone_fails_at_teardown(pytester):
    # No conformance plugin: the fixture imported into a conftest, as an engine author would use it.
    pytester.makeconftest("from host_syncs import forbid_host_syncs  # noqa: F401\n")
    pytester.makepyfile(
        """
        import torch

        def test_syncs(forbid_host_syncs):
            x = torch.ones(4, device="cuda")
            x.sum().item()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:conformance")
    result.assert_outcomes(passed=1, errors=1)  # the body ran; the fixture's teardown judged it
    result.stdout.fnmatch_lines(["*host-blocking CUDA call*"])


def test_no_cupti_subscriber_outlives_the_detector_s_pass(x):
    """CUPTI refuses a second subscriber while one is attached: a fresh subscribe after the pass
    succeeds only if the detector let go (a callback left on would tax every later timed run)."""
    cupti = pytest.importorskip("cupti").cupti
    with detect_host_syncs("cupti") as detector:
        torch.cuda.synchronize()
    assert detector.strategy_name == "cupti" and detector.blocking_events
    handle = cupti.subscribe(lambda *args: None, None)  # raises CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED if not
    cupti.unsubscribe(handle)
