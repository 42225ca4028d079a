"""syncs: does the backend block the host on the device in build, write_kv or forward?

Each case runs one warm-up step (lazy initialisation and JIT compilation are not the hot path),
then watched steps, twice: (a) with host lengths given, (b) without them, as an async scheduler
would call it. The watched steps are the case's step and the steps right after its batch changed,
as requests join and leave a serving engine's batch nearly every step (``compositions``): its
last request gone, an empty request in its place (where the backend claims vLLM's padding
requests), the request back. A backend that re-plans only when the batch changes (reading the
longest length back when the number of requests differs from its last build) syncs only there.
Any blocking event in (a) is FAIL for every backend: it had what it needed. Any in (b) is FAIL
for a backend claiming ``needs_cpu_seq_lens=False``, and reported with its source lines (not
failed) for one that claims True.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from backends.base import AttentionBackend
from backends.features import EMPTY_REQUESTS
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check
from conformance.harness.step import PreparedCase, prepare_case, run_step
from conformance.results import CaseResult, Outcome, Verdict
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
    return {phase: sum(1 for event in events if event.blocking and call_of(event) == phase) for phase in PHASES}


def call_of(event: SyncEvent) -> str:
    """The backend call of an event recorded in phase ``"<call>"`` or ``"<call>, <which step>"``."""
    return event.phase.split(",")[0]


def compositions(prepared: PreparedCase, backend_cls: type[AttentionBackend]) -> list[tuple[str, PreparedCase]]:
    """The watched steps, in order, each ``(label, step)``: the case's step, then each right
    after the batch changed (a one-request batch has nothing to drop: its step alone)."""
    steps = [("", prepared)]
    batch = prepared.batch
    if batch.case.num_reqs < 2:
        return steps
    fewer = batch.reordered(list(range(batch.case.num_reqs - 1)))
    steps.append(("after its last request left", prepared.over(fewer)))
    if backend_cls.capabilities.supports(EMPTY_REQUESTS):
        steps.append(("after an empty request took its place", prepared.over(fewer.with_empty_request())))
    steps.append(("after it joined again", prepared))
    return steps


def source_counts(mode: str, events: list[SyncEvent]) -> dict[str, int]:
    counts = Counter(f"{mode} | {event.kind} {event.api} | {event.source or 'unknown frame'}" for event in events)
    return dict(counts)


def _labelled(detector, label: str):
    """The detector's phase for each backend call, named with the step it is in."""
    return lambda call: detector.phase(f"{call}, {label}" if label else call)


class SyncsCheck(Check):
    name = "syncs"
    drives_trees = True  # its step hands the case's trees to the backend and the oracle
    kinds = EVERY_KIND
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

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        prepared = prepare_case(backend_cls, case, device)
        steps = compositions(prepared, backend_cls)
        events: dict[str, list[SyncEvent]] = {}
        strategy = blind_spots = fallback = ""
        for mode, with_host_lengths in MODES.items():
            run_step(prepared, with_host_lengths=with_host_lengths)  # warm-up
            torch.cuda.synchronize(device)
            events[mode] = []
            for label, step in steps:
                with detect_host_syncs(self.strategy, only_in_phases=True) as detector:
                    run_step(step, with_host_lengths=with_host_lengths, phase=_labelled(detector, label))
                torch.cuda.synchronize(device)
                events[mode] += detector.events
                strategy, blind_spots = detector.strategy_name, detector.blind_spots
                fallback = fallback or detector.fallback_reason
        verdict, reason = syncs_verdict(
            backend_cls.capabilities.needs_cpu_seq_lens, events["with_host_lengths"], events["without_host_lengths"]
        )
        metrics = {
            "strategy": strategy,
            "steps_watched": [label or "the case's step" for label, _ in steps],
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
        return Outcome(verdict, reason, metrics=metrics, evidence=evidence)

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
