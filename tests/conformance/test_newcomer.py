"""What a new user meets first, as README says it: the commands work as printed, mistakes are one
line, the smoke suite says what it is, the tables keep names and words whole."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conformance.cases.suites import suite
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted import input_defects

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_the_package_brings_pytest_for_its_plugin():
    import importlib.metadata

    requires = importlib.metadata.requires("specdec-conformance") or []
    assert any(line.startswith("pytest>=") and "extra ==" not in line for line in requires), requires


@pytest.mark.slow
def test_bare_pytest_loads_a_backend_from_the_current_folder_and_prints_a_rerun_that_works(tmp_path):
    (tmp_path / "my_attn.py").write_text(
        "from tests.planted.defects import WrongScale\n\nclass MyAttnBackend(WrongScale):\n    pass\n"
    )
    command = ["--conformance-backend", "my_attn:MyAttnBackend", "--conformance-check", "numerics"]
    command += ["--conformance-device", "cpu", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull]
    pytest_script = Path(sys.executable).with_name("pytest")
    bare = (
        [str(pytest_script)]
        if pytest_script.exists()
        else [sys.executable, "-c", "import pytest; raise SystemExit(pytest.console_main())"]
    )
    completed = subprocess.run(bare + command, capture_output=True, text=True, cwd=tmp_path, env=env())
    assert completed.returncode == 1 and "No module named" not in completed.stdout + completed.stderr
    rerun = next(line for line in completed.stdout.splitlines() if line.startswith("rerun: python -m pytest "))
    again = subprocess.run(
        [sys.executable, *rerun.split(" ", 2)[2].split(), "-p", "no:cacheprovider", "-c", os.devnull],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env(),
    )
    assert again.returncode == 1 and "1 failed" in again.stdout, again.stdout[-1500:]
    # A summary line names the backend, not an empty path.
    assert "FAILED my_attn:MyAttnBackend::conformance[numerics-" in completed.stdout


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="/proc: a folder no process may write into")
def test_new_backend_into_a_folder_it_cannot_write_is_one_line(in_process):
    completed = in_process("new-backend", "foo", "--dir", "/proc/self")
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
    assert completed.stderr.startswith("conformance: error: cannot write into /proc/self")


def test_smoke_catches_a_backend_that_ignores_the_softmax_scale_and_says_it_is_not_a_gate(in_process):
    results = [
        judge(NumericsCheck(), input_defects.RecomputesScale, case, torch.device("cpu")) for case in suite("smoke")
    ]
    assert any(result.verdict == Verdict.FAIL for result in results)
    help_text = in_process("run", "--help").stdout
    assert "not a gate" in " ".join(help_text.split()) and "quick and standard are the gates" in " ".join(
        help_text.split()
    )


@pytest.mark.slow
def test_list_keeps_every_word_whole_in_120_columns(in_process):
    import argparse

    from conformance.cli import command_list

    console = Console(width=120, force_terminal=True, color_system=None, record=True)
    command_list(argparse.Namespace(timeout=300.0, device="cpu", format="table"), console)
    text = console.export_text()
    listed = in_process("list", "--format", "json", "--device", "cpu")
    for row in json.loads(listed.stdout)["backends"]:
        for value in row.values():
            # The table words the claims in lower case, a space after each comma.
            for word in str(value).replace("_", " ").replace(",", " ").lower().split():
                assert word in text.lower(), (word, row["backend"])


@pytest.mark.slow
def test_a_named_case_that_skips_says_why_in_the_terminal(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "conformance", "run", "--case", "gqa-h2/1-d16-fp32-bigpool:5+1", "--check"]
        + ["numerics", "--device", "cpu", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        env=env(),
    )
    assert completed.returncode == 3
    assert "torch_naive / numerics: SKIP gqa-h2/1-d16-fp32-p16-bigpool:5+1@0: " in completed.stdout, completed.stdout


@pytest.mark.slow
def test_engine_run_says_what_it_is_doing_and_its_sampling(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "conformance", "engine", "run", "--model", "tiny", "--num-prompts", "1"]
        + ["--max-tokens", "2", "--device", "cpu", "--temperature", "0.5"],
        capture_output=True,
        text=True,
        env=env(),
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.startswith("engine: loading tiny") and "engine: generating 1 x 2 tokens" in completed.stderr
    assert "temperature 0.5, seed 0" in completed.stdout


def test_the_html_shows_no_none_and_check_details_as_a_table(tmp_path):
    from conformance.report import html

    results = json.loads((ROOT / "reports" / "torch_naive.json").read_text())
    results["environment"]["git_sha"] = None
    from conformance.results import RunResult

    page = html.render(RunResult.from_dict(results))
    environment = page.split("id='environment'>")[1]
    assert "None" not in environment and "<td>—</td>" in environment
    assert "<table class='numbers details'>" in page and '"tolerance"' not in page


def test_the_markdown_footer_shows_a_version_as_written():
    from conformance.report import markdown
    from conformance.results import RunResult

    text = markdown.render(RunResult({"command": "conformance run", "version": "0.1.0"}, [], "quick", []))
    assert "· 0\\.1.0</sub>" in text  # a backslash before the dot (rendered "0.1.0"), not "\\0.1.0"


def _options(parser) -> dict[str, set[str]]:
    """Every subcommand (``run``, ``engine run``) and its long options, from the CLI's own parser."""
    import argparse

    found: dict[str, set[str]] = {}

    def walk(prefix: str, parser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{prefix} {name}".strip(), sub)
            else:
                found.setdefault(prefix, set()).update(
                    option for option in action.option_strings if option.startswith("--") and option != "--help"
                )

    walk("", parser)
    return found


def test_the_cli_reference_names_every_command_and_option():
    from conformance.cli import build_parser

    reference = (ROOT / "docs" / "cli.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for command, options in _options(build_parser()).items():
        if command:
            assert f"conformance {command}" in reference, command
        for option in options:
            assert option in reference, (command, option)
    synopsis = readme.split("## Run it")[1].split("```")[1]
    for option in _options(build_parser())["run"]:
        assert option in synopsis, option
    assert "conformance new-backend" in synopsis and "--version" in synopsis
