"""``conformance merge``: the parts of a sharded run (``--shard I/N``, ``conformance.run.shard``)
joined into one results file that ``report`` and ``compare`` read as one run.

Every part must be there once, and all of one run: the same suite, checks, backends and cases, cut
into the same N. Each check's case results are put back in the run's order and summarized again,
as the run would have; a check that one part could not run at all (its backend failed to load
there) keeps the worst verdict and says which part said what, beside the cases the others ran.
The environment is the first part's, with each part's machine under ``shards``.
"""

from __future__ import annotations

from conformance.checks import make_check
from conformance.results import BackendResult, CheckResult, RunResult, worst


class MergeError(ValueError):
    """Parts that are not one sharded run, in one line."""


def merge_parts(parts: list[tuple[str, RunResult]]) -> RunResult:
    """The run the parts (path, results) were cut from (``MergeError`` when they are not one)."""
    if len(parts) < 2:
        raise MergeError("merge needs the results of at least two parts of one sharded run")
    first_path, first = parts[0]
    for path, part in parts:
        if part.shard is None:
            raise MergeError(f"{path}: not a part of a sharded run (it was not run with --shard)")
    count = first.shard["count"]
    for path, part in parts[1:]:
        _same_run(first_path, first, path, part)
    seen: dict[int, str] = {}
    for path, part in parts:
        index = part.shard["index"]
        if index in seen:
            raise MergeError(f"{seen[index]} and {path} are both part {index}/{count}")
        seen[index] = path
    missing = [f"{index}/{count}" for index in range(1, count + 1) if index not in seen]
    if missing:
        raise MergeError(f"part {', '.join(missing)} missing: give every part of the run")
    _covered(parts)
    ordered = [part for _, part in sorted(parts, key=lambda item: item[1].shard["index"])]
    order = {case_id: position for position, case_id in enumerate(first.shard["cases"])}
    backends = [_merge_backend([part.backends[at] for part in ordered], order) for at in range(len(first.backends))]
    environment = dict(ordered[0].environment)
    environment.pop("warm_s", None)  # each part warmed on its own machine: under ``shards``
    environment["shards"] = [
        {
            "part": f"{part.shard['index']}/{count}",
            **{key: part.environment.get(key) for key in ("host", "gpu", "time")},
            **({"warm_s": part.environment["warm_s"]} if "warm_s" in part.environment else {}),
        }
        for part in ordered
    ]
    return RunResult(
        environment, backends, first.suite, list(first.checks), interrupted=any(part.interrupted for part in ordered)
    )


def _covered(parts: list[tuple[str, RunResult]]) -> None:
    """Every case of the run in exactly one part, by the cut each part recorded (a part cut other
    ways, e.g. with other ``--shard-times``, would leave cases out or in twice)."""
    owner: dict[str, str] = {}
    for path, part in parts:
        for case_id in part.shard.get("assigned", []):
            if case_id in owner:
                raise MergeError(f"{owner[case_id]} and {path} both ran case {case_id}: the parts were cut differently")
            owner[case_id] = path
    left_out = [case_id for case_id in parts[0][1].shard["cases"] if case_id not in owner]
    if left_out:
        raise MergeError(
            f"no part ran case {left_out[0]} ({len(left_out)} case(s) left out): the parts were cut differently "
            "(give every part the same --shard-times, or none)"
        )


def _same_run(first_path: str, first: RunResult, path: str, part: RunResult) -> None:
    """``part`` was cut from the run ``first`` was: MergeError naming what differs."""
    differences = [
        ("suites", first.suite, part.suite),
        ("part counts", first.shard["count"], part.shard["count"]),
        ("checks", first.checks, part.checks),
        ("backends", [b.name for b in first.backends], [b.name for b in part.backends]),
        ("cases", first.shard["cases"], part.shard["cases"]),
        ("cuts", first.shard.get("times"), part.shard.get("times")),
        ("trees", first.environment.get("git_sha"), part.environment.get("git_sha")),  # a job on another commit
    ]
    for what, mine, theirs in differences:
        if mine != theirs:
            shown = (mine, theirs) if what in ("suites", "part counts", "cuts", "trees") else ("one list", "another")
            raise MergeError(
                f"{first_path} and {path} are parts of other runs: their {what} differ ({shown[0]} and {shown[1]})"
            )


def _merge_backend(rows: list[BackendResult], order: dict[str, int]) -> BackendResult:
    if len({row.available for row in rows}) > 1:  # its cases in the other parts would be lost
        down = next(row for row in rows if not row.available)
        raise MergeError(
            f"backend {down.name} could run in some parts and not in others ({down.reason}): "
            "run every part on machines of one kind"
        )
    ran = rows
    first = ran[0]
    checks = [_merge_check([row.checks[at] for row in ran], order) for at in range(len(first.checks))]
    return BackendResult(
        first.name,
        first.available,
        first.reason,
        first.origin,
        first.claims,
        checks,
        wall_s=sum(row.wall_s or 0.0 for row in ran),
        warm_s=sum(row.warm_s or 0.0 for row in ran),
    )


def _merge_check(parts: list[CheckResult], order: dict[str, int]) -> CheckResult:
    name = parts[0].name
    cases = sorted((case for part in parts for case in part.cases), key=lambda case: order[case.case])
    ids = [case.case for case in cases]
    repeated = sorted({case_id for case_id in ids if ids.count(case_id) > 1})
    if repeated:
        raise MergeError(f"case {repeated[0]} of check {name} is in more than one part")
    whole = [part for part in parts if not part.cases]  # a part that could not run the check at all
    if whole and len({(part.verdict, part.summary) for part in parts}) == 1:
        return parts[0]
    if whole:
        said = "; ".join(part.summary for part in whole)
        verdict = worst([part.verdict for part in parts])
        return CheckResult(
            name, verdict, f"{len(whole)} part(s) did not run it: {said}", cases, details=parts[0].details
        )
    check = make_check(name, {})
    verdict, summary = check.summarize(cases)
    return CheckResult(name, verdict, summary, cases, details={**parts[0].details, **check.aggregate(cases)})
