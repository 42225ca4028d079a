"""A new check is one file and one registry line: it then shows up in the CLI's defaults, the
terminal, HTML, Markdown and JUnit reports and the pytest plugin, with its evidence described
by the check itself."""

import xml.etree.ElementTree as ElementTree

import pytest
import torch
from rich.console import Console

from conformance.cases.suites import suite
from conformance.checks import CHECKS, default_checks
from conformance.report import html as report_html
from conformance.report import junit as report_junit
from conformance.report import markdown as report_markdown
from conformance.report.terminal import print_report
from conformance.run.runner import RunOptions, run
from tests.planted.extra_check import LongestQueryCheck

EVIDENCE = "longest query: 4 tokens in request 0"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(CHECKS, LongestQueryCheck.name, LongestQueryCheck)  # the one line


def test_a_registered_check_runs_by_default_and_every_report_shows_it(registered):
    assert LongestQueryCheck.name in default_checks()
    cases = suite("smoke")[:2]  # a decode batch (PASS) and a spec-verify one, q = 4 (FAIL)
    result = run(RunOptions(["torch_naive"], [LongestQueryCheck.name], cases, torch.device("cpu"), in_process=True))
    check = result.backends[0].check(LongestQueryCheck.name)
    assert check is not None and check.ran == len(cases)
    assert [case.verdict.value for case in check.cases] == ["PASS", "FAIL"]

    console = Console(record=True, width=200)
    print_report(console, result)
    terminal = console.export_text()
    html = report_html.render(result)
    markdown = report_markdown.render(result)
    junit = report_junit.render(result)
    for text in (terminal, html, markdown, junit):
        assert LongestQueryCheck.name in text
    assert EVIDENCE in terminal and EVIDENCE in junit
    assert "longest query: `4 tokens in request 0`" in markdown
    assert "longest query:" in html and "4 tokens in request 0" in html
    suites = [s.get("name") for s in ElementTree.fromstring(junit.split("?>", 1)[1]).iter("testsuite")]
    assert suites == [f"torch_naive/{LongestQueryCheck.name}"]


def test_the_pytest_plugin_collects_a_registered_check(registered, pytester):
    pytester.makepyfile("")
    outcome = pytester.runpytest_inprocess(
        "--conformance-backend",
        "torch_naive",
        "--conformance-device",
        "cpu",
        "--conformance-check",
        LongestQueryCheck.name,
        "-q",
    )
    text = outcome.stdout.str()
    assert f"conformance[{LongestQueryCheck.name}-" in text
    assert EVIDENCE in text
    counts = outcome.parseoutcomes()
    assert counts["failed"] >= 1 and counts["passed"] >= 1  # smoke has decode and spec-verify batches
