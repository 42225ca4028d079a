"""Fixtures of the conformance command's tests."""

import signal
import subprocess

import pytest


@pytest.fixture
def in_process(capsys):
    """``conformance ARGS`` as ``conformance.cli.main(ARGS)`` in this process: for the commands that
    stop before any work (usage errors, help), without a process of their own importing torch.
    Returns what ``conformance`` returns; the signal handlers a command takes over are put back."""
    from conformance.cli import main

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def call(*args):
        capsys.readouterr()
        try:
            status = main([str(arg) for arg in args])
        except SystemExit as exit:  # argparse: --help, --version and its own usage errors
            status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        stdout, stderr = capsys.readouterr()
        return subprocess.CompletedProcess(["conformance", *map(str, args)], status, stdout, stderr)

    yield call
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
