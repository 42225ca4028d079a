"""Which GPU each pytest-xdist worker takes (``--conformance-gpus``).

The controller resolves the option once against the GPUs it sees and writes each worker's one GPU
into that worker's execnet spec as ``CUDA_VISIBLE_DEVICES`` (``pytest_xdist_setupnodes``): the
N-th worker takes the N-th GPU, round robin, so ``-n 4`` over two GPUs puts two workers on each.
execnet sets the variable in the worker's process before pytest starts there, so no conftest or
plugin of the author's can initialize CUDA on another GPU first; and a worker that xdist starts in
place of one that died reuses the dead one's spec, so it takes the same GPU (the workers stay
spread as they were).

A GPU is named as the controller's ``CUDA_VISIBLE_DEVICES`` names it (an index, a UUID or a MIG
name), so a run restricted from outside (``CUDA_VISIBLE_DEVICES=2,3``) stays inside it.
"""

from __future__ import annotations

import itertools
import os


class GpuChoiceError(ValueError):
    """A ``--conformance-gpus`` value this machine cannot honour: one line for the user;
    ``absent`` when the machine has no GPU at all."""

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


def assign_gpus(gpus: list[str], specs) -> list[str]:
    """Each worker's GPU written into its execnet spec, round robin; returns the GPUs used."""
    for index, spec in enumerate(specs):
        spec.env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return gpus[: len(specs)]
