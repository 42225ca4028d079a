"""The GPU tuning tools refuse bad input in one line, exit 2, before any GPU work (so on a CPU)."""

import importlib
import subprocess
import sys

import pytest

BAD_INPUT = [
    ["conformance.tuning.profile_case"],
    ["conformance.tuning.profile_case", "gqa-h32/8-d128-bf16-p16:512+8", "no_such_backend"],
    ["conformance.tuning.profile_case", "not a case", "triton"],
    ["conformance.tuning.tune_split_floor", "128", "many"],
    ["conformance.tuning.tune_split_floor", "0"],
]


@pytest.mark.parametrize("args", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    # Each tool's main() in this process (a process of its own imports torch: seconds each).
    module, *arguments = args
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(arguments)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


@pytest.mark.parametrize("args", [BAD_INPUT[0], pytest.param(BAD_INPUT[-1], marks=pytest.mark.slow)])
def test_bad_input_from_the_command_itself_is_one_line_and_exit_2(args):
    completed = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    assert completed.returncode == 2, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1 and "Traceback" not in completed.stderr
