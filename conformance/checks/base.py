"""What every check is: a question asked of one backend, case by case.

Checks are per case so that the isolated child can stream each result as it lands and a crash
loses nothing but the case that was running.
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from backends.base import AttentionBackend
from conformance.inputs.cases import Case
from conformance.checks.evidence import EvidenceItem, labelled, without, worst_element
from conformance.results import CaseResult, Verdict, worst


class Check(abc.ABC):
    name: ClassVar[str]
    question: ClassVar[str]

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = options or {}

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        """Why the whole check does not apply here (a claim the backend does not make, a CPU run)."""
        return None

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        return backend_cls.unsupported_reason(case.spec, device) or backend_cls.capabilities.query_len_reason(
            case.max_query_len, [query for _, query in case.batch]
        )

    @abc.abstractmethod
    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> CaseResult:
        """Run one case; raise only for a backend error (reported as ERROR)."""

    @classmethod
    def describe_evidence(cls, evidence: dict[str, Any]) -> list[EvidenceItem]:
        """What every report shows of one case's evidence. A check describes the keys it writes and
        passes the rest here (``evidence.without``): the oracle comparison's worst element (numerics,
        graphs and the draft loop write it), a crashed child's stderr and an error's traceback,
        which any check can have, and any key no check described, shown as it is."""
        rest = without(evidence, "worst")
        return worst_element(evidence.get("worst")) + [item for key, value in rest.items() for item in labelled(key.replace("_", " "), value)]

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
