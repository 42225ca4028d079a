"""``--shard I/N``: part I of a run cut into N, for a CI matrix (GitHub Actions, GitLab
``parallel:``, Buildkite) whose jobs each run one part on a machine of their own; ``conformance
merge`` joins the parts' results into one run (``conformance.merge``).

The cut is by case: every backend and check of a case run in the same part, so a part's bench
ratios compare backends on one GPU, and each part plans every check over the whole run's cases
(a check that runs one case of each layout picks the same case in every part: a part runs and
reports only its own cases). The cut is the same in every job that is handed the same cases:
longest expected case first, each to the part with the least expected time so far (ties: the
lowest part). A case's expected time is its seconds in an earlier run's results
(``--shard-times``, summed over that run's backends and checks; a case it lacks counts as that
run's median) or, without one, the attention work of its batch (each query token times the keys
it sees), which orders long contexts and big batches first.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from conformance.cases.grammar import Case
from conformance.results import RunResult

# Every case costs this much work beside its attention (harness, planning, a tiny batch's own
# launch): without it, a case of a few tokens would count as free and every part would take them.
CASE_OVERHEAD = 100_000


class ShardError(ValueError):
    """A ``--shard`` or ``--shard-times`` a run cannot take, in one line."""


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as CI matrices count
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``I/N`` with 1 <= I <= N."""
    index, slash, count = text.partition("/")
    if not slash or not index.strip().isdigit() or not count.strip().isdigit():
        raise ShardError(f"--shard {text}: give I/N, part I of N (e.g. 2/4)")
    shard = Shard(int(index), int(count))
    if not 1 <= shard.index <= shard.count:
        raise ShardError(f"--shard {text}: I must be from 1 to N")
    return shard


def attention_work(case: Case) -> int:
    """Each query token times the keys it sees, summed over the batch, plus ``CASE_OVERHEAD``."""
    work = sum(query * (context + (query + 1) / 2) for context, query in case.batch)
    return CASE_OVERHEAD + int(work)


def case_seconds(run: RunResult) -> dict[str, float]:
    """Each case's seconds in ``run``, summed over its backends and checks."""
    seconds: dict[str, float] = {}
    for backend in run.backends:
        for check in backend.checks:
            for case in check.cases:
                seconds[case.case] = seconds.get(case.case, 0.0) + (case.seconds or 0.0)
    return seconds


def expected_times(cases: list[Case], earlier: dict[str, float] | None) -> list[float]:
    """Each case's expected time: its seconds in an earlier run, else that run's median; or,
    without one, its attention work."""
    if earlier is None:
        return [float(attention_work(case)) for case in cases]
    median = statistics.median(earlier.values()) if earlier else 1.0
    return [earlier.get(case.id, median) for case in cases]


def assign(cases: list[Case], count: int, earlier: dict[str, float] | None = None) -> list[int]:
    """Each case's part (1-based): longest expected first, to the least-loaded part."""
    times = expected_times(cases, earlier)
    loads = [0.0] * count
    parts = [0] * len(cases)
    sizes = [0] * count
    for position in sorted(range(len(cases)), key=lambda at: (-times[at], at)):
        # Equal loads (cases an earlier run timed at 0 s): the part with fewer cases, so none is empty.
        part = min(range(count), key=lambda index: (loads[index], sizes[index], index))
        loads[part] += times[position]
        sizes[part] += 1
        parts[position] = part + 1
    return parts


def shard_cases(cases: list[Case], shard: Shard, earlier: dict[str, float] | None = None) -> list[Case]:
    """The cases of part ``shard``, in the run's order."""
    return [case for case, part in zip(cases, assign(cases, shard.count, earlier)) if part == shard.index]
