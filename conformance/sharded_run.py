"""``conformance run --gpus all|0,1,... [--workers N]``: the run spread over pytest-xdist workers.

The CLI does not schedule anything itself: it runs pytest with this package's plugin under
pytest-xdist (``-n N --dist loadgroup``), which gives each worker a GPU, keeps each backend's
check on one worker, and merges every worker's results into the results JSON the CLI then reports
from as after any run. A case that crashes or hangs past ``--timeout`` ends its worker: the case
is CRASH and a fresh worker goes on.

pytest runs in a folder of its own with an empty configuration, so neither the tests nor the
``pytest.ini`` of the folder the command was started from take part; plugins are not
auto-loaded, only xdist and ours.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from conformance.cases.grammar import Case
from conformance.run.isolation import DIE_WITH_PARENT, child_env

PYTEST_USAGE_ERROR = 4


class ShardFailed(Exception):
    """pytest ended without writing results (an internal error, a plugin that failed to load)."""


class ShardingUnavailable(Exception):
    """pytest-xdist is not installed: one line saying how to get it."""


@dataclass
class ShardedRun:
    backends: list[str]
    checks: list[str]
    cases: list[Case]
    suite: str | None  # the suite's name, or None for --case cases (passed one by one)
    seed: int | None
    device: str  # "cuda" (each worker's one GPU) or "cpu"
    gpus: str | None  # the --gpus value, None for CPU workers
    workers: int
    case_timeout_s: float
    sync_detector: str
    prefill_backend: str

    def pytest_arguments(self, json_path: Path, folder: Path) -> list[str]:
        arguments = [
            "-p",
            "xdist.plugin",
            "-p",
            "conformance.pytest_plugin",
            "-p",
            "no:cacheprovider",
            "-c",
            str(folder / "pytest.ini"),
            "--rootdir",
            str(folder),
            "-q",
            "--tb=no",  # the CLI prints the failures itself, from the results
            "-rN",
            "-n",
            str(self.workers),
            "--dist",
            "loadgroup",
            # A backend that crashes in every case must not run out of fresh workers.
            "--max-worker-restart",
            str(max(4, len(self.backends) * len(self.checks) * len(self.cases))),
            "--conformance-backend",
            ",".join(self.backends),
            "--conformance-check",
            ",".join(self.checks),
            "--conformance-device",
            self.device,
            "--conformance-allow-skip",  # the CLI decides what an all-skipped run means (exit 3)
            "--conformance-timeout",
            str(self.case_timeout_s),
            "--conformance-sync-detector",
            self.sync_detector,
            "--conformance-prefill-backend",
            self.prefill_backend,
            "--conformance-json",
            str(json_path),
        ]
        if self.gpus is not None:
            arguments += ["--conformance-gpus", self.gpus]
        if self.suite is None:
            for case in self.cases:
                arguments += ["--conformance-case", case.id]
        else:
            arguments += ["--conformance-suite", self.suite]
            if self.seed is not None:
                arguments += ["--conformance-seed", str(self.seed)]
        return arguments + [str(folder)]


def require_xdist() -> None:
    try:
        import xdist  # noqa: F401
    except ImportError:
        raise ShardingUnavailable(
            "--gpus and --workers run the suite under pytest-xdist, which is not installed: "
            "pip install 'specdec-conformance[xdist]'"
        ) from None


def run_sharded(run: ShardedRun, json_path: Path, quiet: bool) -> int | None:
    """Runs pytest; the results are then in ``json_path``. Returns the signal that stopped the run,
    or None. SIGINT or SIGTERM meanwhile is passed on to pytest as SIGINT (once: a second would cut
    short its writing), after which it stops its workers and writes what finished, marked
    interrupted."""
    received: list[int] = []
    with tempfile.TemporaryDirectory(prefix="conformance-pytest-") as folder:
        Path(folder, "pytest.ini").write_text("[pytest]\n")
        env = child_env()
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        command = [sys.executable, "-m", "pytest", *run.pytest_arguments(json_path, Path(folder))]
        child = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL if quiet else sys.stderr,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=DIE_WITH_PARENT,  # a killed `conformance` leaves no pytest (and so no workers) behind
            # Out of the terminal's foreground group: Ctrl-C reaches pytest only as the one SIGINT
            # passed on below (a second one cuts its writing of the results short).
            start_new_session=True,
        )

        def forward(signum, frame) -> None:
            if not received and child.poll() is None:
                child.send_signal(signal.SIGINT)
            received.append(signum)

        previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            _, errors = child.communicate()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if child.returncode == PYTEST_USAGE_ERROR or not json_path.exists():
        lines = [line for line in (errors or "").splitlines() if line.strip()]
        raise ShardFailed(
            f"pytest exited with status {child.returncode} without results: {lines[-1] if lines else 'no message'}"
        )
    if errors and not quiet:
        sys.stderr.write(errors)
    return received[0] if received else None
