"""The conformance command end to end, as a user runs it."""

import json
import subprocess
import sys

import pytest

from conformance.cases.suites import suite
from conformance.results import RunResult, Verdict


def conformance(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


SMOKE_RUN = pytest.mark.xdist_group("smoke_run")  # under pytest -n: the tests that share it (tests/conftest.py)


@SMOKE_RUN
@pytest.mark.slow
def test_smoke_run_passes_and_writes_json(smoke_run):
    completed, out = smoke_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "torch_naive" in completed.stdout and "PASS" in completed.stdout
    result = RunResult.load(out / "results.json")
    assert result.environment["device"] == "cpu" and result.environment["command"].startswith("conformance run")
    numerics = result.backends[0].check("numerics")
    assert numerics.verdict == Verdict.PASS and len(numerics.cases) == len(suite("smoke")) == 9
    assert numerics.details["tolerances"]["bf16"] == {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "--backend", "no_such"], "unknown backend 'no_such'"),
        (
            ["run", "--backend", "torch_naive,backends.torch_naive:TorchNaiveBakend"],
            "backends.torch_naive has no TorchNaiveBakend (did you mean backends.torch_naive:TorchNaiveBackend?)",
        ),
        (["run", "--backend", "torch_naive", "--case", "gqa:12"], "batch item '12' is not CTX+Q"),
        (["run", "--backend", "torch_naive", "--suite", "huge"], "unknown suite 'huge'"),
        (["run", "--backend", "torch_naive", "--check", "speed"], "unknown check 'speed'"),
        (["run", "--backend", "torch_naive", "--device", "tpu:0"], "--device"),
        (["run", "--check", ""], "--check needs at least one check name"),
        (["run", "--case", "0+1", "--seed", "-1"], "seed -1: seeds are between 0"),
        (["run", "--suite", "smoke", "--seed", "-3"], "seed -3"),
        (["run", "--case", "gqa-scalenan:10+1"], "scale nan"),
        (["run", "--case", "4000000+1x60000", "--device", "cpu"], "GiB of host memory; this machine has"),
        (["run", "--case", "gqa-d0:5+1"], "head dim 0: must be at least 3"),
        (["run", "--case", "mla-d0+64:5+1"], "latent dim 0"),
        (["run", "--case", "gqa-h4/0:5+1"], "head counts must be positive"),
        (["run", "--timeout", "inf"], "--timeout inf: must be a finite, positive number"),
        (["run", "--timeout", "0"], "--timeout 0"),
        (["run", "--timeout", "-1"], "--timeout -1"),
        (["run", "--backend-timeout", "nan"], "--backend-timeout nan"),
        (["list", "--timeout", "0"], "--timeout 0"),
        (["run", "--json", ""], "--json: an empty path"),
        (["run", "--out", " "], "--out: an empty path"),
        (["run", "--backend", "torch_naive,torch_naive"], "--backend names 'torch_naive' more than once"),
        (["run", "--check", "numerics", "--check", "numerics"], "--check names 'numerics' more than once"),
        (["run", "--case", "5+1", "--case", "5+1@0"], "--case names"),
    ],
)
def test_usage_errors_exit_2_with_one_line(in_process, args, message):
    completed = in_process(*args)
    assert completed.returncode == 2
    assert completed.stderr.count("\n") == 1 and message in completed.stderr
    assert "Traceback" not in completed.stderr + completed.stdout


def test_a_usage_error_is_one_line_from_the_command_itself():
    # The tests above call main() in this process; the command's own process (its imports, its
    # exit) adds nothing to the line.
    completed = conformance("run", "--backend", "no_such")
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.count("\n") == 1 and "unknown backend 'no_such'" in completed.stderr
    assert completed.stdout == ""


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda d: ["--json", str(d)], "is a directory; name a file"),
        (lambda d: ["--json", "/proc/conformance/x.json"], "--json /proc/conformance/x.json: cannot write there"),
        (lambda d: ["--out", str(d / "file")], "exists and is not a directory"),
        (lambda d: ["--out", str(d / "o"), "--json", str(d / "r.json")], "give one of them"),
        (lambda d: ["--html", str(d)], "--html"),
        (lambda d: ["--junit", str(d)], "--junit"),
        (lambda d: ["--json", str(d / "a.json"), "--markdown", str(d / "a.json")], "name the same file"),
    ],
)
def test_bad_output_paths_exit_2_before_any_work(in_process, tmp_path, make_args, message):
    (tmp_path / "file").write_text("")
    completed = in_process("run", "--suite", "smoke", "--device", "cpu", *make_args(tmp_path))
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert completed.stderr.count("\n") == 1 and message in completed.stderr
    assert completed.stdout == ""  # nothing ran


def test_engine_and_report_check_their_output_paths_first(in_process, tmp_path):
    completed = in_process("engine", "run", "--json", str(tmp_path))
    assert completed.returncode == 2 and "is a directory" in completed.stderr and completed.stderr.count("\n") == 1
    (tmp_path / "list.json").write_text("[1, 2]")
    for results, message in (
        (tmp_path, "is a directory, not a results file"),
        (tmp_path / "list.json", "not a conformance results file"),
    ):
        completed = in_process("report", str(results), "-o", str(tmp_path / "r.html"))
        assert completed.returncode == 2 and message in completed.stderr, completed.stderr


@SMOKE_RUN
@pytest.mark.slow
def test_a_run_removes_the_previous_results_first_and_applies_seed_to_a_suite(in_process, tmp_path, smoke_run):
    stale = tmp_path / "results.json"
    stale.write_text("an older run")
    completed = in_process(
        "run",
        "--suite",
        "smoke",
        "--device",
        "cpu",
        "--check",
        "numerics",
        "--seed",
        "7",
        "--case",
        "gqa-h4/2-d16-fp32:no+1",
        "--json",
        str(stale),
    )
    assert completed.returncode == 2 and stale.read_text() == "an older run"  # a usage error touches nothing
    completed, out = smoke_run  # its --out held an older results.json too
    assert completed.returncode == 0, completed.stderr
    cases = RunResult.load(out / "results.json").backends[0].check("numerics").cases
    assert cases and all(case.case.endswith("@7") for case in cases)
    assert not list(out.glob(".*.tmp"))  # written under a temporary name and renamed


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    """One run of a planted defect, a backend whose import raises and torch_naive, on one case:
    exit 1, each backend its own row (two tests read it; each took a run of its own)."""
    path = tmp_path_factory.mktemp("failing-run") / "r.json"
    backends = "tests.planted.defects:WrongScale,tests.planted.broken_module:Backend,torch_naive"
    completed = conformance(
        "run", "--backend", backends, "--case", "gqa-h4/2-d32-fp32:30+2", "--check", "numerics", "--device", "cpu",
        "--json", str(path),
    )  # fmt: skip
    return completed, path


FAILING_RUN = pytest.mark.xdist_group("failing_run")  # under pytest -n: the tests that share it on one worker


@FAILING_RUN
@pytest.mark.slow
def test_planted_defect_exits_1_and_shows_its_evidence(failing_run):
    completed, path = failing_run
    assert completed.returncode == 1
    assert "worst at request 0" in completed.stdout
    document = json.loads(path.read_text())
    verdicts = {b["name"]: b["checks"][0]["verdict"] for b in document["backends"]}
    assert verdicts["tests.planted.defects:WrongScale"] == "FAIL" and verdicts["torch_naive"] == "PASS", verdicts


@pytest.fixture(scope="module")
def unrunnable_run(tmp_path_factory):
    """One run of two backends that cannot run here, each for its own reason: exit 3, one line."""
    out = tmp_path_factory.mktemp("unrunnable")
    backends = "tests.planted.defects:NeedsBlackwell,tests.planted.defects:NeedsMissingPackage"
    return conformance("run", "--backend", backends, "--device", "cpu", "--out", str(out)), out


UNRUNNABLE_RUN = pytest.mark.xdist_group("unrunnable_run")  # under pytest -n: the tests that share it on one worker


@UNRUNNABLE_RUN
@pytest.mark.slow
def test_nothing_runnable_here_exits_3_with_one_line(unrunnable_run):
    completed, out = unrunnable_run
    assert completed.returncode == 3
    blackwell, missing = RunResult.load(out / "results.json").backends
    assert blackwell.available is False and missing.available is False
    assert blackwell.reason == "runs on cuda, not cpu"
    expected = f"conformance: {blackwell.name}: runs on cuda, not cpu; {missing.name}: {missing.reason}"
    assert completed.stderr.strip() == expected and completed.stderr.count("\n") == 1, completed.stderr


@UNRUNNABLE_RUN
@pytest.mark.slow
def test_missing_package_exits_3_with_the_install_command(unrunnable_run):
    completed, _ = unrunnable_run
    assert completed.returncode == 3 and "pip install 'specdec-conformance[no_such_extra]'" in completed.stderr


def test_cuda_requested_without_a_gpu_exits_3(in_process):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    completed = in_process("run", "--backend", "torch_naive", "--device", "cuda")
    assert completed.returncode == 3 and "no CUDA device" in completed.stderr


@pytest.mark.slow
def test_all_cases_skipped_exits_3(tmp_path):
    completed = conformance(
        "run",
        "--backend",
        "tests.planted.defects:NeedsMissingPackage,torch_naive",
        "--case",
        "mla:10+1",
        "--check",
        "numerics",
        "--out",
        str(tmp_path),
    )
    # torch_naive runs MLA, so something ran: this must not be exit 3.
    assert completed.returncode == 0, completed.stdout


@FAILING_RUN
@pytest.mark.slow
def test_a_backend_module_that_raises_at_import_is_its_row_not_the_commands(failing_run):
    completed, path = failing_run
    assert completed.returncode == 1, completed.stdout + completed.stderr
    _, broken, naive = RunResult.load(path).backends
    assert broken.name == "tests.planted.broken_module:Backend"
    assert (
        broken.check("numerics").verdict == Verdict.ERROR
        and "MY_BACKEND_HOME is not set" in broken.check("numerics").summary
    )
    assert naive.check("numerics").verdict == Verdict.PASS
    assert "Traceback" not in completed.stderr


@pytest.fixture(scope="module")
def graphs_run(tmp_path_factory):
    """``conformance run --check graphs`` on the CPU, no suite named: torch_naive claims no CUDA
    graphs, so every case of the default suite is skipped (exit 3)."""
    path = tmp_path_factory.mktemp("graphs-run") / "r.json"
    return conformance("run", "--check", "graphs", "--device", "cpu", "--json", str(path)), path


GRAPHS_RUN = pytest.mark.xdist_group("graphs_run")  # under pytest -n: the tests that share it on one worker


@GRAPHS_RUN
@pytest.mark.slow
def test_every_case_skipped_says_so_on_stderr(graphs_run):
    # torch_naive claims no CUDA graphs: the graphs check alone runs nothing.
    completed, _ = graphs_run
    assert completed.returncode == 3, completed.stdout + completed.stderr
    assert "every case was skipped" in completed.stderr and "every case was skipped" not in completed.stdout


@SMOKE_RUN
@pytest.mark.slow
def test_ci_logs_get_a_line_per_finished_check_and_version_is_printed(in_process, smoke_run):
    from conformance.checks import default_checks

    completed, _ = smoke_run
    assert completed.returncode == 0, completed.stderr
    lines = completed.stderr.splitlines()  # not a terminal: plain lines, as a CI log shows them
    assert f"torch_naive: {len(default_checks())} check(s) x 9 case(s)" in lines, lines
    assert "torch_naive / numerics: 9 PASS" in lines
    assert "torch_naive / graphs: SKIP (claims cuda_graphs=NEVER)" in lines
    assert any(line.startswith("torch_naive: done in") for line in lines)
    version = in_process("--version")
    assert version.returncode == 0 and version.stdout.startswith("conformance ")


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["engine", "run", "--device", "cuda:7"]
            if not __import__("torch").cuda.is_available()
            else ["engine", "run", "--device", "tpu"],
            "--device",
        ),
        (["engine", "run", "--drafter", "layer-skip"], "drafts nothing without --spec-tokens"),
    ],
)
def test_engine_usage_errors_are_one_line(in_process, args, message):
    completed = in_process(*args)
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1 and message in completed.stderr, (
        completed.stderr
    )


def test_list_shows_every_backend(in_process):
    from backends.registry import BUILTIN_BACKENDS as BUILTINS

    completed = in_process("list", "--device", "cpu")
    assert completed.returncode == 0, completed.stderr
    missing = [name for name in BUILTINS if name not in completed.stdout]
    assert not missing and len(BUILTINS) >= 9, missing


def test_help_documents_the_case_grammar_and_exit_codes(in_process):
    assert "LAYER" in in_process("run", "--help").stdout
    assert "nothing could run here" in in_process("--help").stdout


@GRAPHS_RUN
@pytest.mark.slow
def test_the_default_suite_on_a_cpu_is_quick(graphs_run):
    completed, path = graphs_run
    assert completed.returncode == 3, completed.stderr  # graphs skip on a CPU: nothing ran, but the suite is recorded
    assert RunResult.load(path).suite == "quick"


@pytest.mark.slow
def test_a_ci_log_shows_life_during_a_long_case():
    import io

    from rich.console import Console

    from conformance.report.terminal import LineProgress

    stream = io.StringIO()
    progress = LineProgress(Console(file=stream, width=200))
    progress.HEARTBEAT_S = 0.5
    with progress:
        progress.backend_started("mine", 1, 3)
        progress.event("mine", {"event": "start", "check": "numerics", "case": "gqa:5+1@0"})
        import time

        time.sleep(2.5)
        progress.event("mine", {"event": "result", "check": "numerics", "result": {"verdict": "PASS"}})
    assert "mine / numerics: 0/3 cases, running gqa:5+1@0" in stream.getvalue()
