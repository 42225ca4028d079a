"""What a command line's device flag names (``--device``, the plugin's ``--conformance-device``):
parsed here for every command line, the engine's, conformance's and the pytest plugin's. Not part
of the backend contract: a backend is handed a ``torch.device``."""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """A device named on a command line that cannot be used. ``absent``: a valid device that this
    machine lacks (cuda without a GPU), as opposed to a mistake (``tpu``, ``cuda:x``)."""

    def __init__(self, message: str, absent: bool = False) -> None:
        super().__init__(message)
        self.absent = absent


def resolve_device(text: str | None, flag: str = "--device") -> torch.device:
    """``text`` as a torch device (None: cuda when visible, else cpu); DeviceError otherwise."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"{flag} {text!r} is not a device (cpu, cuda, cuda:1)") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"{flag} {text!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"{flag} {text}: no CUDA device is visible on this machine", absent=True)
    return device
