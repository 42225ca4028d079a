"""``conformance compare BASE.json NEW.json``: the CI gate. Exit 1 on any regression:

* a check that went from PASS to anything else (a claimed capability lost);
* a case that failed (FAIL, ERROR, CRASH) in NEW and did not in BASE;
* numerics error growth: a case's max abs error more than ``error_growth`` times BASE's (and
  above a floor, so noise around zero is not a regression);
* bench regression: a case's forward time more than ``bench_threshold`` slower than BASE's.
Improvements are listed too, and never fail the gate.
"""
from __future__ import annotations

from dataclasses import dataclass

from conformance.results import RunResult, Verdict

ERROR_FLOOR = 1e-4  # absolute max-abs-error below which growth is noise


@dataclass
class Finding:
    backend: str
    check: str
    case: str
    what: str
    regression: bool


def compare(base: RunResult, new: RunResult, *, error_growth: float = 2.0, bench_threshold: float = 0.10) -> list[Finding]:
    findings: list[Finding] = []
    new_backends = {backend.name: backend for backend in new.backends}
    for base_backend in base.backends:
        new_backend = new_backends.get(base_backend.name)
        if new_backend is None:
            findings.append(Finding(base_backend.name, "", "", "backend missing from NEW", True))
            continue
        for base_check in base_backend.checks:
            new_check = new_backend.check(base_check.name)
            if new_check is None:
                findings.append(Finding(base_backend.name, base_check.name, "", "check missing from NEW", base_check.verdict == Verdict.PASS))
                continue
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
