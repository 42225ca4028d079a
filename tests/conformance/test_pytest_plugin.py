"""`pytest --conformance-backend X` turns the suite into test items in the author's own run."""

import importlib.metadata

import pytest


def plugin_args() -> list[str]:
    installed = any(ep.value == "conformance.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "conformance.pytest_plugin"]


@pytest.mark.parametrize("backend,failed,passed", [("tests.planted.defects:WrongScale", 9, 0), ("torch_naive", 0, 9)])
def test_suite_items_pass_and_fail_with_evidence(pytester, backend, failed, passed):
    pytester.makepyfile("def test_own():\n    pass\n")
    result = pytester.runpytest(
        *plugin_args(),
        "--conformance-backend",
        backend,
        "--conformance-suite",
        "smoke",
        "--conformance-check",
        "numerics",
        "--conformance-device",
        "cpu",
    )
    result.assert_outcomes(failed=failed, passed=passed + 1)
    if failed:
        result.stdout.fnmatch_lines(["*FAIL: * elements beyond tolerance*"])


def test_bad_backend_is_a_usage_error(pytester):
    pytester.makepyfile("def test_own():\n    pass\n")
    result = pytester.runpytest(*plugin_args(), "--conformance-backend", "no_such")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown backend 'no_such'*"])


def run_plugin(pytester, *args):
    pytester.makepyfile("def test_own():\n    pass\n")
    return pytester.runpytest(*plugin_args(), "--conformance-suite", "smoke", *args)


def test_an_unusable_device_or_backend_fails_unless_skips_are_allowed(pytester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    # Absent CUDA: one failing item per check (not a green run of skips).
    result = run_plugin(
        pytester,
        "--conformance-backend",
        "torch_naive",
        "--conformance-check",
        "numerics,syncs",
        "--conformance-device",
        "cuda",
    )
    result.assert_outcomes(failed=2, passed=1)
    result.stdout.fnmatch_lines(["*no CUDA device is visible*--conformance-allow-skip*"])
    result = run_plugin(
        pytester,
        "--conformance-backend",
        "torch_naive",
        "--conformance-check",
        "numerics,syncs",
        "--conformance-device",
        "cuda",
        "--conformance-allow-skip",
    )
    result.assert_outcomes(skipped=2, passed=1)
    # A backend that cannot run on this device (it needs Blackwell): the same.
    result = run_plugin(
        pytester,
        "--conformance-backend",
        "tests.planted.defects:NeedsBlackwell",
        "--conformance-check",
        "numerics",
        "--conformance-device",
        "cpu",
    )
    result.assert_outcomes(failed=1, passed=1)


def test_a_device_that_is_not_one_is_a_usage_error(pytester):
    result = run_plugin(pytester, "--conformance-backend", "torch_naive", "--conformance-device", "tpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--conformance-device 'tpu' is not a device*"])


def test_a_case_named_twice_is_a_usage_error(pytester):
    case = "gqa-h2/1-d16-fp32:5+1"
    result = run_plugin(
        pytester, "--conformance-backend", "torch_naive", "--conformance-case", case, "--conformance-case", case
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--conformance-case names 'gqa-h2/1-d16-fp32-p16:5+1@0' more than once*"])


def test_checks_that_skip_as_a_whole_are_one_item_and_all_skipped_fails(pytester):
    # torch_naive claims no CUDA graphs: graphs and draft-loop are one skipped item each. The
    # default checks are the CLI's (engine and determinism included).
    result = run_plugin(
        pytester, "--conformance-backend", "torch_naive", "--conformance-device", "cpu", "--collect-only", "-q"
    )
    lines = result.stdout.str()
    assert "conformance[graphs]" in lines and "conformance[draft-loop]" in lines
    assert "conformance[engine-" in lines and "conformance[determinism-" in lines
    # Nothing but skips is not green.
    result = run_plugin(
        pytester, "--conformance-backend", "torch_naive", "--conformance-check", "graphs", "--conformance-device", "cpu"
    )
    result.assert_outcomes(skipped=1, passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*every conformance item was skipped*"])
    result = run_plugin(
        pytester,
        "--conformance-backend",
        "torch_naive",
        "--conformance-check",
        "graphs",
        "--conformance-device",
        "cpu",
        "--conformance-allow-skip",
    )
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.slow
def test_the_engine_check_runs_once_per_layout_under_the_plugin(pytester):
    # One check instance per check, as in a run: its once-per-layout skip holds across items.
    result = run_plugin(
        pytester,
        "--conformance-backend",
        "torch_naive",
        "--conformance-check",
        "engine",
        "--conformance-device",
        "cpu",
        "-rs",
    )
    # On a CPU one per attention kind (GQA, MLA) and windowed GQA (its model alternates windowed
    # and full layers), plus the author's own test.
    result.assert_outcomes(passed=3 + 1, skipped=6)
    result.stdout.fnmatch_lines(["*layout covered by*"])


@pytest.mark.slow
def test_a_backend_that_exits_mid_case_fails_that_item_and_the_session_goes_on(pytester, monkeypatch, tmp_path):
    """In a subprocess: were the exit not caught, it would end the test process itself with status 0.
    Two such backends in one session: the one that exits first, the other after it."""
    import os
    import xml.etree.ElementTree as ElementTree
    from pathlib import Path

    backends = {
        "tests.planted.gate.backends:ExitsQuietly": "*CRASH: the backend called os._exit(0) during the case*",
        "tests.planted.gate.backends:RaisesSystemExit": "*CRASH: the backend raised SystemExit(None) during the case*",
    }
    pytester.makepyfile("def test_own():\n    pass\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
    )
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest_subprocess(
        *plugin_args(),
        "--conformance-backend",
        ",".join(backends),
        "--conformance-suite",
        "smoke",
        "--conformance-check",
        "numerics",
        "--conformance-device",
        "cpu",
        f"--junitxml={junit}",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] >= 2 and outcomes["passed"] >= 3  # own test and each backend's small cases
    cases = list(ElementTree.parse(junit).iter("testcase"))  # the file: the session went on to its end
    for backend, line in backends.items():
        result.stdout.fnmatch_lines([line])
        mine = [case for case in cases if backend in case.get("classname", "") + case.get("name", "")]
        failed = [case for case in mine if case.find("failure") is not None or case.find("error") is not None]
        assert failed and len(failed) < len(mine), (backend, len(failed), len(mine))  # one failed, others passed


def test_a_failing_item_prints_the_command_that_reruns_it_alone_and_that_command_works(pytester):
    result = run_plugin(
        pytester,
        "--conformance-backend",
        "tests.planted.defects:WrongScale",
        "--conformance-check",
        "numerics",
        "--conformance-device",
        "cpu",
    )
    rerun = next(line for line in result.stdout.lines if line.startswith("rerun: python -m pytest "))
    case = rerun.split("--conformance-case=")[1].strip("'")
    again = run_plugin(
        pytester,
        "--conformance-backend",
        "tests.planted.defects:WrongScale",
        "--conformance-check",
        "numerics",
        "--conformance-device",
        "cpu",
        f"--conformance-case={case}",
    )
    again.assert_outcomes(failed=1, passed=1)  # that case alone, and the file's own test
