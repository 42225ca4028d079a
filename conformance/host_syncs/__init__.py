"""Host↔device sync detection: ``detect_host_syncs()`` and the ``forbid_host_syncs`` fixture."""
from conformance.host_syncs.detector import HostSyncDetector, detect_host_syncs, resolve_strategy
from conformance.host_syncs.events import BLOCKING_KINDS, INFO_KINDS, Frame, SyncEvent

__all__ = ["HostSyncDetector", "detect_host_syncs", "resolve_strategy", "SyncEvent", "Frame", "BLOCKING_KINDS", "INFO_KINDS"]
