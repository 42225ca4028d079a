"""syncs: does the backend block the host on the device in build, write_kv or forward?

Each case runs one warm-up step (lazy initialisation and JIT compilation are not the hot path),
then one watched step, twice: (a) with host lengths given, (b) without them, as an async
scheduler would call it. Any blocking event in (a) is FAIL for every backend: it had what it
needed. Any in (b) is FAIL for a backend claiming ``needs_cpu_seq_lens=False``, and reported
with its source lines (not failed) for one that claims True.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.checks.base import Check
from conformance.harness.step import prepare_case, run_step
from conformance.results import CaseResult, Verdict
from host_syncs.detector import detect_host_syncs
from host_syncs.events import SyncEvent

PHASES = ("build", "write_kv", "forward")
MODES = {"with_host_lengths": True, "without_host_lengths": False}
MAX_EVENTS_KEPT = 20


def syncs_verdict(
    needs_cpu_seq_lens: bool, with_host: list[SyncEvent], without_host: list[SyncEvent]
) -> tuple[Verdict, str]:
    blocking_with = [event for event in with_host if event.blocking]
    blocking_without = [event for event in without_host if event.blocking]
    if blocking_with:
        first = blocking_with[0]
        return Verdict.FAIL, (
            f"{len(blocking_with)} host sync(s) although host lengths "
            f"were given; first in {first.phase}: {first.describe()}"
        )
    if blocking_without:
        first = blocking_without[0]
        if not needs_cpu_seq_lens:
            return Verdict.FAIL, (
                f"{len(blocking_without)} host sync(s) without host lengths, but the backend claims "
                f"needs_cpu_seq_lens=False; first in {first.phase}: {first.describe()}"
            )
        return Verdict.PASS, (
            f"{len(blocking_without)} host sync(s) without host lengths (allowed: claims needs_cpu_seq_lens=True); "
            f"first in {first.phase}: {first.describe()}"
        )
    return Verdict.PASS, "no host syncs"


def phase_counts(events: list[SyncEvent]) -> dict[str, int]:
    return {phase: sum(1 for event in events if event.blocking and event.phase == phase) for phase in PHASES}


def source_counts(mode: str, events: list[SyncEvent]) -> dict[str, int]:
    counts = Counter(f"{mode} | {event.kind} {event.api} | {event.source or 'unknown frame'}" for event in events)
    return dict(counts)


class SyncsCheck(Check):
    name = "syncs"
    question = "host↔device syncs in build + write_kv + forward, with and without host lengths?"

    evidence_labels = {"cupti_unavailable": "detector fell back (CUPTI unavailable)"}
    sync_event_labels = {mode: mode.replace("_", " ") for mode in MODES}

    @property
    def strategy(self) -> str:
        return self.options.get("sync_detector", "auto")

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        if device.type != "cuda":
            return "host-device syncs exist only on a CUDA device (run with --device cuda)"
        return None

    def details(self) -> dict[str, Any]:
        return {"requested_strategy": self.strategy, "phases": list(PHASES)}

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        prepared = prepare_case(backend_cls, case, device)
        events: dict[str, list[SyncEvent]] = {}
        strategy = blind_spots = fallback = ""
        for mode, with_host_lengths in MODES.items():
            run_step(prepared, with_host_lengths=with_host_lengths)  # warm-up
            torch.cuda.synchronize(device)
            with detect_host_syncs(self.strategy, only_in_phases=True) as detector:
                run_step(prepared, with_host_lengths=with_host_lengths, phase=detector.phase)
            torch.cuda.synchronize(device)
            events[mode] = detector.events
            strategy, blind_spots, fallback = detector.strategy_name, detector.blind_spots, detector.fallback_reason
        verdict, reason = syncs_verdict(
            backend_cls.capabilities.needs_cpu_seq_lens, events["with_host_lengths"], events["without_host_lengths"]
        )
        metrics = {
            "strategy": strategy,
            "blind_spots": blind_spots,  # the detector's standing caveat, the same for every case: the details say it
            **{f"{mode}_blocking": phase_counts(mode_events) for mode, mode_events in events.items()},
            **{f"{mode}_info": sum(1 for e in mode_events if not e.blocking) for mode, mode_events in events.items()},
            "sources": {
                k: v for mode, mode_events in events.items() for k, v in source_counts(mode, mode_events).items()
            },
        }
        evidence = {
            mode: [event.to_dict() for event in mode_events[:MAX_EVENTS_KEPT]] for mode, mode_events in events.items()
        }
        if fallback:
            evidence["cupti_unavailable"] = fallback
        return CaseResult(case.id, verdict, reason, tag=case.tag, metrics=metrics, evidence=evidence)

    def aggregate(self, cases: list[CaseResult]) -> dict[str, Any]:
        ran = [case for case in cases if case.metrics.get("strategy")]
        if not ran:
            return {}
        per_call = {
            mode: {phase: sum(case.metrics[f"{mode}_blocking"][phase] for case in ran) / len(ran) for phase in PHASES}
            for mode in MODES
        }
        sources: Counter[str] = Counter()
        for case in ran:
            sources.update(case.metrics["sources"])
        return {
            "strategy": ran[0].metrics["strategy"],
            "blind_spots": ran[0].metrics.get("blind_spots", ""),
            "blocking_events_per_call": per_call,
            "sources": dict(sources.most_common()),
        }
