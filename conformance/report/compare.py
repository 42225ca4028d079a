"""``conformance compare BASE.json NEW.json``: the CI gate. Exit 1 on any regression:

* a check that went from PASS to anything else (a claimed capability lost);
* a case that failed (FAIL, ERROR, CRASH) in NEW and did not in BASE;
* numerics error growth: a case's max abs error more than ``error_growth`` times BASE's (and
  above a floor, so noise around zero is not a regression);
* bench regression: a case's forward time more than ``bench_threshold`` slower than BASE's;
* coverage lost, which would otherwise let a gate pass on less evidence: a backend, check or case
  of BASE absent from NEW, a case that went from PASS to SKIP, a different suite. Each can be
  accepted knowingly (``accept``: "missing", "skips", "suite"); accepted ones are listed, not failed.
Improvements are listed too, and never fail the gate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from conformance.results import RunResult, Verdict

ERROR_FLOOR = 1e-4  # absolute max-abs-error below which growth is noise
ACCEPTABLE = ("missing", "skips", "suite")  # coverage losses a user may accept knowingly


class CompareError(ValueError):
    """Thresholds that make no sense; one line for the user."""


@dataclass
class Finding:
    backend: str
    check: str
    case: str
    what: str
    regression: bool
    accepted: bool = False  # a coverage loss the user accepted knowingly (neither regression nor improvement)


def compare_runs(base: RunResult, new: RunResult, *, error_growth: float = 2.0, bench_threshold: float = 0.10,
            accept: Collection[str] = ()) -> list[Finding]:
    if not error_growth >= 1:
        raise CompareError(f"--error-growth {error_growth:g}: a growth factor is at least 1")
    if not bench_threshold >= 0:
        raise CompareError(f"--bench-threshold {bench_threshold:g}: a slowdown fraction is at least 0")
    unknown = set(accept) - set(ACCEPTABLE)
    if unknown:
        raise CompareError(f"cannot accept {', '.join(sorted(unknown))} (choose from {', '.join(ACCEPTABLE)})")

    def coverage(backend: str, check: str, case: str, what: str, kind: str) -> Finding:
        accepted = kind in accept
        return Finding(backend, check, case, what + (f" (accepted: --accept-{kind})" if accepted else f" (accept with --accept-{kind})"),
                       not accepted, accepted)

    findings: list[Finding] = []
    if base.suite != new.suite:
        findings.append(coverage("", "", "", f"suite {base.suite!r} in BASE, {new.suite!r} in NEW", "suite"))
    new_backends = {backend.name: backend for backend in new.backends}
    for base_backend in base.backends:
        new_backend = new_backends.get(base_backend.name)
        if new_backend is None:
            findings.append(coverage(base_backend.name, "", "", "backend missing from NEW", "missing"))
            continue
        for base_check in base_backend.checks:
            new_check = new_backend.check(base_check.name)
            if new_check is None:
                findings.append(coverage(base_backend.name, base_check.name, "", "check missing from NEW", "missing"))
                continue
            new_case_ids = {case.case for case in new_check.cases}
            for before in base_check.cases:
                if before.case not in new_case_ids:
                    findings.append(coverage(base_backend.name, base_check.name, before.case, "case missing from NEW", "missing"))
            if base_check.verdict == Verdict.PASS and new_check.verdict != Verdict.PASS:
                findings.append(Finding(base_backend.name, base_check.name, "", f"check went PASS → {new_check.verdict.value}", True))
            elif base_check.verdict.is_failure and new_check.verdict == Verdict.PASS:
                findings.append(Finding(base_backend.name, base_check.name, "", f"check went {base_check.verdict.value} → PASS", False))
            base_cases = {case.case: case for case in base_check.cases}
            for case in new_check.cases:
                before = base_cases.get(case.case)
                if case.verdict.is_failure and (before is None or not before.verdict.is_failure):
                    was = before.verdict.value if before else "absent"
                    findings.append(Finding(base_backend.name, base_check.name, case.case, f"new {case.verdict.value} (was {was}): {case.reason}", True))
                if before is None:
                    continue
                if before.verdict == Verdict.PASS and case.verdict == Verdict.SKIP:
                    findings.append(coverage(base_backend.name, base_check.name, case.case, f"PASS → SKIP: {case.reason}", "skips"))
                old_error, new_error = before.metrics.get("max_abs_error"), case.metrics.get("max_abs_error")
                if old_error is not None and new_error is not None and new_error > ERROR_FLOOR and new_error > error_growth * max(old_error, ERROR_FLOOR / error_growth):
                    findings.append(Finding(base_backend.name, base_check.name, case.case,
                                            f"max abs error grew {old_error:.3g} → {new_error:.3g} (more than ×{error_growth:g})", True))
                old_time, new_time = before.metrics.get("forward_us"), case.metrics.get("forward_us")
                if old_time and new_time:
                    change = new_time / old_time - 1
                    if change > bench_threshold:
                        findings.append(Finding(base_backend.name, base_check.name, case.case,
                                                f"forward {old_time:.1f} → {new_time:.1f} µs (+{100 * change:.0f}%, threshold {100 * bench_threshold:.0f}%)", True))
                    elif change < -bench_threshold:
                        findings.append(Finding(base_backend.name, base_check.name, case.case,
                                                f"forward {old_time:.1f} → {new_time:.1f} µs ({100 * change:.0f}%)", False))
    return findings
