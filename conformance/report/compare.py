"""``conformance compare BASE.json NEW.json``: the CI gate. Exit 1 on any regression:

* a check that went from PASS to anything else (a claimed capability lost);
* a case that failed (FAIL, ERROR, CRASH) in NEW and did not in BASE, also where BASE lacks the
  case, the check or the whole backend (a baseline made with fewer checks or backends must not
  hide a new failure); a check that fails as a whole in NEW (a backend that cannot be loaded);
* numerics error growth: a case's max abs error more than ``error_growth`` times BASE's (and
  above a floor, so noise around zero is not a regression);
* bench regression: a case's forward time more than ``bench_threshold`` slower than BASE's;
* coverage lost, which would otherwise let a gate pass on less evidence: a backend, check or case
  of BASE absent from NEW, a case that went from PASS to SKIP, a different suite, a passing case
  whose max abs error or forward time is gone or 0 in NEW (it measured nothing). Each can be
  accepted knowingly (``accept``: "missing", "skips", "suite"); accepted ones are listed, not failed.
Improvements are listed too, and never fail the gate. A backend, check or case listed twice in
either file, and a threshold that is not a finite number in range, are usage errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection

from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict

ERROR_FLOOR = 1e-4  # absolute max-abs-error below which growth is noise
# The measurements the gate compares: one present in BASE and absent or 0 in NEW (a comparison or
# a timing that measured nothing: no output is exact against float64, no forward takes 0 µs) is
# lost coverage, not an improvement.
MEASURED = ("max_abs_error", "forward_us")
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


def _index(
    run: RunResult, which: str
) -> dict[str, tuple[BackendResult, dict[str, tuple[CheckResult, dict[str, CaseResult]]]]]:
    """backend -> (result, check -> (result, case -> result)); a name given twice is a usage error
    (which copy would count?)."""
    backends: dict = {}
    for backend in run.backends:
        if backend.name in backends:
            raise CompareError(f"{which} lists backend {backend.name!r} twice")
        checks: dict = {}
        for check in backend.checks:
            if check.name in checks:
                raise CompareError(f"{which} lists check {check.name!r} of backend {backend.name!r} twice")
            cases: dict = {}
            for case in check.cases:
                if case.case in cases:
                    raise CompareError(f"{which} lists case {case.case!r} of {backend.name} / {check.name} twice")
                cases[case.case] = case
            checks[check.name] = (check, cases)
        backends[backend.name] = (backend, checks)
    return backends


def _validate_thresholds(error_growth: float, bench_threshold: float, accept: Collection[str]) -> None:
    if not (math.isfinite(error_growth) and error_growth >= 1):
        raise CompareError(f"--error-growth {error_growth:g}: a growth factor is a finite number of at least 1")
    if not (math.isfinite(bench_threshold) and bench_threshold > 0):
        raise CompareError(f"--bench-threshold {bench_threshold:g}: a slowdown fraction is a finite number above 0")
    unknown = set(accept) - set(ACCEPTABLE)
    if unknown:
        raise CompareError(f"cannot accept {', '.join(sorted(unknown))} (choose from {', '.join(ACCEPTABLE)})")


def compare_runs(
    base: RunResult,
    new: RunResult,
    *,
    error_growth: float = 2.0,
    bench_threshold: float = 0.10,
    accept: Collection[str] = (),
) -> list[Finding]:
    """Every backend, check and case of either file: what NEW lost, what NEW newly fails
    (including in a backend or check BASE never ran), and what changed in between."""
    _validate_thresholds(error_growth, bench_threshold, accept)
    base_index, new_index = _index(base, "BASE"), _index(new, "NEW")

    def coverage(backend: str, check: str, case: str, what: str, kind: str) -> Finding:
        accepted = kind in accept
        return Finding(
            backend,
            check,
            case,
            what + (f" (accepted: --accept-{kind})" if accepted else f" (accept with --accept-{kind})"),
            not accepted,
            accepted,
        )

    findings: list[Finding] = []
    if base.suite != new.suite:
        findings.append(coverage("", "", "", f"suite {base.suite!r} in BASE, {new.suite!r} in NEW", "suite"))
    for name in [*base_index, *(name for name in new_index if name not in base_index)]:
        if name not in new_index:
            findings.append(coverage(name, "", "", "backend missing from NEW", "missing"))
            continue
        base_checks = base_index[name][1] if name in base_index else {}
        new_checks = new_index[name][1]
        for check_name in [*base_checks, *(check for check in new_checks if check not in base_checks)]:
            if check_name not in new_checks:
                findings.append(coverage(name, check_name, "", "check missing from NEW", "missing"))
                continue
            before_check, before_cases = base_checks.get(check_name, (None, {}))
            absent = "check absent from BASE" if name in base_index else "backend absent from BASE"
            findings += _compare_check(
                name,
                before_check,
                before_cases,
                *new_checks[check_name],
                coverage,
                error_growth,
                bench_threshold,
                absent,
            )
    return findings


def _compare_check(
    backend: str,
    base_check: CheckResult | None,
    base_cases: dict[str, CaseResult],
    new_check: CheckResult,
    new_cases: dict[str, CaseResult],
    coverage,
    error_growth: float,
    bench_threshold: float,
    absent: str,
) -> list[Finding]:
    findings: list[Finding] = []
    check = new_check.name
    for case_id in base_cases:
        if case_id not in new_cases:
            findings.append(coverage(backend, check, case_id, "case missing from NEW", "missing"))
    was_check = base_check.verdict.value if base_check else absent
    if base_check is not None and base_check.verdict == Verdict.PASS and new_check.verdict != Verdict.PASS:
        findings.append(Finding(backend, check, "", f"check went PASS → {new_check.verdict.value}", True))
    elif base_check is not None and base_check.verdict.is_failure and new_check.verdict == Verdict.PASS:
        findings.append(Finding(backend, check, "", f"check went {base_check.verdict.value} → PASS", False))
    elif not new_check.cases and new_check.verdict.is_failure and not (base_check and base_check.verdict.is_failure):
        # A check that failed as a whole (a backend that could not be loaded): no case says so.
        findings.append(
            Finding(backend, check, "", f"new {new_check.verdict.value} (was {was_check}): {new_check.summary}", True)
        )
    for case in new_cases.values():
        before = base_cases.get(case.case)
        if case.verdict.is_failure and (before is None or not before.verdict.is_failure):
            was = before.verdict.value if before else ("absent" if base_check else absent)
            findings.append(
                Finding(backend, check, case.case, f"new {case.verdict.value} (was {was}): {case.reason}", True)
            )
        if before is None:
            continue
        for key in MEASURED:  # a measurement that vanished: a gate on it would pass on nothing
            old_value, new_value = before.metrics.get(key), case.metrics.get(key)
            if case.verdict == Verdict.PASS and old_value and not new_value:
                now = "absent" if new_value is None else f"{new_value!r}"
                findings.append(
                    coverage(backend, check, case.case, f"{key} {old_value:.3g} in BASE, {now} in NEW", "missing")
                )
        if before.verdict == Verdict.PASS and case.verdict == Verdict.SKIP:
            findings.append(coverage(backend, check, case.case, f"PASS → SKIP: {case.reason}", "skips"))
        old_error, new_error = before.metrics.get("max_abs_error"), case.metrics.get("max_abs_error")
        if (
            old_error is not None
            and new_error is not None
            and new_error > ERROR_FLOOR
            and new_error > error_growth * max(old_error, ERROR_FLOOR / error_growth)
        ):
            findings.append(
                Finding(
                    backend,
                    check,
                    case.case,
                    f"max abs error grew {old_error:.3g} → {new_error:.3g} (more than ×{error_growth:g})",
                    True,
                )
            )
        old_time, new_time = before.metrics.get("forward_us"), case.metrics.get("forward_us")
        if old_time and new_time:
            change = new_time / old_time - 1
            if change > bench_threshold:
                findings.append(
                    Finding(
                        backend,
                        check,
                        case.case,
                        f"forward {old_time:.1f} → {new_time:.1f} µs "
                        f"(+{100 * change:.0f}%, threshold {100 * bench_threshold:.0f}%)",
                        True,
                    )
                )
            elif change < -bench_threshold:
                findings.append(
                    Finding(
                        backend,
                        check,
                        case.case,
                        f"forward {old_time:.1f} → {new_time:.1f} µs ({100 * change:.0f}%)",
                        False,
                    )
                )
    return findings
