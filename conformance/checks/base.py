"""What every check is: a question asked of one backend, case by case.

Checks are per case so that the isolated child can stream each result as it lands and a crash
loses nothing but the case that was running.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case
from conformance.harness.batch import big_pool_skip_reason
from conformance.harness.evidence import MAP_KEYS, EvidenceItem, labelled, maps, sync_events, without, worst_element
from conformance.harness.step import WroteOutsideOutput
from conformance.results import CaseResult, Verdict, worst


def lse_skip_reason(backend_cls: type[AttentionBackend], case: Case) -> str | None:
    """Why an ``lse`` case cannot ask this backend for its log-sum-exp, or None."""
    if case.lse and not backend_cls.capabilities.returns_lse:
        note = backend_cls.capabilities.lse_note
        return "returns no log-sum-exp (the case asks forward for one; claims returns_lse=False)" + (
            f": {note}" if note else ""
        )
    return None


class Check(abc.ABC):
    name: ClassVar[str]
    question: ClassVar[str]
    # The evidence keys this check writes whose value is shown as it is, and the label every report
    # gives each (in this order); a key that needs more than a label is described by an override.
    evidence_labels: ClassVar[dict[str, str]] = {}
    # The evidence keys that hold host-sync events (``SyncEventRecord`` lists), with their labels.
    sync_event_labels: ClassVar[dict[str, str]] = {}

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = options or {}

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        """Why the whole check does not apply here (a claim the backend does not make, a CPU run)."""
        return None

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        return (
            backend_cls.unsupported_reason(case.spec, device)
            or backend_cls.capabilities.query_len_reason(case.max_query_len, [query for _, query in case.batch])
            or lse_skip_reason(backend_cls, case)
            or big_pool_skip_reason(case, device)
        )

    @abc.abstractmethod
    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        """Run one case; raise only for a backend error (reported as ERROR)."""

    def run(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        """``run_case``, where a step that wrote where it may not (a tensor it was handed, output
        rows past its real tokens: ``harness.WroteOutsideOutput``) is a FAIL in any check."""
        try:
            return self.run_case(backend_cls, case, device)
        except WroteOutsideOutput as error:
            return CaseResult(case.id, Verdict.FAIL, str(error), tag=case.tag)

    @classmethod
    def describe_evidence(cls, evidence: dict[str, Any]) -> list[EvidenceItem]:
        """What every report shows of one case's evidence: the keys of ``sync_event_labels`` (an item
        per event) and of ``evidence_labels`` under their labels, the oracle comparison's worst
        element (numerics, graphs and the draft loop write it) and its maps, then a crashed child's stderr, an
        error's traceback (any check can have them) and any key no check described, shown as it is.
        An override describes its own keys and passes the rest here (``evidence.without``)."""
        events = [
            item for key, label in cls.sync_event_labels.items() for item in sync_events(label, evidence.get(key))
        ]
        labelled_items = [
            item for key, label in cls.evidence_labels.items() for item in labelled(label, evidence.get(key))
        ]
        rest = without(evidence, "worst", *MAP_KEYS, *cls.sync_event_labels, *cls.evidence_labels)
        return (
            events
            + labelled_items
            + worst_element(evidence.get("worst"))
            + maps(evidence)
            + [item for key, value in rest.items() for item in labelled(key.replace("_", " "), value)]
        )

    def details(self) -> dict[str, Any]:
        """Check-wide facts the report should state (tolerances, strategy)."""
        return {}

    def aggregate(self, cases: list[CaseResult]) -> dict[str, Any]:
        """Check-wide figures computed from the case results (added to ``details``)."""
        return {}

    def summarize(self, cases: list[CaseResult]) -> tuple[Verdict, str]:
        verdict = worst(case.verdict for case in cases)
        counts = {v: sum(1 for case in cases if case.verdict == v) for v in Verdict}
        summary = ", ".join(f"{count} {v.value}" for v, count in counts.items() if count)
        return verdict, summary or "no cases"
