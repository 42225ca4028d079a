"""The isolated child: ``python -m conformance.run.worker JOB.json EVENTS``, the channel's key on
standard input (one hex line, read before the backend is imported; standard input is then
/dev/null).

Each event is one flushed, signed line (``channel.py``), so the parent keeps every result that
landed before a crash and can tell the harness's lines from anything else written there. The
last event is ``done``: an exit without it (status 0 included: a backend that calls ``exit``)
is a crash of the case that was running.
Exit status 0: finished; 70: stopped on a fatal CUDA error (the parent starts a fresh child).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

from conformance.run.channel import ChannelWriter
from conformance.run.execution import Job, execute

EXIT_FATAL = 70


def _read_key() -> bytes:
    key = bytes.fromhex(sys.stdin.readline().strip())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return key


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
KEEP_FREED_BYTES = 1 << 30


def _keep_freed_memory() -> None:
    """Let glibc keep freed memory (up to 1 GiB a block) for the next allocation instead of
    returning it to the kernel: a case allocates and frees the same large tensors over and over,
    and each fresh mapping is faulted in and zeroed again. Measured on the 2-core CPU machine: one
    large standard case (numerics + determinism) 35 s → 26 s, system time 22 s → 4.6 s."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_FREED_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
    except (OSError, AttributeError):  # not glibc: the allocator's defaults
        pass


def main(argv: list[str]) -> int:
    job_path, events_path = argv
    _keep_freed_memory()
    key = _read_key()
    with open(job_path) as job_file:
        job = Job.from_dict(json.load(job_file))
    with open(events_path, "a", buffering=1) as events:
        finished = execute(job, ChannelWriter(events, key).emit)
    return 0 if finished else EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
