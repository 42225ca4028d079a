"""The GPU tuning tools refuse bad input in one line, exit 2, before any GPU work (so on a CPU)."""

import subprocess
import sys

import pytest

SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "args",
    [
        ["conformance.tuning.profile_case"],
        # A process each (about two seconds): one of them in the inner loop (-m "not slow").
        pytest.param(
            ["conformance.tuning.profile_case", "gqa-h32/8-d128-bf16-p16:512+8", "no_such_backend"], marks=SLOW
        ),
        pytest.param(["conformance.tuning.profile_case", "not a case", "triton"], marks=SLOW),
        pytest.param(["conformance.tuning.tune_split_floor", "128", "many"], marks=SLOW),
        pytest.param(["conformance.tuning.tune_split_floor", "0"], marks=SLOW),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args):
    completed = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    assert completed.returncode == 2, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1 and "Traceback" not in completed.stderr
