"""Host↔device sync detection, usable on its own: ``detect_host_syncs()`` counts and locates the
host-blocking CUDA calls of a region; ``forbid_host_syncs`` is a pytest fixture that fails a test
whose body makes one (``from host_syncs import forbid_host_syncs`` in a conftest).

Used by the conformance harness (the syncs and graphs checks) and by the reference engine (its
measured runs), which is why it sits beside both rather than inside either.
"""

from host_syncs.detector import HostSyncDetector, detect_host_syncs, resolve_strategy
from host_syncs.events import BLOCKING_KINDS, INFO_KINDS, Frame, SyncEvent

__all__ = [
    "HostSyncDetector",
    "detect_host_syncs",
    "resolve_strategy",
    "SyncEvent",
    "Frame",
    "BLOCKING_KINDS",
    "INFO_KINDS",
    "forbid_host_syncs",
]


def __getattr__(name: str):
    if name == "forbid_host_syncs":  # imported on demand: the rest of the package does not need pytest
        from host_syncs.pytest_fixture import forbid_host_syncs

        return forbid_host_syncs
    raise AttributeError(f"module 'host_syncs' has no attribute {name!r}")
