import os
import signal
import subprocess
import sys

import pytest
import torch

# pytester's in-process runs (the plugin tests) put sys.modules back as they found it, so a module
# first imported inside one is imported again afterwards; Triton's native module cannot be (nanobind
# aborts the process: "refusing to add duplicate key"). Import it before any run.
try:
    import triton  # noqa: F401
except ImportError:  # a machine without Triton runs the tests that do not need it
    pass


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # pyproject's addopts run the tests on two pytest-xdist workers (CI: a CPU machine). One process
    # instead, unless -n is on the command line: for timings (tests/benchmarks: pytest-benchmark
    # times nothing under xdist) and where a CUDA device is visible (the GPU tests were proven one
    # process at a time on one GPU).
    if hasattr(config, "workerinput"):  # a worker: pytest-benchmark is off here, no need to warn so
        if hasattr(config.option, "benchmark_disable"):
            config.option.benchmark_disable = True
        return
    if getattr(config.option, "numprocesses", None) is None:  # no xdist (-p no:xdist)
        return
    given = any(arg.startswith(("-n", "--numprocesses")) for arg in config.invocation_params.args)
    timings = config.getoption("--benchmarks") or config.getoption("benchmark_only", False)
    if timings or (not given and torch.cuda.is_available()):
        config.option.numprocesses = 0
    elif config.option.numprocesses and hasattr(config.option, "benchmark_disable"):
        config.option.benchmark_disable = True  # what pytest-benchmark does under xdist, without its warning


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        # Under pytest -n, the slow tests first (each worker collects and sorts alike): a test of a
        # minute handed out last would leave one worker running it alone at the end.
        items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


pytest_plugins = ["pytester"]


def pytest_addoption(parser):
    parser.addoption(
        "--benchmarks",
        action="store_true",
        default=False,
        help="collect tests/benchmarks (pytest-benchmark timings on a GPU); a plain run leaves them out",
    )


def pytest_ignore_collect(collection_path, config):
    # Timings, not correctness: collected only when asked for, so `pytest -q` never reports them.
    if collection_path.name == "benchmarks" and not config.getoption("--benchmarks"):
        return True
    return None


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker (the test command runs -n 2): one thread, in this process and in
        # every process its tests start (the CLI, its children), and OpenMP threads that sleep
        # while they wait (a sharded run's workers take cores / workers threads whatever the
        # environment says). Threads spinning for a core another process holds made tests take
        # several times as long: a run over pytest-xdist 29 s beside another, 10 s with these.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
    # The fixtures of conformance.pytest_plugin, also where the package is not installed (the GPU
    # machine runs from a checkout): register it unless its entry point already did.
    import conformance.pytest_plugin as plugin

    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "conformance")


@pytest.fixture
def in_process(capsys):
    """``conformance ARGS`` as ``conformance.cli.main(ARGS)`` in this process, without a process of
    its own importing torch (seconds each): for what runs no case here, usage errors (stopped
    before any work), help, ``list``, ``report`` and ``compare``. A ``CompletedProcess`` as
    ``subprocess.run`` gives it; the signal handlers a command takes over are put back. The
    command's own process is tested too (tests/conformance/test_cli.py)."""
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


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """One ``conformance run`` of the smoke suite (torch_naive, every default check, seed 7) over an
    older run's results file, made once for the tests that read what it printed and wrote (each
    took a command of its own, about as long as this one). Those tests are marked
    ``xdist_group("smoke_run")``: under pytest -n they share it on one worker."""
    out = tmp_path_factory.mktemp("smoke-run")
    (out / "results.json").write_text("an older run")
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--backend", "torch_naive", "--suite", "smoke"]
        + ["--device", "cpu", "--seed", "7", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return completed, out
