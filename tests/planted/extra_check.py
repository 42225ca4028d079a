"""A check that is not built in: the one file a new check takes (it is registered by one line,
in tests/conformance/checks/test_check_registry.py). It fails every case with a query longer than one
token, with evidence of its own, so every report must show its column and its evidence."""

from __future__ import annotations

from typing import Any

from conformance.checks.base import Check
from conformance.harness.evidence import EvidenceItem, labelled, without
from conformance.results import Outcome, Verdict


class LongestQueryCheck(Check):
    name = "longest-query"
    question = "does every request of the batch decode one token?"

    @classmethod
    def describe_evidence(cls, evidence: dict[str, Any]) -> list[EvidenceItem]:
        return labelled("longest query", evidence.get("longest_query")) + super().describe_evidence(
            without(evidence, "longest_query")
        )

    def run_case(self, backend_cls, case, device) -> Outcome:
        if case.max_query_len == 1:
            return Outcome(Verdict.PASS, "decode only")
        evidence = {
            "longest_query": f"{case.max_query_len} tokens in request "
            f"{max(range(case.num_reqs), key=lambda r: case.batch[r][1])}"
        }
        return Outcome(Verdict.FAIL, "a request verifies drafts", evidence=evidence)
