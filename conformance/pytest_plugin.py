"""pytest plugin (registered through the ``pytest11`` entry point): the suite inside a backend
author's own test run, and fixtures.

    pytest --conformance-backend mypkg.attn:MyBackend [--conformance-suite smoke]
           [--conformance-check numerics,syncs] [--conformance-case ID ...] [--conformance-device cuda]
           [--conformance-allow-skip] [--conformance-json results.json]

adds one test item per check x case (``conformance[numerics-gqa-h32/8-...]``; with several
backends, ``conformance[triton-numerics-...]``): PASS passes, SKIP skips with the reason, FAIL /
ERROR fail with the evidence; a check that skips as a whole (CUDA graphs on a CPU) is one skipped
item, not one per case. The checks default to the CLI's. Each case runs as a ``conformance run``
child runs it (``execution.run_case``, the harness sealed), in the pytest process: no crash
isolation there; use ``conformance run``, or pytest-xdist, for that.

On several workers (pytest-xdist): ``pytest -n K --conformance-backend a,b`` runs the items on K
workers under xdist's ordinary scheduling (``--dist load``, the default for ``-n``). Each item
stands alone (a check plans its skips over the whole suite in every process), so one check's
items may run on different workers; each worker runs on the device it sees (a big-pool case
still takes its GPU's turn), and the results of every worker are merged into one results JSON
and reports (``pytest_results``). A worker that dies under an item (or hangs past
``--conformance-timeout``) makes that case CRASH, and a fresh worker goes on with the rest. Over
several GPUs, use ``conformance run --gpus``: its own pool of isolated children, one GPU each.

A green run must mean something ran: when the requested device is absent (``cuda`` without a
GPU), the backend is unavailable on it, or every conformance item skipped, the items fail (or
the session does) unless ``--conformance-allow-skip`` is given.

It also brings ``host_syncs``'s ``forbid_host_syncs`` fixture (see ``host_syncs.pytest_fixture``).
"""

from __future__ import annotations

import faulthandler
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance.pytest_results import PlannedCase, ResultCollector, event_property
from conformance.report.output_paths import OutputPathError, check_files
from conformance.run import exit_guard
from conformance.run.reaper import Spawned
from conformance.run.results_lock import ResultsInUse, ResultsLock
from conformance.run.runner import (
    SYNC_DETECTORS,
    OptionError,
    backend_names,
    check_names,
    check_options,
    positive_seconds,
    run_cases,
    run_device,
    run_suite,
)
from host_syncs.pytest_fixture import forbid_host_syncs, pytest_runtest_call  # noqa: F401 - registered with this plugin


def pytest_addoption(parser) -> None:
    group = parser.getgroup("conformance", "attention-backend conformance suite")
    group.addoption(
        "--conformance-backend",
        help="backend(s) to check, comma-separated: a built-in name, an entry point, or pkg.module:Class",
    )
    group.addoption(
        "--conformance-suite",
        default="smoke",
        help="smoke | quick | standard | full (default smoke: seconds inside your own test run, one case of each "
        "kind of batch; not a gate: no fp8 cache, sinks, log-sum-exp, empty requests or long context. quick and "
        "standard are the gates; `conformance run` defaults to standard on a GPU, quick on a CPU)",
    )
    group.addoption("--conformance-check", default=None, help="comma-separated checks (default: the CLI's)")
    group.addoption(
        "--conformance-case",
        action="append",
        default=None,
        help="run this case id instead of the suite (repeatable; a failing item prints its own)",
    )
    group.addoption("--conformance-seed", type=int, default=None, help="draw the suite's data with this seed")
    group.addoption("--conformance-device", default=None, help="cpu or cuda (default: cuda when visible)")
    group.addoption(
        "--conformance-allow-skip",
        action="store_true",
        help="let an absent device, an unavailable backend or an all-skipped run skip instead of fail",
    )
    group.addoption(
        "--conformance-sync-detector",
        default="auto",
        choices=SYNC_DETECTORS,
        help="host-sync detector for the syncs check (default auto)",
    )
    group.addoption(
        "--conformance-prefill-backend",
        default="auto",
        help="the engine check's prefill backend beside a decode-only one (default auto)",
    )
    group.addoption("--conformance-json", help="write the run's results JSON here (one file, every worker merged)")
    group.addoption("--conformance-html", help="also write the HTML report here")
    group.addoption("--conformance-markdown", help="also write the Markdown summary here")
    group.addoption(
        "--conformance-timeout",
        type=float,
        default=None,
        help="with pytest-xdist workers (-n K): seconds a case may run before its worker is ended (the case "
        "is CRASH and a fresh worker goes on)",
    )


class ConformanceFailure(Exception):
    def __init__(self, result) -> None:
        super().__init__(result.reason)
        self.result = result


@dataclass
class Plan:
    """What the options ask for, decided once per process: the backends (loaded after the harness
    was sealed), checks, cases, device, and the check options a ``conformance run`` passes."""

    backends: list[str]
    classes: dict[str, type]
    checks: list[str]
    cases: list
    device: torch.device
    cannot_run: dict[str, str | None]  # backend -> why it cannot run on this device (None: it can)
    unavailable: dict[str, str | None]  # the same reason as the results say it (without the backend's name)
    check_options: dict[str, Any]
    suite: str
    seal: Any
    import_changes: dict[str, list[str]]  # backend -> what its import changed: its first case's ERROR here
    load_failures: dict[str, tuple[Any, str]]  # backend -> (verdict, why) for one whose import raised or exited
    skips: dict = field(default_factory=dict)  # (backend, check) -> case id -> skip reason, as decided
    stopped: str | None = None  # why this process must run no more cases (a sticky CUDA error)
    processes: Spawned = field(default_factory=Spawned)  # what backends started here: ended with the session

    def item_name(self, backend: str, check: str, case_id: str | None) -> str:
        parts = ([backend] if len(self.backends) > 1 else []) + [check] + ([case_id] if case_id else [])
        return f"conformance[{'-'.join(parts)}]"

    def case_items(self) -> dict[str, PlannedCase]:
        return {
            self.item_name(backend, check, case.id): PlannedCase(backend, check, case)
            for backend in self.backends
            for check in self.checks
            for case in self.cases
        }


_PLAN_KEY = pytest.StashKey[Plan]()
_COLLECTOR_KEY = pytest.StashKey[ResultCollector]()
_LOCK_KEY = pytest.StashKey[Any]()


def _plan(config) -> Plan:

    from backends import registry
    from backends.base import DeviceInfo
    from conformance.run.execution import load_backend
    from conformance.run.seal import Seal

    exit_guard.install()
    seal = Seal.take()  # before any backend is imported, as a run's child takes it
    if os.getcwd() not in sys.path:  # a pkg.module:Class in the current folder loads as `conformance run` loads it
        sys.path.insert(0, os.getcwd())
    case_texts, suite = config.getoption("conformance_case"), config.getoption("conformance_suite")
    option = config.getoption("conformance_check")
    try:  # each option checked as `conformance run` checks its flag, in the same words
        names = backend_names([config.getoption("conformance_backend")], "--conformance-backend")
        prefill = config.getoption("conformance_prefill_backend")
        if prefill != "auto":
            backend_names([prefill], "--conformance-prefill-backend")
        cases = run_cases(case_texts, suite, config.getoption("conformance_seed"), "--conformance-case")
        checks = check_names(None if option is None else [option], "--conformance-check")
        positive_seconds(("--conformance-timeout", config.getoption("conformance_timeout")))
        try:
            device, absent = run_device(config.getoption("conformance_device"), "--conformance-device"), None
        except OptionError as error:
            if not error.absent:
                raise
            device, absent = torch.device("cpu"), str(error)  # each item fails (or skips) saying so
    except OptionError as error:
        raise pytest.UsageError(str(error)) from None
    refs = [registry.resolve(name) for name in names]
    classes, import_changes, load_failures = {}, {}, {}
    for ref in refs:
        # As a run's child loads it: a typo is the command's mistake; an import that raises or
        # exits is that backend's ERROR or CRASH, and the other backends run.
        loaded = load_backend(ref)
        if loaded.mistyped:
            raise pytest.UsageError(loaded.failure)
        if loaded.failure:
            load_failures[ref.name] = (loaded.failure_verdict, loaded.failure)
        else:
            classes[ref.name] = loaded.backend_cls
            import_changes[ref.name] = seal.changes()  # put back; charged to this backend, not the first case run
    cannot_run, why = dict.fromkeys(load_failures), dict.fromkeys(load_failures)
    for name, backend_cls in classes.items():
        unavailable = None if absent else backend_cls.availability_reason(DeviceInfo.of(device))
        cannot_run[name] = absent or (f"{name} is not available on {device}: {unavailable}" if unavailable else None)
        why[name] = absent or unavailable
    suite_name = run_suite(case_texts, suite)
    options = check_options(config.getoption("conformance_sync_detector"), prefill, suite_name)
    return Plan(
        names, classes, checks, cases, device, cannot_run, why, options, suite_name, seal, import_changes, load_failures
    )


def _distributed(config) -> bool:
    """This process is pytest-xdist's controller of workers (``-n N``, N > 0)."""
    return config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput and "workercount" in workerinput and config.getoption("conformance_backend"):
        # The workers share the cores: torch's default of one thread a core in each of them
        # oversubscribes the machine, and OpenMP's spinning threads then slow every worker many times.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workerinput["workercount"]))
    if not config.getoption("conformance_backend"):
        return
    if config.getoption("conformance_timeout") is not None and workerinput is None and not _distributed(config):
        # Only a worker can be ended and replaced: in the only process, a limit would end the session.
        raise pytest.UsageError("--conformance-timeout ends a pytest-xdist worker that runs past it: add -n N")
    plan = config.stash[_PLAN_KEY] = _plan(config)
    if workerinput is None:  # the process that reports: the controller, or the only one
        _claim_outputs(config)
        collector = ResultCollector(
            plan.backends,
            plan.classes,
            plan.checks,
            plan.cases,
            plan.check_options,
            plan.suite,
            plan.case_items(),
            load_failures=plan.load_failures,
        )
        if config.getoption("conformance_json"):
            from conformance.run.journal import Journal
            from conformance.run.runner import Progress

            collector.journal = Journal(Path(config.getoption("conformance_json")), Progress())
        config.stash[_COLLECTOR_KEY] = collector
        config.pluginmanager.register(collector, "conformance-results")


def _outputs(config) -> dict[str, str | None]:
    return {
        "--conformance-json": config.getoption("conformance_json"),
        "--conformance-html": config.getoption("conformance_html"),
        "--conformance-markdown": config.getoption("conformance_markdown"),
    }


def _claim_outputs(config) -> None:
    """As a ``conformance run`` does before any work: every output path writable and distinct,
    none the lock or journal of the results; the results file's lock taken for the session (a
    run already writing it is refused); an earlier session's files removed, so that an
    interrupted one leaves none of them looking current."""
    outputs = _outputs(config)
    json_path = outputs["--conformance-json"]
    try:
        check_files(outputs, results=Path(json_path) if json_path else None)
        if json_path:
            config.stash[_LOCK_KEY] = ResultsLock(Path(json_path)).acquire()
    except (OutputPathError, ResultsInUse) as error:  # another run or session writing the same results too
        raise pytest.UsageError(str(error)) from None
    for path in outputs.values():
        if path:
            Path(path).unlink(missing_ok=True)


def pytest_unconfigure(config) -> None:
    lock = config.stash.get(_LOCK_KEY, None)
    if lock is not None:
        lock.release()


class BackendCollector(pytest.Collector):
    """A backend's items' parent: their node ids read ``BACKEND::conformance[...]`` (a summary line
    names the backend, not an empty path). The items are made in ``pytest_collection_modifyitems``."""

    def collect(self):
        return []


class ConformanceItem(pytest.Item):
    """One check on one case of one backend; or, with ``case=None``, a check that skips as a whole
    here, or (``cannot_run``) a backend or device that cannot run at all."""

    def __init__(self, *, backend, check, case, plan: Plan, **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend, self.check, self.case, self.plan = backend, check, case, plan
        self.backend_cls = plan.classes.get(backend)  # None: its import failed (plan.load_failures)
        self.device = plan.device
        self.cannot_run = plan.cannot_run[backend]

    def emit(self, event: dict[str, Any]) -> None:
        """The item's result as an event, carried in its report to the process that reports."""
        self.user_properties.append(event_property(self.backend, event))

    def runtest(self) -> None:
        from conformance.results import CaseResult, Verdict
        from conformance.run.execution import tampered

        if self.backend in self.plan.load_failures:  # its results row comes from the plan, as a run's from its probe
            verdict, why = self.plan.load_failures[self.backend]
            pytest.fail(f"{verdict.value}: {why}", pytrace=False)
        if self.cannot_run:
            self.emit({"event": "unavailable", "reason": self.plan.unavailable[self.backend]})
            if self.config.getoption("conformance_allow_skip"):
                pytest.skip(self.cannot_run)
            pytest.fail(f"{self.cannot_run} (--conformance-allow-skip to skip instead)", pytrace=False)
        reason = self.check.skip_reason(self.backend_cls, self.device)
        if reason or self.case is None:
            self.emit({"event": "check_skipped", "check": self.check.name, "reason": reason})
            pytest.skip(reason)
        reason = self.case_skip_reason()
        result = CaseResult(self.case.id, Verdict.SKIP, reason, tag=self.case.tag) if reason else self.run_case()
        # As a run's child checks after each case: what changed since, and on this backend's first
        # case in this process, what its import changed.
        changes = self.plan.import_changes.pop(self.backend, []) + self.plan.seal.changes()
        if changes:
            result = tampered(result, changes)
        self.emit({"event": "result", "check": self.check.name, "result": result.to_dict()})
        if result.verdict == Verdict.SKIP:
            pytest.skip(result.reason)
        if result.verdict != Verdict.PASS:
            raise ConformanceFailure(result)

    def case_skip_reason(self) -> str | None:
        """The check's skip decision for this case: its plan of the suite's cases (``Check.plan``),
        made once a process, the same in every worker."""
        key = (self.backend, self.check.name)
        if key not in self.plan.skips:
            self.plan.skips[key] = self.check.plan(self.backend_cls, self.plan.cases, self.device)
        return self.plan.skips[key][self.case.id]

    def run_case(self):
        from conformance.run.execution import run_case

        timeout = self.config.getoption("conformance_timeout")
        watched = timeout is not None and hasattr(self.config, "workerinput")
        if watched:  # ends the worker (C-level _exit, past the exit guard): xdist reports the item crashed
            faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            with self.plan.processes.watching():  # what the backend starts is ended with the session
                result, fatal = run_case(self.check, self.backend_cls, self.case, self.device)
            if fatal:
                self.plan.stopped = (
                    f"a sticky CUDA error in {self.backend}'s case {self.case.id} left this process's CUDA "
                    "context unusable"
                )
        finally:
            if watched:
                faulthandler.cancel_dump_traceback_later()
        return result

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            from conformance.harness.evidence import plain_lines

            result = excinfo.value.result
            evidence = plain_lines(self.check.describe_evidence(result.evidence), block_lines=40)
            return "\n".join(
                [f"{result.verdict.value}: {result.reason}", f"case: {result.case}", self.rerun(), *evidence]
            )
        return super().repr_failure(excinfo)

    def rerun(self) -> str:
        """The command that runs this item alone (its node id holds '/' and ':', which pytest's
        command line does not take back); ``python -m`` finds pytest wherever the package is."""
        return "rerun: " + shlex.join(
            [
                "python",
                "-m",
                "pytest",
                f"--conformance-backend={self.backend}",
                f"--conformance-check={self.check.name}",
                f"--conformance-case={self.case.id}",
            ]
        )

    def reportinfo(self):
        return self.path, None, f"conformance {self.check.name} {self.case.id if self.case else ''}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a case whose sticky CUDA error left the context unusable (its result reported), no
    case may run in this process, as no case runs after it in a ``conformance run`` child. A
    pytest-xdist worker ends, so that a fresh one takes the rest (xdist then reports this item
    crashed too; ``ResultCollector`` keeps the CRASH it already sent). Without xdist the session
    stops, and the cases left are "not run", saying why."""
    outcome = yield
    plan = item.config.stash.get(_PLAN_KEY, None)
    if plan is not None and plan.stopped:
        if hasattr(item.config, "workerinput"):
            exit_guard.real_exit(70)
        item.session.shouldfail = plan.stopped  # as -x stops: a failed run, not an interrupted one
    return outcome


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which appends each item's group to its node id
def pytest_collection_modifyitems(session, config, items) -> None:
    plan = config.stash.get(_PLAN_KEY, None)
    if plan is None:
        return
    from conformance.checks import make_check

    for backend in plan.backends:
        cannot_run = plan.cannot_run[backend]
        parent = BackendCollector.from_parent(session, name=backend, nodeid=backend)
        for check_name in plan.checks:
            check = make_check(check_name, plan.check_options)  # one instance per check, as in a run
            whole = backend in plan.load_failures or cannot_run or check.skip_reason(plan.classes[backend], plan.device)
            for case in [None] if whole else plan.cases:  # a whole skip is one item: the count says what ran
                item = ConformanceItem.from_parent(
                    parent,
                    name=plan.item_name(backend, check_name, case.id if case else None),
                    backend=backend,
                    check=check,
                    case=case,
                    plan=plan,
                )
                items.append(item)


def pytest_sessionfinish(session, exitstatus) -> None:
    """The results document, where asked for; and every conformance item skipped: nothing was
    checked, and that must not read as green."""
    config = session.config
    plan = config.stash.get(_PLAN_KEY, None)
    if plan is not None:
        plan.processes.end()
    collector = config.stash.get(_COLLECTOR_KEY, None)
    if collector is None:
        return
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop)
    workers = config.getoption("numprocesses", None) if _distributed(config) else None
    extra = {"pytest_workers": workers} if workers else {}
    result = collector.run_result(plan.device, interrupted, extra, plan.stopped)
    _write_outputs(session, result, collector)
    if result.ran_anything() or config.getoption("conformance_allow_skip") or exitstatus != pytest.ExitCode.OK:
        return
    _complain(config, "every conformance item was skipped, nothing was checked (--conformance-allow-skip to accept)")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _complain(config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        if reporter._tw.width_of_current_line:  # after a line of progress dots
            reporter._tw.line()
        reporter.write_line(f"conformance: {line}", red=True)


def _write_outputs(session, result, collector) -> None:
    """The results JSON and the reports, as a run writes them: each on its own (one that cannot be
    written is one line and a failed session, the others still written), the reports not from an
    interrupted session (``conformance report --allow-interrupted`` makes them from its JSON)."""
    from conformance.report.outputs import write_outputs  # after the last case: the seal is done with

    config = session.config
    json_path = config.getoption("conformance_json")
    reports = (
        {}
        if result.interrupted
        else {
            "html": config.getoption("conformance_html"),
            "markdown": config.getoption("conformance_markdown"),
        }
    )
    written = write_outputs(result, Path(json_path) if json_path else None, reports)
    if collector.journal is not None:
        if json_path and Path(json_path) in written.written:
            collector.journal.remove()
        else:
            collector.journal.close()
    if written.failed:
        kept = f"; {collector.journal.kept()}" if collector.journal is not None and json_path else ""
        _complain(config, f"{written.summary()}{kept}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
