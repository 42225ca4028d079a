"""HTML, JUnit and Markdown writers, compare, and the HTML report in a real browser."""

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
from rich.console import Console

from conformance.report import html as report_html
from conformance.report import junit as report_junit
from conformance.report import markdown as report_markdown
from conformance.report.compare import CompareError, compare_runs
from conformance.report.terminal import print_report
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.run.execution import judge

SYNC_EVENT = {
    "kind": "sync",
    "api": "cudaStreamSynchronize",
    "blocking": True,
    "num_bytes": None,
    "direction": None,
    "nested": [],
    "phase": "build",
    "source": "mypkg/attn.py:42 in build: lens = seq_lens.cpu()",
    "stack": ["harness.py:10 in run_step", "mypkg/attn.py:42 in build"],
}


def crafted() -> RunResult:
    numerics = CheckResult(
        "numerics",
        Verdict.FAIL,
        "1 PASS, 1 FAIL",
        [
            CaseResult("gqa:1+1@0", Verdict.PASS, metrics={"max_abs_error": 1e-3}),
            CaseResult(
                "gqa:9+4@0",
                Verdict.FAIL,
                "12 of 64 elements beyond tolerance",
                tag="spec-verify",
                metrics={"max_abs_error": 0.4},
                evidence={"worst": {"request": 0, "token": 2, "head": 1}},
            ),
        ],
    )
    syncs = CheckResult(
        "syncs",
        Verdict.FAIL,
        "1 FAIL",
        [
            CaseResult(
                "gqa:9+1@0",
                Verdict.FAIL,
                "1 host sync(s) although host lengths were given",
                evidence={"with_host_lengths": [SYNC_EVENT]},
            ),
        ],
    )
    graphs = CheckResult(
        "graphs",
        Verdict.CRASH,
        "1 CRASH",
        [
            CaseResult(
                "gqa:5+1@0",
                Verdict.CRASH,
                "backend process killed by signal SIGSEGV while running this case",
                evidence={"stderr_tail": "Fatal Python error: Segmentation fault", "failing_batch": "gqa:80+1@1"},
            ),
        ],
    )
    draft = CheckResult(
        "draft-loop",
        Verdict.ERROR,
        "1 ERROR",
        [
            CaseResult(
                "gqa:5+1@0", Verdict.ERROR, "ValueError: no", evidence={"traceback": "Traceback ...\nValueError: no"}
            ),
        ],
    )
    bench = CheckResult(
        "bench",
        Verdict.PASS,
        "1 PASS",
        [
            CaseResult(
                "gqa:4096+1x64@0",
                Verdict.PASS,
                tag="decode b64 ctx4096",
                metrics={
                    "forward_us": 300.0,
                    "build_us": 1.0,
                    "replay_us": 290.0,
                    "GBps": 3500.0,
                    "roofline_fraction": 0.83,
                    "ratio_to_fastest": 1.0,
                },
            ),
        ],
    )
    mine = BackendResult("mine", True, checks=[numerics, syncs, graphs, draft, bench])
    other = BackendResult(
        "vendor",
        False,
        "needs compute capability SM100; this GPU (NVIDIA H200) is SM90",
        checks=[
            CheckResult(c, Verdict.SKIP, "backend unavailable")
            for c in ("numerics", "syncs", "graphs", "draft-loop", "bench")
        ],
    )
    return RunResult(
        {"gpu": "NVIDIA H200", "command": "conformance run", "time": "now"},
        [mine, other],
        "standard",
        ["numerics", "syncs", "graphs", "draft-loop", "bench"],
    )


def test_html_has_every_backend_and_check_and_the_evidence():
    html = report_html.render(crafted())
    summary = html.split("<table id='summary'>")[1].split("</table>")[0]
    for name in ("mine", "vendor", "numerics", "syncs", "graphs", "draft-loop", "bench"):
        assert name in summary
    assert "request 0, token 2, head 1" in html  # worst location
    assert "mypkg/attn.py:42 in build" in html  # sync source line and stack
    assert "gqa:80+1@1" in html  # the graph batch that broke a replay
    assert "Segmentation fault" in html and "ValueError: no" in html  # crash stderr, traceback
    assert "<svg" in html and "µs" in html  # bench chart
    assert "NVIDIA H200" in html  # environment


def test_every_report_shows_the_evidence_each_check_describes():
    run = crafted()
    console = Console(record=True, width=200)
    print_report(console, run)
    texts = {
        "terminal": console.export_text(),
        "junit": report_junit.render(run),
        "markdown": report_markdown.render(run),
    }
    for name, text in texts.items():
        assert "request 0, token 2, head 1" in text, name  # numerics: the worst element
        assert "mypkg/attn.py:42 in build" in text, name  # syncs: the line to change
        assert "gqa:80+1@1" in text, name  # graphs: the replay batch that broke
    assert "Segmentation fault" in texts["terminal"] and "ValueError: no" in texts["junit"]


def test_evidence_of_a_check_this_version_does_not_know_is_shown_as_it_is():
    """A results file from another version may name a check missing here: its evidence keys are
    shown as they are (the base description), never dropped."""
    case = CaseResult(
        "gqa:9+1@0", Verdict.FAIL, "wrong", evidence={"stale_rows": [3, 7], "trace": "line one\nline two"}
    )
    run = RunResult(
        {},
        [BackendResult("mine", True, checks=[CheckResult("retired-check", Verdict.FAIL, "1 FAIL", [case])])],
        "standard",
        ["retired-check"],
    )
    console = Console(record=True, width=200)
    print_report(console, run)
    for text in (console.export_text(), report_junit.render(run), report_html.render(run)):
        assert "stale rows" in text and "line two" in text
    assert "stale rows: `[3, 7]`" in report_markdown.render(run)


def test_html_is_self_contained():
    html = report_html.render(crafted())
    assert not re.search(r"(src|href)\s*=\s*['\"]?(https?:)?//", html)
    assert "<script" not in html and "<link" not in html and "@import" not in html


def test_junit_structure():
    root = ElementTree.fromstring(report_junit.render(crafted()).encode())
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 10  # 2 backends x 5 checks
    cases = root.findall("testsuite/testcase")
    assert len(cases) == int(root.get("tests")) == 6 + 5
    for suite in suites:
        assert int(suite.get("tests")) == len(suite.findall("testcase"))
        for testcase in suite.findall("testcase"):
            assert testcase.get("classname", "").startswith("conformance.") and testcase.get("name")
    assert int(root.get("failures")) == 2 and int(root.get("errors")) == 2 and int(root.get("skipped")) == 5
    crash = root.find("testsuite[@name='mine/graphs']/testcase/error")
    assert crash.get("type") == "CRASH" and "Segmentation fault" in crash.text


def test_markdown_summary():
    markdown = report_markdown.render(crafted())
    assert "| mine |" in markdown and "❌ FAIL 1/2" in markdown and "💥 CRASH" in markdown
    assert "Failures (4)" in markdown and "not available: needs compute capability SM100" in markdown


def _with(result: RunResult, backend: int, check: str, case: int, **changes) -> RunResult:
    data = json.loads(json.dumps(result.to_dict()))
    target = next(c for c in data["backends"][backend]["checks"] if c["name"] == check)["cases"][case]
    for key, value in changes.items():
        if key in ("max_abs_error", "forward_us"):
            target["metrics"][key] = value
        else:
            target[key] = value
    return RunResult.from_dict(data)


def test_compare_finds_regressions_and_improvements():
    base = crafted()
    assert compare_runs(base, base) == []
    worse = _with(base, 0, "numerics", 0, verdict="FAIL", reason="now wrong")
    assert any(f.regression and "new FAIL" in f.what for f in compare_runs(base, worse))
    grown = _with(base, 0, "numerics", 0, max_abs_error=5e-3)
    assert any(f.regression and "grew" in f.what for f in compare_runs(base, grown))
    assert not compare_runs(base, grown, error_growth=10.0)
    slower = _with(base, 0, "bench", 0, forward_us=400.0)
    assert any(f.regression and "+33%" in f.what for f in compare_runs(base, slower))
    assert not any(f.regression for f in compare_runs(base, slower, bench_threshold=0.5))
    faster = _with(base, 0, "bench", 0, forward_us=200.0)
    assert [f.regression for f in compare_runs(base, faster)] == [False]
    fixed = _with(base, 0, "numerics", 1, verdict="PASS")
    assert not any(f.regression for f in compare_runs(base, fixed))


def _without_case(run: RunResult, check: str, index: int) -> RunResult:
    data = run.to_dict()
    checks = {c["name"]: c for c in data["backends"][0]["checks"]}
    del checks[check]["cases"][index]
    return RunResult.from_dict(data)


def test_compare_treats_lost_coverage_as_a_regression_unless_accepted():
    base = crafted()
    fewer = _without_case(base, "numerics", 0)
    lost = compare_runs(base, fewer)
    assert [f.what.split(" (")[0] for f in lost if f.regression] == ["case missing from NEW"]
    assert not any(f.regression for f in compare_runs(base, fewer, accept=["missing"]))
    assert [f.accepted for f in compare_runs(base, fewer, accept=["missing"])] == [True]
    skipped = _with(base, 0, "numerics", 0, verdict="SKIP", reason="not supported")
    assert any(f.regression and "PASS → SKIP" in f.what for f in compare_runs(base, skipped))
    assert not any(f.regression for f in compare_runs(base, skipped, accept=["skips"]))
    smaller = RunResult.from_dict({**base.to_dict(), "suite": "smoke"})
    assert any(f.regression and "suite" in f.what for f in compare_runs(base, smaller))
    no_backend = RunResult.from_dict({**base.to_dict(), "backends": []})
    assert any(f.regression and "backend missing" in f.what for f in compare_runs(base, no_backend))
    for bad in ({"error_growth": -1}, {"error_growth": 0.5}, {"bench_threshold": -0.1}, {"accept": ["everything"]}):
        with pytest.raises(CompareError):
            compare_runs(base, base, **bad)


@pytest.mark.slow
def test_compare_cli_exit_codes(in_process, tmp_path):
    base = crafted()
    base.save(tmp_path / "base.json")
    _with(base, 0, "bench", 0, forward_us=400.0).save(tmp_path / "slower.json")
    _with(base, 0, "bench", 0, forward_us=200.0).save(tmp_path / "faster.json")

    def gate(new):
        return in_process("compare", tmp_path / "base.json", tmp_path / new).returncode

    # The command's own exit status once; the rest through conformance.cli.main in this process.
    slower = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.cli",
            "compare",
            str(tmp_path / "base.json"),
            str(tmp_path / "slower.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert slower.returncode == 1 and gate("slower.json") == 1, slower.stderr
    assert gate("faster.json") == 0 and gate("base.json") == 0
    missing = in_process("compare", tmp_path / "base.json", "nope.json")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    _without_case(base, "numerics", 0).save(tmp_path / "fewer.json")
    assert gate("fewer.json") == 1
    accepted = in_process("compare", tmp_path / "base.json", tmp_path / "fewer.json", "--accept-missing")
    assert accepted.returncode == 0 and "1 accepted" in accepted.stdout, accepted.stdout
    negative = in_process("compare", tmp_path / "base.json", tmp_path / "base.json", "--error-growth", "-1")
    assert negative.returncode == 2 and "--error-growth -1" in negative.stderr


@pytest.mark.slow
def test_report_command_writes_all_three(tmp_path):
    crafted().save(tmp_path / "r.json")
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.cli",
            "report",
            str(tmp_path / "r.json"),
            "-o",
            str(tmp_path / "r.html"),
            "--junit",
            str(tmp_path / "r.xml"),
            "--markdown",
            str(tmp_path / "r.md"),
        ],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    assert all((tmp_path / name).stat().st_size > 0 for name in ("r.html", "r.xml", "r.md"))


def _chromium() -> str | None:
    return next(
        (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
    )


def _screenshot(browser: str, page, width: int, tmp_path, name: str):
    import numpy
    from PIL import Image

    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--disable-background-networking",
        "--no-first-run",
    ]
    shot = tmp_path / f"{name}.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", f"--window-size={width},1600", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    return numpy.asarray(Image.open(shot).convert("RGB")).astype(int)


def _has_colour(pixels, hex_colour: str) -> bool:
    rgb = [int(hex_colour.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4)]
    return bool((abs(pixels - rgb).sum(axis=-1) == 0).any())


def with_a_numerics_failure_and_every_check() -> RunResult:
    """``crafted()`` with a real numerics failure (its maps) and a summary as wide as a run of every
    check, the last column the only ERROR: off screen, its colour would be missing."""
    import torch

    from conformance.cases.grammar import parse_case
    from conformance.checks import CHECKS
    from conformance.checks.numerics import NumericsCheck
    from tests.planted import defects

    run = crafted()
    failure = judge(
        NumericsCheck(), defects.CausalOffByOne, parse_case("gqa-h4/2-d32-fp32-p16-edges:30+40@0"), torch.device("cpu")
    )
    assert failure.verdict == Verdict.FAIL and "key_map" in failure.evidence
    mine = run.backends[0]
    mine.checks[0].cases.append(failure)
    names = list(CHECKS) + ["a-check-added-later"]
    mine.checks = [check for check in mine.checks if check.name != "draft-loop"] + [
        CheckResult(name, Verdict.PASS, "116 PASS, 55 SKIP")
        for name in names
        if name not in {c.name for c in mine.checks}
    ]
    mine.checks.append(CheckResult("zz-last", Verdict.ERROR, "1 ERROR, 170 PASS"))
    run.checks = [check.name for check in mine.checks]
    return run


@pytest.mark.slow
def test_report_renders_in_a_real_browser(tmp_path, monkeypatch):
    """Headless Chromium: the summary matrix of a run of every check fits 1,280 px, and a numerics
    failure's maps are drawn (the page with them differs from the page without them where they are)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless Chromium on this machine: `apt-get install chromium` (Debian) enables this test")
    run = with_a_numerics_failure_and_every_check()
    report = tmp_path / "report.html"
    report_html.write_html(run, report)
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert 'id="summary"' in dom.stdout and dom.stdout.count('class="verdict') >= 10
    assert dom.stdout.count('<svg class="map"') == 2
    pixels = _screenshot(browser, report, 1280, tmp_path, "report")
    # The summary is the first thing on the page: every verdict colour, the last column's ERROR too.
    for verdict in (Verdict.PASS, Verdict.FAIL, Verdict.CRASH, Verdict.ERROR):
        assert _has_colour(pixels[:500], report_html.VERDICT_COLOURS[verdict]), f"{verdict.value} cell not on screen"
    monkeypatch.setattr(report_html, "MAPS_PER_CHECK", 0)
    plain = tmp_path / "plain.html"
    report_html.write_html(run, plain)
    without_maps = _screenshot(browser, plain, 1280, tmp_path, "plain")
    rows = min(len(pixels), len(without_maps))
    changed = abs(pixels[:rows] - without_maps[:rows]).sum(axis=-1) > 0
    assert changed.sum() > 20_000  # two maps of hundreds of coloured cells


def test_every_failure_says_how_to_reproduce_it_alone_and_junit_carries_the_times():
    run = crafted()
    run.environment["device"] = "cuda"
    for case in run.backends[0].check("numerics").cases:
        case.seconds = 1.25
    command = "conformance run --backend mine --check numerics --case gqa:9+4@0 --device cuda"
    console = Console(record=True, width=200)
    print_report(console, run)
    for name, text in (
        ("terminal", console.export_text()),
        ("html", report_html.render(run)),
        ("markdown", report_markdown.render(run)),
        ("junit", report_junit.render(run)),
    ):
        assert command in text, name
    root = ElementTree.fromstring(report_junit.render(run).encode())
    assert {
        case.get("time") for case in root.iter("testcase") if case.get("classname") == "conformance.mine.numerics"
    } == {"1.250"}


def test_the_same_traceback_is_printed_once_with_the_cases_it_hit():
    error = {"traceback": "Traceback (most recent call last):\n  File x\nValueError: the same"}
    cases = [CaseResult(f"gqa:{n}+1@0", Verdict.ERROR, "ValueError: the same", evidence=dict(error)) for n in (5, 6, 7)]
    run = RunResult(
        {},
        [BackendResult("mine", True, checks=[CheckResult("numerics", Verdict.ERROR, "3 ERROR", cases)])],
        "standard",
        ["numerics"],
    )
    console = Console(record=True, width=200)
    print_report(console, run)
    text = console.export_text()
    assert text.count("ValueError: the same\n") == 4  # three reasons and one traceback
    assert text.count("traceback: the same as for gqa:5+1@0 above") == 2
