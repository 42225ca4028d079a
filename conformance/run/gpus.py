"""Which GPUs a run may use (``conformance run --gpus``), named as ``CUDA_VISIBLE_DEVICES`` names
them: an index, a UUID or a MIG name. A GPU is named as this process's ``CUDA_VISIBLE_DEVICES``
lists it, so a run restricted from outside (``CUDA_VISIBLE_DEVICES=2,3``) stays inside it, and a
child given one of these names sees that one device.
"""

from __future__ import annotations

import itertools
import os


class GpuChoiceError(ValueError):
    """A ``--gpus`` value this machine cannot honour: one line for the user; ``absent`` when the
    machine has no GPU at all."""

    def __init__(self, message: str, absent: bool = False) -> None:
        super().__init__(message)
        self.absent = absent


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries for a child."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = [entry.strip() for entry in listed.split(",") if entry.strip()]
        # CUDA ignores the list from its first negative entry on: "-1" is the usual way to hide every GPU.
        return list(itertools.takewhile(lambda entry: not entry.startswith("-"), entries))
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def choose_gpus(option: str, flag: str = "--gpus") -> list[str]:
    """``all`` or comma-separated indices into the visible GPUs (as ``cuda:N`` counts them);
    ``flag`` names the option in the error."""
    visible = visible_gpus()
    if not visible:
        raise GpuChoiceError(f"{flag} {option}: no CUDA device is visible on this machine", absent=True)
    if option.strip() == "all":
        return visible
    try:
        indices = [int(part) for part in option.split(",") if part.strip()]
    except ValueError:
        raise GpuChoiceError(f"{flag} {option!r}: give 'all' or GPU indices such as 0,1") from None
    if not indices:
        raise GpuChoiceError(f"{flag} {option!r}: give 'all' or GPU indices such as 0,1")
    wrong = [index for index in indices if not 0 <= index < len(visible)]
    if wrong:
        seen = f"this machine sees {len(visible)}: 0-{len(visible) - 1}"
        raise GpuChoiceError(f"{flag}: there is no GPU {wrong[0]} ({seen})")
    if len(set(indices)) != len(indices):
        raise GpuChoiceError(f"{flag} {option!r} names a GPU more than once")
    return [visible[index] for index in indices]
