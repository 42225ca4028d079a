"""``--shard I/N`` and ``conformance merge``: the cut is the same in every part and balanced, the
parts of a run merge into what the whole run writes, and what is not one run is refused in one
line."""

import json
import subprocess
import sys

import pytest

from conformance.cases.grammar import parse_case
from conformance.cases.suites import suite
from conformance.report.merge import MergeError, merge_parts
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.run.shard import ShardError, assign, attention_work, parse_shard, shard_cases


def conformance(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_parse_shard_takes_i_of_n_and_refuses_the_rest():
    assert str(parse_shard("2/4")) == "2/4"
    for text in ("0/2", "3/2", "1/0", "x", "1-2", "/2", "-1/2"):
        with pytest.raises(ShardError):
            parse_shard(text)


def test_the_cut_is_deterministic_complete_and_longest_first_balanced():
    cases = suite("standard")
    for count in (2, 3, 7):
        parts = assign(cases, count)
        assert parts == assign(list(cases), count)  # every job computes the same cut
        assert sorted(set(parts)) == list(range(1, count + 1))
        loads = [
            sum(attention_work(case) for case, part in zip(cases, parts) if part == p) for p in range(1, count + 1)
        ]
        # Longest first to the least loaded: no part exceeds another by more than its largest case.
        assert max(loads) - min(loads) <= max(attention_work(case) for case in cases)
        together = sorted(
            case.id for p in range(1, count + 1) for case in shard_cases(cases, parse_shard(f"{p}/{count}"))
        )
        assert together == sorted(case.id for case in cases)


def test_an_earlier_runs_seconds_balance_the_cut():
    cases = [parse_case(f"gqa:{10 * n}+1") for n in range(1, 7)]
    slow = cases[0].id  # the smallest batch, but the slowest case of the earlier run
    earlier = {case.id: 1.0 for case in cases} | {slow: 100.0}
    parts = assign(cases, 2, earlier)
    assert sorted(set(assign(cases, 3, dict.fromkeys(earlier, 0.0)))) == [1, 2, 3]  # 0 s each: no part empty
    alone = parts[0]
    assert parts.count(alone) == 1  # it fills its part by itself
    static = assign(cases, 2)
    assert static.count(static[0]) > 1  # by attention work the smallest batch shares its part


def _run(
    case_ids, verdicts, index=None, count=2, suite_name="custom", whole=None, assigned=None, times="attention work"
):
    """A results file of one backend and one check over these cases (a part where ``index``; its
    cut: ``assigned``, by default the cases it holds)."""
    cases = [CaseResult(case_id, verdict, "r") for case_id, verdict in zip(case_ids, verdicts)]
    check = CheckResult("numerics", Verdict.PASS, "", cases)
    cut = list(case_ids) if assigned is None else assigned
    shard = None if index is None else {"index": index, "count": count, "cases": whole, "times": times, "assigned": cut}
    return RunResult(
        {"host": "h"}, [BackendResult("torch_naive", True, checks=[check])], suite_name, ["numerics"], shard=shard
    )


WHOLE = ["a", "b", "c", "d"]


def test_merge_puts_cases_back_in_the_runs_order_and_summarizes_again():
    parts = [
        ("p2", _run(["b", "d"], [Verdict.FAIL, Verdict.PASS], 2, whole=WHOLE)),
        ("p1", _run(["a", "c"], [Verdict.PASS, Verdict.SKIP], 1, whole=WHOLE)),
    ]
    merged = merge_parts(parts)
    check = merged.backends[0].check("numerics")
    assert [case.case for case in check.cases] == WHOLE
    assert check.verdict == Verdict.FAIL and check.summary == "2 PASS, 1 FAIL, 1 SKIP"
    assert merged.shard is None and [s["part"] for s in merged.environment["shards"]] == ["1/2", "2/2"]


def test_a_part_that_could_not_run_a_check_is_named_beside_the_others_cases():
    ran = _run(["a", "b"], [Verdict.PASS, Verdict.PASS], 1, whole=WHOLE)
    failed = _run([], [], 2, whole=WHOLE, assigned=["c", "d"])
    failed.backends[0].checks[0] = CheckResult("numerics", Verdict.ERROR, "cannot load backend: boom")
    check = merge_parts([("p1", ran), ("p2", failed)]).backends[0].check("numerics")
    assert check.verdict == Verdict.ERROR and "1 part(s) did not run it: cannot load backend: boom" in check.summary
    assert [case.case for case in check.cases] == ["a", "b"]


@pytest.mark.parametrize(
    "parts,says",
    [
        ([("p1", _run(["a"], [Verdict.PASS], 1, whole=WHOLE))], "at least two parts"),
        (
            [("w", _run(WHOLE, [Verdict.PASS] * 4)), ("p1", _run(["a"], [Verdict.PASS], 1, whole=WHOLE))],
            "w: not a part",
        ),
        (
            [("p1", _run(["a"], [Verdict.PASS], 1, whole=WHOLE)), ("q1", _run(["b"], [Verdict.PASS], 1, whole=WHOLE))],
            "p1 and q1 are both part 1/2",
        ),
        (
            [
                ("p1", _run(["a"], [Verdict.PASS], 1, 3, whole=WHOLE)),
                ("p2", _run(["b"], [Verdict.PASS], 2, 3, whole=WHOLE)),
            ],
            "part 3/3 missing",
        ),
        (
            [
                ("p1", _run(["a"], [Verdict.PASS], 1, whole=WHOLE)),
                ("p2", _run(["b"], [Verdict.PASS], 2, suite_name="smoke", whole=WHOLE)),
            ],
            "their suites differ (custom and smoke)",
        ),
        (
            [
                ("p1", _run(["a"], [Verdict.PASS], 1, whole=WHOLE)),
                ("p2", _run(["b"], [Verdict.PASS], 2, whole=["a", "b"])),
            ],
            "their cases differ",
        ),
        (
            [
                ("p1", _run(["a", "b"], [Verdict.PASS] * 2, 1, whole=WHOLE)),
                ("p2", _run(["b"], [Verdict.PASS], 2, whole=WHOLE)),
            ],
            "p1 and p2 both ran case b: the parts were cut differently",
        ),
        (
            [
                ("p1", _run(["a"], [Verdict.PASS], 1, whole=WHOLE)),
                ("p2", _run(["b"], [Verdict.PASS], 2, whole=WHOLE)),
            ],
            "no part ran case c (2 case(s) left out)",
        ),
        (
            [
                ("p1", _run(["a", "b"], [Verdict.PASS] * 2, 1, whole=WHOLE)),
                ("p2", _run(["c", "d"], [Verdict.PASS] * 2, 2, whole=WHOLE, times="case seconds of main.json")),
            ],
            "their cuts differ (attention work and case seconds of main.json)",
        ),
    ],
)
def test_what_is_not_one_sharded_run_is_refused(parts, says):
    with pytest.raises(MergeError) as error:
        merge_parts(parts)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_parts_run_at_other_commits_are_refused():
    first, second = (
        _run(["a", "b"], [Verdict.PASS] * 2, 1, whole=WHOLE),
        _run(["c", "d"], [Verdict.PASS] * 2, 2, whole=WHOLE),
    )
    first.environment["git_sha"], second.environment["git_sha"] = "abc1234", "def5678"
    with pytest.raises(MergeError, match=r"their trees differ \(abc1234 and def5678\)"):
        merge_parts([("p1", first), ("p2", second)])


def test_a_backend_that_ran_in_one_part_and_not_in_another_is_refused():
    ran = _run(["a", "b"], [Verdict.PASS] * 2, 1, whole=WHOLE)
    down = _run([], [], 2, whole=WHOLE, assigned=["c", "d"])
    down.backends[0] = BackendResult(
        "torch_naive", False, "needs SM100", checks=[CheckResult("numerics", Verdict.SKIP, "x")]
    )
    with pytest.raises(MergeError, match="could run in some parts and not in others \\(needs SM100\\)"):
        merge_parts([("p1", ran), ("p2", down)])


@pytest.mark.slow
def test_two_parts_merged_are_the_whole_run(tmp_path):
    """The CLI end to end on the smoke suite: each part plans the whole run (the engine check runs
    one case a layout, the same in every part), the merge equals one run (compare exit 0 both
    ways, the same verdicts, summaries and case reasons), a part over two slots equals the part,
    and merge's usage errors exit 2."""
    run = ["run", "--suite", "smoke", "--check", "numerics,engine", "--quiet"]
    for part in ("1/2", "2/2"):
        completed = conformance(*run, "--shard", part, "--json", f"p{part[0]}.json", cwd=tmp_path)
        assert completed.returncode == 0, completed.stderr
    assert conformance(*run, "--json", "whole.json", cwd=tmp_path).returncode == 0
    merged = conformance("merge", "p2.json", "p1.json", "-o", "all.json", cwd=tmp_path)
    assert merged.returncode == 0 and "(2 parts)" in merged.stdout, merged.stderr
    for base, new in (("whole.json", "all.json"), ("all.json", "whole.json")):
        assert conformance("compare", base, new, cwd=tmp_path).returncode == 0

    def rows(name):
        data = json.loads((tmp_path / name).read_text())
        return [
            (
                check["name"],
                check["verdict"],
                check["summary"],
                [(c["case"], c["verdict"], c["reason"]) for c in check["cases"]],
            )
            for backend in data["backends"]
            for check in backend["checks"]
        ]

    assert rows("all.json") == rows("whole.json")
    # A part over a pool of two slots is the same part.
    assert conformance(*run, "--shard", "1/2", "--workers", "2", "--json", "p1w.json", cwd=tmp_path).returncode == 0
    assert rows("p1w.json") == rows("p1.json")
    parts = [RunResult.load(tmp_path / f"p{index}.json") for index in (1, 2)]
    assert all(len(part.backends[0].check("numerics").cases) < 9 for part in parts)
    refused = conformance("merge", "p1.json", "whole.json", "-o", "x.json", cwd=tmp_path)
    assert refused.returncode == 2 and "whole.json: not a part of a sharded run" in refused.stderr
