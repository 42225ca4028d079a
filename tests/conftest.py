import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


pytest_plugins = ["pytester"]


def pytest_configure(config):
    # The fixtures of conformance.pytest_plugin, also where the package is not installed (the GPU
    # machine runs from a checkout): register it unless its entry point already did.
    import conformance.pytest_plugin as plugin

    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "conformance")
