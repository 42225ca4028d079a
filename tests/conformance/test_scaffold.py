"""`conformance new-backend NAME`: a skeleton that passes the smoke suite out of the box, through
the pytest plugin, and clear refusals."""

import subprocess
import sys

import pytest

from conformance.run.execution import judge
from conformance.scaffold import render, write_skeleton


def new_backend(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", "new-backend", *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.mark.slow
def test_the_skeleton_and_its_test_pass_the_smoke_suite(tmp_path):
    completed = new_backend("my_attn", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert "conformance run --backend my_attn:MyAttnBackend --suite smoke" in completed.stdout
    module = (tmp_path / "my_attn.py").read_text()
    assert "class MyAttnBackend(AttentionBackend)" in module and 'name = "my_attn"' in module
    assert "Template" not in module and "template" not in module
    # The generated test runs the smoke suite through the plugin in a pytest of its own.
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_attn.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ran.returncode == 0, ran.stdout[-3000:]


def test_the_skeleton_fails_numerics_once_its_math_is_wrong():
    """The skeleton's math is what the smoke suite checks: a wrong scale in it fails numerics."""
    import torch

    from conformance.cases.grammar import parse_case
    from conformance.checks.numerics import NumericsCheck
    from conformance.results import Verdict
    from conformance.scaffold import HERE

    namespace: dict = {}
    source = render((HERE / "template_backend.py").read_text(), "broken")
    exec(compile(source.replace("* spec.softmax_scale", "* spec.softmax_scale * 0.5"), "broken.py", "exec"), namespace)
    case = parse_case("gqa-h4/2-d32-fp32-p16:10+4,0+6")
    check = NumericsCheck()
    assert judge(check, namespace["BrokenBackend"], case, torch.device("cpu")).verdict == Verdict.FAIL
    from conformance.scaffold.template_backend import TemplateBackend

    assert judge(check, TemplateBackend, case, torch.device("cpu")).verdict == Verdict.PASS


@pytest.mark.parametrize(
    "name,message",
    [
        ("9lives", "not a Python module name"),
        ("class", "not a Python module name"),
        ("torch", "already importable"),
        ("exists", "exists: not overwritten"),
    ],
)
def test_refusals_are_one_line_and_exit_2(in_process, tmp_path, monkeypatch, name, message):
    (tmp_path / "exists.py").write_text("")
    monkeypatch.chdir(tmp_path)
    completed = in_process("new-backend", name)
    assert completed.returncode == 2 and message in completed.stderr and len(completed.stderr.splitlines()) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exists.py"]


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        write_skeleton("fine_name", tmp_path / "nowhere")
