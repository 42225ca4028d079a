"""The isolated child: ``python -m conformance.run.worker JOB.json EVENTS.jsonl``.

Each event is one flushed JSON line, so the parent keeps every result that landed before a crash.
Exit status 0: finished; 70: stopped on a fatal CUDA error (the parent starts a fresh child).
"""
from __future__ import annotations

import json
import sys

from conformance.run.execution import Job, execute

EXIT_FATAL = 70


def main(argv: list[str]) -> int:
    job_path, events_path = argv
    with open(job_path) as job_file:
        job = Job.from_dict(json.load(job_file))
    with open(events_path, "a", buffering=1) as events:

        def emit(event: dict) -> None:
            events.write(json.dumps(event) + "\n")
            events.flush()

        finished = execute(job, emit)
    return 0 if finished else EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
