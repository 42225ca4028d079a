"""One forward of the Gluon kernel and one of the Triton kernel's TMA read on one MLA shape, for
Nsight Compute: ``ncu -k regex:'mla_(gluon|decode)' python -m conformance.tuning.profile_triton_mla
[case]`` (default: 128 heads, decode, batch 64, context 4096)."""

import sys

import torch

from backends.triton import mla_backend
from conformance.tuning.timed_case import TimedCase

CASE = "mla-h128-d512+64-bf16-p64:4096+1x64"


def main(args: list[str]) -> None:
    timed = TimedCase("triton_mla", args[0] if args else CASE, torch.device("cuda"))
    timed.forward()  # the shipped read: the Gluon kernel on Hopper
    shipped, mla_backend.tile_read = mla_backend.tile_read, lambda *_: mla_backend.TMA
    timed.backend._descriptors = None
    timed.forward()  # the Triton kernel, its tiles by TMA
    mla_backend.tile_read = shipped
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
