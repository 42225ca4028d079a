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
