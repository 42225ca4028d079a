"""pytest plugin (registered through the ``pytest11`` entry point): fixtures for backend authors.

``forbid_host_syncs``: fails the test if its body makes a host-blocking CUDA call, listing each
one with the Python line that made it::

    def test_build_is_async(forbid_host_syncs, my_backend, common):
        my_backend.build(common)          # a seq_lens.cpu() in here fails the test

Use ``forbid_host_syncs.paused()`` around set-up that may sync. Without CUDA the test is skipped.
"""
from __future__ import annotations

import pytest
import torch

from conformance.host_syncs.detector import HostSyncDetector, format_events


_DETECTOR_KEY = pytest.StashKey[HostSyncDetector]()


@pytest.fixture
def forbid_host_syncs(request):
    if not torch.cuda.is_available():
        pytest.skip("forbid_host_syncs needs a CUDA device")
    detector = HostSyncDetector("auto")
    with detector:
        request.node.stash[_DETECTOR_KEY] = detector
        yield detector


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # Judged right after the test body, so a sync fails the test itself (not its teardown).
    result = yield
    detector = item.stash.get(_DETECTOR_KEY, None)
    if detector is not None and detector.blocking_events:
        blocking = detector.blocking_events
        pytest.fail(
            f"{len(blocking)} host-blocking CUDA call(s) (detector: {detector.strategy_name}):\n" + format_events(blocking),
            pytrace=False,
        )
    return result
