"""The ``forbid_host_syncs`` pytest fixture: fails a test whose body makes a host-blocking CUDA
call, listing each one with the Python line that made it::

    def test_build_is_async(forbid_host_syncs, my_backend, common):
        my_backend.build(common)          # a seq_lens.cpu() in here fails the test

Use ``forbid_host_syncs.paused()`` around set-up that may sync. Without CUDA the test is skipped.

Registered as a plugin (the ``conformance`` pytest11 entry point does it, or ``-p
host_syncs.pytest_fixture``) the verdict is the test's own; with the fixture merely imported into a
conftest (``from host_syncs import forbid_host_syncs``) it comes at the fixture's teardown.
"""

from __future__ import annotations

import pytest
import torch

from host_syncs.detector import HostSyncDetector, format_events

_DETECTOR_KEY = pytest.StashKey[HostSyncDetector]()
_JUDGED_KEY = pytest.StashKey[bool]()


def _verdict(detector: HostSyncDetector) -> str | None:
    blocking = detector.blocking_events
    if not blocking:
        return None
    return f"{len(blocking)} host-blocking CUDA call(s) (detector: {detector.strategy_name}):\n" + format_events(
        blocking
    )


@pytest.fixture
def forbid_host_syncs(request):
    if not torch.cuda.is_available():
        pytest.skip("forbid_host_syncs needs a CUDA device")
    detector = HostSyncDetector("auto")
    with detector:
        request.node.stash[_DETECTOR_KEY] = detector
        yield detector
    problem = _verdict(detector)
    if problem and not request.node.stash.get(_JUDGED_KEY, False):
        pytest.fail(problem, pytrace=False)  # the plugin's hook is not installed: judged here instead


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # Judged right after the test body, so a sync fails the test itself (not its teardown).
    result = yield
    detector = item.stash.get(_DETECTOR_KEY, None)
    if detector is not None:
        item.stash[_JUDGED_KEY] = True
        problem = _verdict(detector)
        if problem:
            pytest.fail(problem, pytrace=False)
    return result
