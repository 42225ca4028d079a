"""One forward of each named backend on one case, inside an NVTX range, for Nsight Compute:

    ncu --nvtx --nvtx-include 'forward/' --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python -m conformance.tuning.profile_case CASE BACKEND[,BACKEND ...]

Only the forwards' kernels are profiled (the push/pop range ``forward``: ncu's filter reads a slash
as the end of a range's name, so the backends share the name and their kernels' names tell them
apart), not the case's preparation (cache writes, poison fills). A warm-up forward runs first,
outside the range, so no compile or lazy set-up is measured."""

from __future__ import annotations

import sys

import torch

from backends import registry
from backends.registry import BackendLookupError
from conformance.cases.grammar import CaseSyntaxError, parse_case
from conformance.tuning.timed_case import TimedCase

USAGE = "usage: python -m conformance.tuning.profile_case CASE BACKEND[,BACKEND ...]"


def main(arguments: list[str]) -> None:
    if len(arguments) != 2:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    case, backends = arguments[0], arguments[1].split(",")
    try:  # bad input says so in one line before any GPU work
        parse_case(case)
        for name in backends:
            registry.resolve(name)
    except (CaseSyntaxError, BackendLookupError) as error:
        print(f"profile_case: {error}", file=sys.stderr)
        sys.exit(2)
    for name in backends:
        timed = TimedCase(name, case, torch.device("cuda"))
        timed.forward()
        torch.cuda.synchronize()
        with torch.cuda.nvtx.range("forward"):
            timed.forward()
        torch.cuda.synchronize()
        del timed


if __name__ == "__main__":
    main(sys.argv[1:])
