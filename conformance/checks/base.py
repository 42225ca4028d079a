"""What every check is: a question asked of one backend, case by case.

Checks are per case so that the isolated child can stream each result as it lands and a crash
loses nothing but the case that was running.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Hashable

import torch

from backends.base import AttentionBackend
from backends.layer_kinds import LAYER_KINDS
from conformance.cases.grammar import Case
from conformance.harness.batch import big_pool_skip_reason
from conformance.harness.evidence import MAP_KEYS, EvidenceItem, labelled, maps, sync_events, without, worst_element
from conformance.results import CaseResult, Outcome, Verdict, worst

ATTENTION_KINDS = frozenset(name for name, kind in LAYER_KINDS.items() if kind.attends)
EVERY_KIND = frozenset(LAYER_KINDS)

Plan = dict[str, "str | None"]  # case id -> why the case is SKIP, None where it runs


def first_of_each(
    cases: list[Case],
    key: Callable[[Case], Hashable],
    reason: Callable[[Case], "str | None"],
    covered: str,
    before: Callable[[Case], "str | None"] = lambda case: None,
) -> Plan:
    """A plan that runs one case of each ``key``: the first whose ``reason`` is None; each later
    one SKIPs with ``covered`` naming it. ``before`` rules a case out before its key is looked at."""
    plan: Plan = {}
    first: dict[Hashable, str] = {}
    for case in cases:
        why = before(case)
        if not why and key(case) in first:
            why = covered.format(first[key(case)])
        why = why or reason(case)
        if not why:
            first[key(case)] = case.id
        plan[case.id] = why
    return plan


class Check(abc.ABC):
    name: ClassVar[str]
    question: ClassVar[str]
    # The evidence keys this check writes whose value is shown as it is, and the label every report
    # gives each (in this order); a key that needs more than a label is described by an override.
    evidence_labels: ClassVar[dict[str, str]] = {}
    # The evidence keys that hold host-sync events (``SyncEventRecord`` lists), with their labels.
    sync_event_labels: ClassVar[dict[str, str]] = {}

    # Roughly how long one case of this check takes beyond its attention work (seconds on an H200):
    # what a pool weighs its units by (``run.pool``). A check that watches a backend over a fixed
    # span (steady, engine) costs that span on a batch of any size.
    case_seconds: ClassVar[float] = 1.0

    # The layer kinds whose output this check judges: a case of another kind is SKIP saying so
    # (data: no check branches on a kind's name). By default the attentions; a check that drives
    # steps and holds each answer against the oracle's (``harness.answers``) judges every kind.
    kinds: ClassVar[frozenset[str]] = ATTENTION_KINDS
    # Whether this check's harness hands a step's token trees (``backends.base``: "Token trees") to
    # the backend and the oracle; a tree case is SKIP saying which checks judge trees where not.
    drives_trees: ClassVar[bool] = False
    # Whether this check's harness shards a DCP case's step over its ranks (``harness.dcp``); a
    # ``dcpN`` case is SKIP saying which checks judge DCP where not.
    drives_dcp: ClassVar[bool] = False

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = options or {}

    def judged_reason(self, case: Case) -> str | None:
        """Why this check does not judge ``case``: its layer kind (``kinds``), its token trees where
        the check's harness does not hand them (``drives_trees``), or its DCP ranks where it does
        not shard a step over them (``drives_dcp``); None when it does."""
        if case.spec.kind not in self.kinds:
            return f"the {self.name} check judges {', '.join(sorted(self.kinds))} layers, not {case.spec.kind}"
        if case.needs.trees and not self.drives_trees:
            from conformance.checks import CHECKS  # noqa: PLC0415 - the registry imports this module

            judged = ", ".join(name for name, check in CHECKS.items() if check.drives_trees)
            return f"the {self.name} check runs chains only: token trees are judged by {judged}"
        if case.dcp > 1 and not self.drives_dcp:
            from conformance.checks import CHECKS  # noqa: PLC0415 - the registry imports this module

            judged = ", ".join(name for name, check in CHECKS.items() if check.drives_dcp)
            return f"the {self.name} check does not shard a step over DCP ranks: DCP is judged by {judged}"
        return None

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        """Why the whole check does not apply here (a claim the backend does not make, a CPU run)."""
        return None

    def plan(self, backend_cls: type[AttentionBackend], cases: list[Case], device: torch.device) -> Plan:
        """Each case's SKIP reason (None: it runs), decided for the whole list at once and from
        nothing else: the same cases plan the same in every process, in any order of asking. A
        check that runs one case of each kind of layout overrides this (``first_of_each``)."""
        return {case.id: self.case_skip_reason(backend_cls, case, device) for case in cases}

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        """One case's own reason: the backend's claims against what the case needs (one rule
        table: ``Capabilities.skip_reason``), and a pool too big for this device."""
        return (
            backend_cls.capabilities.skip_reason(case.needs, device)
            or self.judged_reason(case)
            or big_pool_skip_reason(case, device)
        )

    @abc.abstractmethod
    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        """Run one case and judge it; raise only for a backend error (the runner makes it ERROR). A
        step that wrote where it may not (``harness.WroteOutsideOutput``) raises to the runner too,
        which makes it the case's FAIL in any check."""

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
