"""Triton is an extra: where it is missing, `list` names the install command for the Triton
backends and the default run works (its processes never import Triton)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A sitecustomize that hides `triton` from this process and every child (probe, worker): find_spec
# answers None and an import raises ModuleNotFoundError, as on a machine without it.
BLOCKER = """
import sys
class _HidesTriton:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return self.finder.find_spec(name, path, target)
sys.meta_path[:] = [_HidesTriton(finder) if hasattr(finder, "find_spec") else finder for finder in sys.meta_path]
"""


@pytest.fixture
def no_triton(tmp_path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    repo = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)]), "TRITON_INTERPRET": "1"}


def conformance(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_list_names_the_install_command(no_triton):
    listed = conformance("list", "--format", "json", "--device", "cpu", env=no_triton)
    assert listed.returncode == 0, listed.stderr
    rows = {row["backend"]: row for row in json.loads(listed.stdout)["backends"]}
    for name in ("triton", "triton_mla"):
        assert rows[name]["here"] == "missing Python package triton: pip install 'specdec-conformance[triton]'"
        assert rows[name]["kinds"]  # the claims are still shown
    assert rows["torch_naive"]["here"] == "available"


@pytest.mark.slow
def test_the_default_backend_runs_without_triton(no_triton, tmp_path):
    completed = conformance(
        "run",
        "--case",
        "gqa-h4/2-d64-fp32-p16:40+1,20+4",
        "--check",
        "numerics,engine",
        "--device",
        "cpu",
        "--json",
        str(tmp_path / "r.json"),
        "--quiet",
        env=no_triton,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]


@pytest.mark.slow
def test_without_the_interpreter_a_cpu_is_the_reason_not_the_package(no_triton):
    # Installing triton would not let the kernels run on a CPU: the device is named first.
    env = {key: value for key, value in no_triton.items() if key != "TRITON_INTERPRET"}
    listed = conformance("list", "--format", "json", "--device", "cpu", env=env)
    rows = {row["backend"]: row for row in json.loads(listed.stdout)["backends"]}
    assert rows["triton"]["here"] == rows["triton_mla"]["here"] == "runs on cuda, not cpu"
