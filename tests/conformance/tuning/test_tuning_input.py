"""The GPU tuning tools refuse bad input in one line, exit 2, before any GPU work (so on a CPU)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "args",
    [
        ["conformance.tuning.profile_case"],
        ["conformance.tuning.profile_case", "gqa-h32/8-d128-bf16-p16:512+8", "no_such_backend"],
        ["conformance.tuning.profile_case", "not a case", "triton"],
        ["conformance.tuning.tune_split_floor", "128", "many"],
        ["conformance.tuning.tune_split_floor", "0"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args):
    completed = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    assert completed.returncode == 2, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1 and "Traceback" not in completed.stderr
