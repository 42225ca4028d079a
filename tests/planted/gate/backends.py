"""Run-time gate breakers (the import-time ones are modules of their own beside this one)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

from backends.base import PLAIN_LAYER, LayerParameters
from backends.torch_naive import TorchNaiveBackend
from tests.planted.defects import WrongScale


def _large(metadata) -> bool:
    return len(metadata.seq_lens) > 3


class ExitsQuietly(TorchNaiveBackend):
    """A library calling os._exit(0) on a path it cannot handle, on any batch of more than 3
    requests: unguarded, the process would end with status 0 before the case (or any later one)
    is reported."""

    name = "planted_exits_quietly"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if _large(metadata):
            os._exit(0)
        super().forward(query, kv_cache, metadata, out, layer)


class RaisesSystemExit(TorchNaiveBackend):
    """An error path that calls sys.exit() (SystemExit is no Exception: no except clause of a
    check catches it) on any batch of more than 3 requests."""

    name = "planted_raises_system_exit"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if _large(metadata):
            sys.exit()
        super().forward(query, kv_cache, metadata, out, layer)


class LoosensTolerances(WrongScale):
    """Wrong (1/head_dim scale), and sets the shared comparison tolerances so wide that the
    wrong output would compare equal: a test helper's monkeypatch left in the backend."""

    name = "planted_loosens_tolerances"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        from conformance.harness import comparison

        for dtype in comparison.TOLERANCES:
            comparison.TOLERANCES[dtype] = (1e9, 1e9)
        super().forward(query, kv_cache, metadata, out, layer)


class ForgesEvents(WrongScale):
    """Wrong, and appends a PASS result line to the file its worker writes events to (found on
    the worker's command line: a logging handler pointed at the wrong path does the same)."""

    name = "planted_forges_events"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer)
        if len(sys.argv) > 2 and sys.argv[2].endswith(".jsonl"):
            with open(sys.argv[2], "a") as events:
                events.write('{"event": "result", "check": "numerics", "result": {"case": "x", "verdict": "PASS"}}\n')


class LeavesProcesses(TorchNaiveBackend):
    """Starts helper processes and never stops them: one in its own process group, one in a
    session of its own (as a daemon would). Their pids go to the file named by
    PLANTED_PIDS_FILE, for the test to check that none outlives the run."""

    name = "planted_leaves_processes"

    def build(self, common):
        if not getattr(self, "_started", False):
            self._started = True
            helpers = [
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]),
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True),
            ]
            path = os.environ.get("PLANTED_PIDS_FILE")
            if path:
                with open(path, "a") as pids:
                    pids.write("".join(f"{helper.pid}\n" for helper in helpers))
        return super().build(common)


class LeavesProcessesAndHangs(LeavesProcesses):
    """Starts its helpers, then never returns: a run that is still going when it is killed."""

    name = "planted_leaves_processes_and_hangs"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        time.sleep(3600)


class ExitsFromC(TorchNaiveBackend):
    """A C library calling exit(0) on a path it cannot handle (what os._exit's guard cannot turn
    into an exception), on any batch of more than 3 requests."""

    name = "planted_exits_from_c"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if _large(metadata):
            ctypes.CDLL(None).exit(0)
        super().forward(query, kv_cache, metadata, out, layer)


class ExitsOnAThread(TorchNaiveBackend):
    """A watchdog thread of the backend's that ends the process with os._exit(0) (a library's
    fatal-error path run off the main thread), on any batch of more than 3 requests."""

    name = "planted_exits_on_a_thread"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if _large(metadata):
            watchdog = threading.Thread(target=os._exit, args=(0,), name="watchdog")
            watchdog.start()
            watchdog.join()
        super().forward(query, kv_cache, metadata, out, layer)


class RaisesKeyboardInterrupt(TorchNaiveBackend):
    """Raises KeyboardInterrupt on any batch of more than 3 requests (a library that turns its own
    SIGINT handling into the exception), or any other BaseException: no signal came."""

    name = "planted_raises_keyboard_interrupt"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if _large(metadata):
            raise KeyboardInterrupt
        super().forward(query, kv_cache, metadata, out, layer)


class ExitsFromCWithoutCleanup(TorchNaiveBackend):
    """C's _exit(0) (no exit handler runs, not even the guard's), on any batch of more than 3
    requests: the process is simply gone, with status 0."""

    name = "planted_exits_from_c_without_cleanup"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if _large(metadata):
            ctypes.CDLL(None)._exit(0)
        super().forward(query, kv_cache, metadata, out, layer)


class RaisesUndecodableText(TorchNaiveBackend):
    """Raises an error whose text holds an undecodable file name (a lone surrogate, as
    os.fsdecode makes of byte 0xff) and raw control characters (a terminal escape, NUL, BEL)."""

    name = "planted_raises_undecodable_text"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        name = os.fsdecode(b"/models/\xff.bin")
        raise RuntimeError(f"cannot open {name}: " + "\x1b[2J\x00\x07\x9b")


class _DiesWhenAsked(type(TorchNaiveBackend.capabilities)):
    """torch_naive's claims, but asking whether a case runs reads address 0 (SIGSEGV)."""

    def skip_reason(self, needs, device):
        ctypes.string_at(0)


class SegfaultsWhilePlanning(TorchNaiveBackend):
    """Imports cleanly, then dies in its own skip decisions (the claims every check's plan asks):
    the probe that plans the pool's units must keep its answer, not call it an import failure; the
    children that plan it again report the crash."""

    name = "planted_segfaults_while_planning"
    capabilities = _DiesWhenAsked(
        **{
            field.name: getattr(TorchNaiveBackend.capabilities, field.name)
            for field in fields(TorchNaiveBackend.capabilities)
        }
    )


class WrongOnTheColdRun(TorchNaiveBackend):
    """Wrong on the first run on this machine only (a kernel whose first, cold launch reads an
    autotune or JIT cache not yet written): ``COLD_RUN_DIR`` holds the mark of that first run. A
    warm phase that threw its results away would hide it from every check."""

    name = "planted_wrong_on_the_cold_run"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer)
        mark = Path(os.environ["COLD_RUN_DIR"]) / "ran"
        if not mark.exists():
            mark.touch()
            out.mul_(2.0)
