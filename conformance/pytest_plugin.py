"""pytest plugin (registered through the ``pytest11`` entry point): the suite inside a backend
author's own test run, and fixtures.

    pytest --conformance-backend mypkg.attn:MyBackend [--conformance-suite smoke]
           [--conformance-check numerics,syncs] [--conformance-case ID ...] [--conformance-device cuda]
           [--conformance-allow-skip]

adds one test item per check x case (``conformance[numerics-gqa-h32/8-...]``): PASS passes, SKIP
skips with the reason, FAIL / ERROR fail with the evidence; a check that skips as a whole (CUDA
graphs on a CPU) is one skipped item, not one per case. The checks default to the CLI's. Items
run in the pytest process (no crash isolation: use ``conformance run`` for that).

A green run must mean something ran: when the requested device is absent (``cuda`` without a
GPU), the backend is unavailable on it, or every conformance item skipped, the items fail (or
the session does) unless ``--conformance-allow-skip`` is given.

It also brings ``host_syncs``'s ``forbid_host_syncs`` fixture (see ``host_syncs.pytest_fixture``).
"""

from __future__ import annotations

import shlex

import pytest
import torch

from host_syncs.pytest_fixture import forbid_host_syncs, pytest_runtest_call  # noqa: F401 - registered with this plugin


def pytest_addoption(parser) -> None:
    group = parser.getgroup("conformance", "attention-backend conformance suite")
    group.addoption(
        "--conformance-backend", help="backend to check: a built-in name, an entry point, or pkg.module:Class"
    )
    group.addoption(
        "--conformance-suite",
        default="smoke",
        help="smoke | quick | standard | full (default smoke: seconds inside your own test run; the "
        "`conformance run` command defaults to standard on a GPU, quick on a CPU)",
    )
    group.addoption("--conformance-check", default=None, help="comma-separated checks (default: the CLI's)")
    group.addoption(
        "--conformance-case",
        action="append",
        default=None,
        help="run this case id instead of the suite (repeatable; a failing item prints its own)",
    )
    group.addoption("--conformance-device", default=None, help="cpu or cuda (default: cuda when visible)")
    group.addoption(
        "--conformance-allow-skip",
        action="store_true",
        help="let an absent device, an unavailable backend or an all-skipped run skip instead of fail",
    )


class BackendExited(Exception):
    """The backend asked the process to end in the middle of a case (``os._exit``, ``sys.exit``):
    in an isolated run that is a CRASH of the case; here it must not end pytest with status 0."""


_guard = {"pid": None, "in_case": False}


def _guard_exits() -> None:
    """``os._exit`` made to raise while a conformance item runs, in this process only (a forked
    child's ``os._exit`` is its normal way out). Installed before the backend is imported, so a
    backend that took ``from os import _exit`` gets the guarded one too. An ``exit`` called from
    C code cannot be caught in-process: ``conformance run`` isolates that."""
    import os
    import posix

    if _guard["pid"] is not None:
        return
    real_exit = os._exit

    def guarded_exit(status: int) -> None:
        if _guard["in_case"] and os.getpid() == _guard["pid"]:
            raise BackendExited(f"the backend called os._exit({status}) during the case")
        real_exit(status)

    _guard["pid"] = os.getpid()
    os._exit = posix._exit = guarded_exit


class ConformanceFailure(Exception):
    def __init__(self, result) -> None:
        super().__init__(result.reason)
        self.result = result


_RAN_KEY = pytest.StashKey[list]()  # conformance items that ran a case (not skipped)


class ConformanceItem(pytest.Item):
    """One check on one case; or, with ``case=None``, a check that skips as a whole here, or
    (``cannot_run``) a backend or device that cannot run at all."""

    def __init__(self, *, backend_cls, check, case, device, cannot_run: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend_cls, self.check, self.case, self.device, self.cannot_run = (
            backend_cls,
            check,
            case,
            device,
            cannot_run,
        )

    def runtest(self) -> None:
        from conformance.results import Verdict
        from conformance.run.gpu_turns import big_pool_turn

        if self.cannot_run:
            if self.config.getoption("conformance_allow_skip"):
                pytest.skip(self.cannot_run)
            pytest.fail(f"{self.cannot_run} (--conformance-allow-skip to skip instead)", pytrace=False)
        reason = self.check.skip_reason(self.backend_cls, self.device) or self.check.case_skip_reason(
            self.backend_cls, self.case, self.device
        )
        if reason:
            pytest.skip(reason)
        _guard["in_case"] = True
        try:
            with big_pool_turn(self.case, self.device):
                result = self.check.run(self.backend_cls, self.case, self.device)
        except SystemExit as error:
            raise BackendExited(f"the backend raised SystemExit({error.code!r}) during the case") from None
        finally:
            _guard["in_case"] = False
        if result.verdict == Verdict.SKIP:
            pytest.skip(result.reason)
        self.config.stash[_RAN_KEY].append(self.nodeid)
        if result.verdict != Verdict.PASS:
            raise ConformanceFailure(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, BackendExited):
            return f"CRASH: {excinfo.value}\ncase: {self.case.id}\n{self.rerun()}"
        if isinstance(excinfo.value, ConformanceFailure):
            from conformance.checks.evidence import plain_lines

            result = excinfo.value.result
            evidence = plain_lines(self.check.describe_evidence(result.evidence), block_lines=40)
            return "\n".join(
                [f"{result.verdict.value}: {result.reason}", f"case: {result.case}", self.rerun(), *evidence]
            )
        return super().repr_failure(excinfo)

    def rerun(self) -> str:
        """The command that runs this item alone (its node id holds '/' and ':', which pytest's
        command line does not take back)."""
        return "rerun: " + shlex.join(
            [
                "pytest",
                f"--conformance-backend={self.config.getoption('conformance_backend')}",
                f"--conformance-check={self.check.name}",
                f"--conformance-case={self.case.id}",
            ]
        )

    def reportinfo(self):
        return self.path, None, f"conformance {self.check.name} {self.case.id if self.case else ''}"


def pytest_collection_modifyitems(session, config, items) -> None:
    target = config.getoption("conformance_backend")
    if not target:
        return
    from backends import registry
    from backends.base import DeviceInfo
    from conformance.cases.grammar import CaseSyntaxError, parse_case
    from conformance.cases.suites import suite
    from conformance.checks import CHECKS, default_checks, make_check
    from reference_engine.device_flag import DeviceError, resolve_device

    _guard_exits()
    try:
        backend_cls = registry.load(target)
        given = config.getoption("conformance_case")
        cases = [parse_case(text) for text in given] if given else suite(config.getoption("conformance_suite"))
    except (registry.BackendLookupError, CaseSyntaxError) as error:
        raise pytest.UsageError(str(error)) from None
    option = config.getoption("conformance_check")
    checks = default_checks() if option is None else [name.strip() for name in option.split(",") if name.strip()]
    unknown = [name for name in checks if name not in CHECKS]
    if unknown or not checks:
        raise pytest.UsageError(
            f"unknown check {unknown[0]!r} (choose from {', '.join(CHECKS)})"
            if unknown
            else "--conformance-check names no check"
        )
    try:
        device, cannot_run = resolve_device(config.getoption("conformance_device"), "--conformance-device"), None
    except DeviceError as error:
        if not error.absent:
            raise pytest.UsageError(str(error)) from None
        device, cannot_run = torch.device("cpu"), str(error)
    if cannot_run is None:
        unavailable = backend_cls.availability_reason(DeviceInfo.of(device))
        cannot_run = f"{target} is not available on {device}: {unavailable}" if unavailable else None
    config.stash[_RAN_KEY] = []
    for check_name in checks:
        check = make_check(check_name)  # one instance per check, as a run has: some keep state across cases
        whole = cannot_run or check.skip_reason(backend_cls, device)
        if whole:  # one item, not one per case: the count says what really ran
            items.append(
                ConformanceItem.from_parent(
                    session,
                    name=f"conformance[{check_name}]",
                    backend_cls=backend_cls,
                    check=check,
                    case=None,
                    device=device,
                    cannot_run=cannot_run,
                )
            )
            continue
        for case in cases:
            items.append(
                ConformanceItem.from_parent(
                    session,
                    name=f"conformance[{check_name}-{case.id}]",
                    backend_cls=backend_cls,
                    check=check,
                    case=case,
                    device=device,
                )
            )


def pytest_sessionfinish(session, exitstatus) -> None:
    """Every conformance item skipped: nothing was checked, and that must not read as green."""
    config = session.config
    ran = config.stash.get(_RAN_KEY, None)
    if ran is None or ran or config.getoption("conformance_allow_skip") or exitstatus != pytest.ExitCode.OK:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            "conformance: every conformance item was skipped, nothing was checked (--conformance-allow-skip to accept)",
            red=True,
        )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
