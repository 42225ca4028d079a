"""`pytest --conformance-backend X` turns the suite into test items in the author's own run."""
import importlib.metadata

import pytest


def plugin_args() -> list[str]:
    installed = any(ep.value == "conformance.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "conformance.pytest_plugin"]


@pytest.mark.parametrize("backend,failed,passed", [("tests.planted.defects:WrongScale", 9, 0), ("torch_naive", 0, 9)])
def test_suite_items_pass_and_fail_with_evidence(pytester, backend, failed, passed):
    pytester.makepyfile("def test_own():\n    pass\n")
    result = pytester.runpytest(*plugin_args(), "--conformance-backend", backend, "--conformance-suite", "smoke",
                                "--conformance-check", "numerics", "--conformance-device", "cpu")
    result.assert_outcomes(failed=failed, passed=passed + 1)
    if failed:
        result.stdout.fnmatch_lines(["*FAIL: * elements beyond tolerance*"])


def test_bad_backend_is_a_usage_error(pytester):
    pytester.makepyfile("def test_own():\n    pass\n")
    result = pytester.runpytest(*plugin_args(), "--conformance-backend", "no_such")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown backend 'no_such'*"])
