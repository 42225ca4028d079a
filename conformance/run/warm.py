"""Warm once (``conformance run --warm``): before the checks fan out over the pool, each backend
runs one case of every kernel layout it will run, and only then do its checks start. What a backend
compiles on first use (FlashInfer's JIT modules, Triton's kernels) is compiled once, a layout a
child, spread over the slots, instead of inside whichever checks' cases come first, by several
children at once, each holding a slot while it compiles or waits on another's compile.

A layout is what a kernel is built for: the case's attention spec (kind, heads, head dims, dtypes,
cache format, block size, window, sinks, sparse top-k, fp8 query), and whether it drafts token
trees or shards its KV over DCP ranks. Each layout's warm case is the lightest case of the first
check (in the run's order) that runs one of its cases, run by that check: the same code path as the
case the checks run later. Its PASS is thrown away (the check runs it again, and reports it); a
failure there is the case's verdict (``pool``: a fault on a layout's first, cold run is the
backend's). Its seconds are the backend's ``warm_s``, and the phase's wall time the results'
``warm_s``.
"""

from __future__ import annotations

from typing import Any

from conformance.cases.grammar import Case
from conformance.run.runner import RunOptions
from conformance.run.shard import assign, attention_work


def layout_of(case: Case) -> tuple[Any, ...]:
    """What the kernels a case runs are built for (module docstring)."""
    return case.spec, bool(case.trees), case.dcp > 1


def warm_cases(options: RunOptions, plan: dict[str, Any]) -> dict[str, list[Case]]:
    """Check -> the cases it warms: each layout's lightest case of the first check that runs one."""
    chosen: dict[tuple[Any, ...], tuple[str, Case]] = {}
    lightest_first = sorted(options.reported_cases, key=attention_work)
    for check, whole in plan["checks"].items():
        if whole:
            continue
        for case in lightest_first:
            if not plan["cases"][check][case.id]:
                chosen.setdefault(layout_of(case), (check, case))
    by_check: dict[str, list[Case]] = {}
    for check, case in chosen.values():
        by_check.setdefault(check, []).append(case)
    return by_check


def warm_parts(options: RunOptions, plan: dict[str, Any], slots: int) -> list[tuple[str, list[str]]]:
    """A backend's warm work as (check, case ids) parts: each check's warm cases over at most
    ``slots`` parts, balanced by attention work, so that different layouts compile at once."""
    parts = []
    for check, cases in warm_cases(options, plan).items():
        assigned = assign(cases, min(slots, len(cases)))
        for part in sorted(set(assigned)):
            parts.append((check, [case.id for case, at in zip(cases, assigned) if at == part]))
    return parts
