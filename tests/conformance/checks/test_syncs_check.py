"""The syncs check's verdicts and per-phase counts, on recorded events (CPU)."""

from conformance.checks.syncs import phase_counts, syncs_verdict
from conformance.results import Verdict
from host_syncs.events import SyncEvent


def test_phase_counts():
    events = [SyncEvent("sync", "cuCtxSynchronize", True, phase="build")]
    assert phase_counts(events) == {"build": 1, "write_kv": 0, "forward": 0}


def test_verdicts():
    sync = SyncEvent("sync", "cudaStreamSynchronize", True, phase="build")
    alloc = SyncEvent("device-alloc", "cudaMalloc", False, phase="forward")
    assert syncs_verdict(False, [], [])[0] == Verdict.PASS
    assert syncs_verdict(True, [alloc], [alloc])[0] == Verdict.PASS  # information only
    verdict, reason = syncs_verdict(True, [sync], [])
    assert verdict == Verdict.FAIL and "although host lengths were given" in reason
    verdict, reason = syncs_verdict(False, [], [sync])
    assert verdict == Verdict.FAIL and "needs_cpu_seq_lens=False" in reason
    verdict, reason = syncs_verdict(True, [], [sync])
    assert verdict == Verdict.PASS and "allowed" in reason and "in build" in reason


def test_the_watched_steps_include_the_batch_after_it_changed():
    """A leave, an empty request in its place (only where vLLM's padding requests are claimed), a
    join: each its own watched step, the events named with it."""
    import torch

    from backends.torch_naive import TorchNaiveBackend
    from conformance.cases.grammar import parse_case
    from conformance.checks.syncs import call_of, compositions
    from conformance.harness.step import prepare_case, run_step
    from tests.planted.graph_backends import TorchGraphSafe

    case = parse_case("gqa-h4/2-d32-bf16-p16:30+1,20+4,9+1")
    prepared = prepare_case(TorchNaiveBackend, case, torch.device("cpu"))
    steps = compositions(prepared, TorchNaiveBackend)
    assert [label for label, _ in steps] == [
        "",
        "after its last request left",
        "after an empty request took its place",
        "after it joined again",
    ]
    assert [step.batch.case.batch for _, step in steps] == [
        ((30, 1), (20, 4), (9, 1)),
        ((30, 1), (20, 4)),
        ((30, 1), (20, 4), (0, 0)),
        ((30, 1), (20, 4), (9, 1)),
    ]
    for _, step in steps:  # each one a step the backend runs, right
        out = run_step(step)
        assert torch.allclose(out.double(), step.batch.reference_output(), atol=2e-2, rtol=2e-2)
    rows_only = [label for label, _ in compositions(prepared, TorchGraphSafe)]
    assert "after an empty request took its place" not in rows_only
    alone = prepare_case(TorchNaiveBackend, parse_case("gqa-h4/2-d32-bf16-p16:30+1"), torch.device("cpu"))
    assert len(compositions(alone, TorchNaiveBackend)) == 1
    assert call_of(SyncEvent("sync", "x", True, phase="build, after its last request left")) == "build"
