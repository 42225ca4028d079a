import pytest
import torch

# pytester's in-process runs (the plugin tests) put sys.modules back as they found it, so a module
# first imported inside one is imported again afterwards; Triton's native module cannot be (nanobind
# aborts the process: "refusing to add duplicate key"). Import it before any run.
try:
    import triton  # noqa: F401
except ImportError:  # a machine without Triton runs the tests that do not need it
    pass


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
    # The fixtures of conformance.pytest_plugin, also where the package is not installed (the GPU
    # machine runs from a checkout): register it unless its entry point already did.
    import conformance.pytest_plugin as plugin

    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "conformance")
