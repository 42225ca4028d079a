"""Repeated bench runs folded into one published result (``conformance.report.bench_runs``)."""

import json
import subprocess
import sys

import pytest

from conformance.report.bench_runs import BenchRunsError, fold_bench_runs
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict

CASE = "gqa:4096+1x64@0"


def run_of(*backends: tuple[str, float, float, Verdict]) -> RunResult:
    """One bench run: (name, forward µs, in-run ratio, verdict) per backend; the GB/s figure marks
    which run a published case's metrics came from."""
    results = []
    for name, forward_us, ratio, verdict in backends:
        metrics = {"forward_us": forward_us, "GBps": 1e6 / forward_us, "ratio_to_fastest": ratio, "build_us": 1.0}
        metrics |= {"roofline_fraction": 0.5, "copy_GBps": 4000.0, "bf16_TFLOPs": 700.0}
        reason = f"{verdict.value} at {forward_us}"
        case = CaseResult(CASE, verdict, reason=reason, tag="decode b64 ctx4096", metrics=metrics)
        check = CheckResult("bench", verdict, "1 PASS", [case])
        results.append(BackendResult(name, True, checks=[check], wall_s=forward_us / 10))
    return RunResult({"gpu": "NVIDIA H100"}, results, "bench", ["bench"])


def published_case(result: RunResult, name: str) -> CaseResult:
    backend = next(b for b in result.backends if b.name == name)
    return backend.check("bench").cases[0]


def test_the_median_run_is_published_with_every_run_and_the_median_in_run_ratio():
    # Ratios taken within each run: ours 1.5, 1.1, 1.3 (median 1.3). The ratio of the medians
    # (120 / 100 = 1.2) would mix runs, and is not what is published.
    runs = [
        run_of(("ours", 150.0, 1.5, Verdict.PASS), ("vendor", 100.0, 1.0, Verdict.PASS)),
        run_of(("ours", 110.0, 1.1, Verdict.PASS), ("vendor", 100.0, 1.0, Verdict.PASS)),
        run_of(("ours", 120.0, 1.3, Verdict.PASS), ("vendor", 92.0, 1.0, Verdict.PASS)),
    ]
    folded, repeats = fold_bench_runs(runs)
    assert repeats == 3
    ours = published_case(folded, "ours")
    assert ours.metrics["forward_us"] == 120.0
    assert ours.metrics["GBps"] == pytest.approx(1e6 / 120.0)  # the same run's figures together
    assert ours.metrics["forward_us_runs"] == [150.0, 110.0, 120.0]
    assert ours.metrics["ratio_to_fastest"] == 1.3
    assert ours.metrics["ratio_to_fastest_runs"] == [1.5, 1.1, 1.3]
    assert published_case(folded, "vendor").metrics["forward_us"] == 100.0
    assert folded.backends[0].check("bench").details["runs"] == 3
    assert "median of 3 runs" in folded.backends[0].check("bench").summary


def test_an_even_number_of_runs_publishes_the_lower_middle_run():
    runs = [run_of(("ours", t, 1.0, Verdict.PASS)) for t in (130.0, 100.0, 120.0, 110.0)]
    assert published_case(fold_bench_runs(runs)[0], "ours").metrics["forward_us"] == 110.0


def test_a_failure_in_one_run_is_not_hidden_by_the_others():
    runs = [
        run_of(("ours", 100.0, 1.0, Verdict.PASS)),
        run_of(("ours", 101.0, 1.0, Verdict.ERROR)),
        run_of(("ours", 102.0, 1.0, Verdict.PASS)),
    ]
    folded, _ = fold_bench_runs(runs)
    case = published_case(folded, "ours")
    assert case.verdict == Verdict.ERROR and case.reason == "ERROR at 101.0"
    assert folded.backends[0].check("bench").verdict == Verdict.ERROR


def test_backends_in_files_of_their_own_are_one_table_and_each_file_is_one_run():
    # flash_attn benched in a process of its own, once per run: two files per run.
    runs = [
        run_of(("ours", 100.0, 1.0, Verdict.PASS)),
        run_of(("fa", 90.0, 1.0, Verdict.PASS)),
        run_of(("ours", 104.0, 1.0, Verdict.PASS)),
        run_of(("fa", 80.0, 1.0, Verdict.PASS)),
    ]
    folded, repeats = fold_bench_runs(runs)
    assert [b.name for b in folded.backends] == ["ours", "fa"] and repeats == 2
    assert published_case(folded, "fa").metrics["forward_us_runs"] == [90.0, 80.0]


def test_a_backend_unavailable_in_every_run_is_published_as_unavailable():
    missing = RunResult({}, [BackendResult("fa", False, "no flash_attn.cute")], "bench", ["bench"])
    folded, _ = fold_bench_runs([run_of(("ours", 100.0, 1.0, Verdict.PASS)), missing])
    assert [(b.name, b.available, b.reason) for b in folded.backends][1] == ("fa", False, "no flash_attn.cute")


def test_a_run_of_another_suite_is_refused():
    standard = RunResult({}, [], "standard", ["numerics"])
    with pytest.raises(BenchRunsError, match="'standard' run among the bench files"):
        fold_bench_runs([run_of(("ours", 100.0, 1.0, Verdict.PASS)), standard])


@pytest.mark.slow
def test_publish_says_how_many_runs_its_bench_numbers_are_the_median_of(tmp_path):
    for index, forward_us in enumerate((150.0, 100.0, 120.0)):
        run_of(("ours", forward_us, 1.0, Verdict.PASS)).save(tmp_path / f"bench-{index}.json")
    run = RunResult({"gpu": "NVIDIA H100"}, [BackendResult("ours", True)], "standard", ["numerics"])
    run.save(tmp_path / "all.json")
    command = [sys.executable, "-m", "conformance.report.publish", str(tmp_path / "all.json"), "--bench"]
    command += [str(tmp_path / f"bench-{index}.json") for index in range(3)]
    completed = subprocess.run(command + ["--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "the median of 3 `conformance bench` runs" in readme
    assert "GQA decode b64 ctx4096 | 120 µs" in readme, readme
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert bench["backends"][0]["checks"][0]["cases"][0]["metrics"]["forward_us_runs"] == [150.0, 100.0, 120.0]
    # A standard run passed as a bench file: one line, exit 2.
    completed = subprocess.run(
        [*command[:-1], str(tmp_path / "all.json"), "--out", str(tmp_path / "out")], capture_output=True, text=True
    )
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr


def test_a_case_that_never_ran_to_a_time_is_published_as_its_worst_run():
    runs = []
    for verdict in (Verdict.SKIP, Verdict.CRASH, Verdict.SKIP):
        case = CaseResult(CASE, verdict, reason=f"{verdict.value} here", tag="decode b64 ctx4096")
        backend = BackendResult("ours", True, checks=[CheckResult("bench", verdict, "", [case])])
        runs.append(RunResult({}, [backend], "bench", ["bench"]))
    case = published_case(fold_bench_runs(runs)[0], "ours")
    assert (case.verdict, case.reason) == (Verdict.CRASH, "CRASH here")
