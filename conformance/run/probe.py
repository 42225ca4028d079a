"""What each backend claims and whether it can run here, asked in a child process: the run's own
process never imports backend code. An import that raises, crashes the interpreter, hangs, or
changes the working directory costs that backend its row, never the run.

The child (``python -m conformance.run.probe DEVICE``, the backends as JSON lines on standard
input) prints one JSON line as it starts each backend and one with the answer; if it dies or
hangs, the backend it was on is blamed and a fresh child goes on with the rest.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from backends.registry import BackendLookupError, BackendRef
from conformance.process_exit import describe_exit
from conformance.results import Verdict
from conformance.run import exit_guard
from conformance.run.isolation import DIE_WITH_PARENT, child_env


@dataclass
class Probe:
    """One backend as the run sees it before running it."""

    ref: BackendRef
    claims: dict[str, Any] = field(default_factory=dict)
    unavailable: str | None = None  # why it cannot run on this device (None: it can)
    failure: str | None = None  # why it could not even be asked (import error, crash, hang)
    failure_verdict: Verdict = Verdict.ERROR  # ERROR for a raised import error, CRASH for a dead or hung child
    mistyped: bool = False  # a pkg.module:Class that names no module or class: the user's mistake, not the backend's


@dataclass
class Loaded:
    """A backend's class, or why it could not be imported."""

    backend_cls: Any = None
    failure: str | None = None
    failure_verdict: Verdict = Verdict.ERROR  # CRASH: the import asked the process to end
    mistyped: bool = False


def load_backend(ref: BackendRef) -> Loaded:
    """Import the backend as every path does (a run's probe, ``--in-process``, the pytest
    plugin): an import that raises is the backend's ERROR, one that asks the process to end
    (``os._exit``, ``sys.exit``) its CRASH, a module:Class that names nothing a typo."""
    from backends import registry

    try:
        with exit_guard.watching("its import"):
            return Loaded(registry.load(ref))
    except BackendLookupError as error:
        return Loaded(failure=str(error), mistyped=ref.origin == "module:Class" and _names_nothing(ref, error))
    except BaseException as error:  # an exit asked for at import: the backend's CRASH, not the run's end
        if exit_guard.is_interrupt(error):
            raise
        reason = f"cannot load backend {ref.name!r}: {exit_guard.crash_reason(error, 'its import')}"
        return Loaded(failure=reason, failure_verdict=Verdict.CRASH)


def answer(ref: BackendRef, device_text: str) -> dict[str, Any]:
    """The child's answer for one backend (also used in-process, for ``--in-process`` runs)."""
    import torch

    from backends.base import DeviceInfo

    loaded = load_backend(ref)
    if loaded.failure:
        return {
            "failure": loaded.failure,
            "mistyped": loaded.mistyped,
            "crashed": loaded.failure_verdict == Verdict.CRASH,
        }
    info = DeviceInfo.of(torch.device(device_text))
    return {
        "claims": loaded.backend_cls.capabilities.to_dict(),
        "unavailable": loaded.backend_cls.availability_reason(info),
    }


def _names_nothing(ref: BackendRef, error: BackendLookupError) -> bool:
    """The module itself does not exist, or has no such class: a typo on the command line (a
    missing dependency inside the module is the backend's failure)."""
    module_name = ref.target.partition(":")[0]
    cause = error.__cause__
    if isinstance(cause, ModuleNotFoundError):
        return cause.name is not None and (module_name == cause.name or module_name.startswith(cause.name + "."))
    return cause is None and "is not an AttentionBackend subclass" in str(error)


def _child_main(device_text: str) -> int:
    answers = os.fdopen(os.dup(1), "w")  # a private copy of stdout: what a backend prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start_dir = os.getcwd()
    for line in sys.stdin:
        ref = BackendRef(**json.loads(line))
        answers.write(json.dumps({"start": ref.name}) + "\n")
        answers.flush()
        result = answer(ref, device_text)
        os.chdir(start_dir)  # an import that moved the process must not move the next one
        answers.write(json.dumps({"name": ref.name, **result}) + "\n")
        answers.flush()
    return 0


def probe_in_process(refs: list[BackendRef], device_text: str) -> dict[str, Probe]:
    return {ref.name: _probe_from(ref, answer(ref, device_text)) for ref in refs}


def _probe_from(ref: BackendRef, data: dict[str, Any]) -> Probe:
    return Probe(
        ref,
        claims=data.get("claims") or {},
        unavailable=data.get("unavailable"),
        failure=data.get("failure"),
        failure_verdict=Verdict.CRASH if data.get("crashed") else Verdict.ERROR,
        mistyped=bool(data.get("mistyped")),
    )


def probe_backends(refs: list[BackendRef], device_text: str, timeout_s: float) -> dict[str, Probe]:
    """Each backend's claims and availability, asked in child processes; a backend whose import
    crashes or runs past ``timeout_s`` gets a ``failure`` and the others are still asked."""
    probes: dict[str, Probe] = {}
    pending = list(refs)
    while pending:
        stderr_file = tempfile.TemporaryFile("w+")  # a file, not a pipe: an import that prints a lot cannot block
        child = subprocess.Popen(
            [sys.executable, "-m", "conformance.run.probe", device_text],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            text=True,
            env=child_env(),
            start_new_session=True,
            preexec_fn=DIE_WITH_PARENT,
        )
        try:
            child.stdin.write("".join(json.dumps(ref.__dict__) + "\n" for ref in pending))
            child.stdin.close()
        except OSError:
            pass
        current, buffer, deadline, hung, ended = None, b"", time.monotonic() + timeout_s, False, False
        try:
            while pending:
                if b"\n" not in buffer:
                    ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
                    if not ready:
                        hung = True
                        break
                    chunk = os.read(child.stdout.fileno(), 65536)  # unbuffered: select sees what is left
                    if not chunk:
                        ended = True  # it died
                        break
                    buffer += chunk
                    continue
                line, buffer = buffer.split(b"\n", 1)
                data = json.loads(line)
                if "start" in data:
                    current, deadline = pending[0], time.monotonic() + timeout_s
                    continue
                probes[data["name"]] = _probe_from(pending.pop(0), data)
                current = None
        finally:
            if ended:  # its output ended: let it finish dying, so its exit status says how
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    hung = True
            _kill(child)
        if pending:
            blamed = current or pending[0]
            stderr_file.seek(0)
            stderr = stderr_file.read().strip().splitlines()
            if hung:
                why = f"importing it ran past the time limit of {timeout_s:g} s (--timeout)"
            else:
                how = describe_exit(child.returncode)
                why = f"the process importing it {'was ' * how.startswith('killed')}{how}" + (
                    f": {stderr[-1][:300]}" if stderr else ""
                )
            probes[blamed.name] = Probe(
                blamed, failure=f"cannot load backend {blamed.name!r}: {why}", failure_verdict=Verdict.CRASH
            )
            pending.remove(blamed)
        stderr_file.close()
    return probes


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
