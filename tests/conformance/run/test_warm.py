"""``conformance run --warm``: each kernel layout's case once, before the checks
(``conformance.run.warm``); its results thrown away, its time reported apart."""

import pytest
import torch

from conformance.cases.grammar import parse_case
from conformance.cases.suites import suite
from conformance.results import RunResult
from conformance.run.runner import RunOptions
from conformance.run.shard import attention_work
from conformance.run.warm import layout_of, warm_cases, warm_parts
from tests.conformance.run.test_pool import CRASHES, verdicts
from tests.conformance.test_cli import conformance


def test_each_layout_is_warmed_once_by_its_lightest_case_of_the_first_check_that_runs_it():
    cases = [
        parse_case(text)
        for text in (
            "gqa-h4/2-d64-bf16-p16:900+1,40+1",
            "gqa-h4/2-d64-bf16-p16:10+1",  # the same layout, lighter
            "gqa-h4/2-d64-bf16-p16-attnsinks:5+1",  # another layout (sinks)
            "mla-h4-d64+16-bf16-p16:30+4",  # another layout, run by the second check only
        )
    ]
    options = RunOptions(backends=["x"], checks=["numerics", "graphs"], cases=cases, device=torch.device("cpu"))
    runs_all = {case.id: None for case in cases}
    plan = {
        "event": "plan",
        "checks": {"numerics": None, "graphs": None, "engine": "no engine here"},
        "cases": {"numerics": {**runs_all, cases[3].id: "not MLA"}, "graphs": runs_all},
    }
    warmed = warm_cases(options, plan)
    assert {check: sorted(case.id for case in found) for check, found in warmed.items()} == {
        "numerics": sorted([cases[1].id, cases[2].id]),
        "graphs": [cases[3].id],
    }
    assert len({layout_of(case) for found in warmed.values() for case in found}) == 3
    assert attention_work(cases[1]) < attention_work(cases[0])
    # Over slots: different layouts in different processes, each check's own.
    assert sorted(warm_parts(options, plan, 4)) == sorted(
        [("graphs", [cases[3].id]), ("numerics", [cases[1].id]), ("numerics", [cases[2].id])]
    )
    one_slot = {check: sorted(ids) for check, ids in warm_parts(options, plan, 1)}
    assert one_slot == {"graphs": [cases[3].id], "numerics": sorted([cases[1].id, cases[2].id])}


def test_warming_a_suite_takes_one_case_a_layout():
    cases = suite("standard")
    options = RunOptions(backends=["x"], checks=["numerics"], cases=cases, device=torch.device("cpu"))
    plan = {"event": "plan", "checks": {"numerics": None}, "cases": {"numerics": {case.id: None for case in cases}}}
    warmed = warm_cases(options, plan)["numerics"]
    assert len(warmed) == len({layout_of(case) for case in cases}) < len(cases)


@pytest.mark.slow
def test_a_warm_run_gives_the_serial_runs_verdicts_and_says_how_long_it_warmed(tmp_path):
    # torch_naive, and a backend that crashes on every batch of more than three requests: its warm
    # case may crash too; that is thrown away, and its checks report each crash once. (One check:
    # its two crashes stay within the crash budget, so no case's verdict depends on the order.)
    common = ["run", "--backend", f"torch_naive,{CRASHES}", "--check", "numerics", "--suite", "smoke"]
    common += ["--device", "cpu", "--quiet"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    warm = conformance(*common, "--workers", "2", "--warm", "--json", str(tmp_path / "warm.json"))
    assert serial.returncode == warm.returncode == 1, warm.stderr
    serial_result, warm_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "warm.json")
    assert verdicts(warm_result) == verdicts(serial_result)
    assert warm_result.environment["warm_s"] > 0
    assert all(backend.warm_s > 0 for backend in warm_result.backends)
    assert "warm_s" not in serial_result.environment and all(b.warm_s == 0 for b in serial_result.backends)


def test_warm_is_for_the_isolated_children():
    completed = conformance("run", "--backend", "torch_naive", "--device", "cpu", "--warm", "--in-process")
    assert completed.returncode == 2
    (line,) = completed.stderr.strip().splitlines()
    assert line.endswith(
        "--warm warms the isolated children before the checks: it cannot be combined with --in-process"
    )


@pytest.mark.slow
def test_a_warm_case_that_hangs_ends_that_backends_warming_and_the_checks_still_judge_it(tmp_path):
    # Hangs never returns: one hang a warm process, then no more of its warm units; its checks then
    # meet the hang and report it as a serial run does.
    common = ["run", "--backend", "tests.planted.defects:Hangs,torch_naive", "--check", "numerics"]
    common += ["--suite", "smoke", "--device", "cpu", "--quiet", "--timeout", "5"]
    serial = conformance(*common, "--json", str(tmp_path / "serial.json"))
    warm = conformance(*common, "--workers", "2", "--warm", "--json", str(tmp_path / "warm.json"))
    assert serial.returncode == warm.returncode == 1, warm.stderr
    serial_result, warm_result = RunResult.load(tmp_path / "serial.json"), RunResult.load(tmp_path / "warm.json")
    hangs, naive = warm_result.backends
    # Hangs: CRASH as in the serial run (two slots may each be hanging when the budget runs out).
    assert hangs.check("numerics").verdict.value == serial_result.backends[0].check("numerics").verdict.value
    assert verdicts(RunResult({}, [naive])) == verdicts(RunResult({}, [serial_result.backends[1]]))
    assert hangs.warm_s < 2 * (5 + 10)  # at most one hang a slot, then no more of its warm units
    assert naive.check("numerics").verdict.value == "PASS"


@pytest.mark.slow
def test_a_failure_on_the_warm_cold_run_is_the_cases_verdict(tmp_path, monkeypatch):
    # Wrong on the machine's first run only: the warm phase takes that run, so its checks would all
    # PASS; the warm run's FAIL is that case's verdict, saying so, and the run exits 1.
    monkeypatch.setenv("COLD_RUN_DIR", str(tmp_path))
    planted = "tests.planted.gate.backends:WrongOnTheColdRun"
    completed = conformance(
        "run", "--backend", planted, "--check", "numerics", "--suite", "smoke", "--device", "cpu", "--quiet",
        "--workers", "2", "--warm", "--json", str(tmp_path / "warm.json"),
    )  # fmt: skip
    assert completed.returncode == 1, completed.stderr
    cases = RunResult.load(tmp_path / "warm.json").backends[0].check("numerics").cases
    failed = [case for case in cases if case.verdict.value != "PASS"]
    assert len(failed) == 1 and failed[0].verdict.value == "FAIL", [(c.verdict.value, c.reason) for c in cases]
    assert failed[0].reason.startswith("on the case's first, cold run (--warm): ")
    assert failed[0].reason.endswith("; run again by the check: PASS")
