import subprocess
import sys

import pytest


def engine(*args):
    return subprocess.run([sys.executable, "-m", "conformance.cli", "engine", "run", *args], capture_output=True, text=True, timeout=300)


def test_engine_run_prints_speed_and_acceptance():
    completed = engine("--spec-tokens", "2", "--drafter", "scripted:random:0.7", "--num-prompts", "3", "--max-tokens", "12",
                       "--prompt-len", "20", "--device", "cpu")
    assert completed.returncode == 0, completed.stderr
    for metric in ("throughput", "TPOT", "mean acceptance length", "draft acceptance"):
        assert metric in completed.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--drafter", "bogus", "--spec-tokens", "2"], "unknown drafter"),
        (["--model", "/no/such/dir"], "not one of tiny"),
        (["--spec-tokens", "-1"], "--spec-tokens must be >= 0"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_engine_usage_errors(args, message):
    completed = engine(*args, "--device", "cpu")
    assert completed.returncode == 2 and message in completed.stderr and "Traceback" not in completed.stderr
