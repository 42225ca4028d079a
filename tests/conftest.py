import os

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
    if getattr(config.option, "numprocesses", None) is None:  # no xdist (-p no:xdist)
        return
    given = any(arg.startswith(("-n", "--numprocesses")) for arg in config.invocation_params.args)
    timings = config.getoption("--benchmarks") or config.getoption("benchmark_only", False)
    if timings or (not given and torch.cuda.is_available()):
        config.option.numprocesses = 0


def pytest_collection_modifyitems(config, items):
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
    if hasattr(config, "workerinput") and "OMP_NUM_THREADS" not in os.environ:
        # A pytest-xdist worker (the test command runs -n 2): one thread, in this process and in
        # every process its tests start (the CLI, its children). With a thread a core in every
        # process, their OpenMP threads spin against each other: tests took several times as long.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # The fixtures of conformance.pytest_plugin, also where the package is not installed (the GPU
    # machine runs from a checkout): register it unless its entry point already did.
    import conformance.pytest_plugin as plugin

    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "conformance")
