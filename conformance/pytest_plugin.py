"""pytest plugin (registered through the ``pytest11`` entry point): the suite inside a backend
author's own test run, and fixtures.

    pytest --conformance-backend mypkg.attn:MyBackend [--conformance-suite smoke]
           [--conformance-check numerics,syncs] [--conformance-device cuda]

adds one test item per check x case (``conformance[numerics-gqa-h32/8-...]``): PASS passes, SKIP
skips with the reason, FAIL / ERROR fail with the evidence. Items run in the pytest process (no
crash isolation: use ``conformance run`` for that).

``forbid_host_syncs``: fails the test if its body makes a host-blocking CUDA call, listing each
one with the Python line that made it::

    def test_build_is_async(forbid_host_syncs, my_backend, common):
        my_backend.build(common)          # a seq_lens.cpu() in here fails the test

Use ``forbid_host_syncs.paused()`` around set-up that may sync. Without CUDA the test is skipped.
"""
from __future__ import annotations

import json

import pytest
import torch

from conformance.host_syncs.detector import HostSyncDetector, format_events

_DETECTOR_KEY = pytest.StashKey[HostSyncDetector]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("conformance", "attention-backend conformance suite")
    group.addoption("--conformance-backend", help="backend to check: a built-in name, an entry point, or pkg.module:Class")
    group.addoption("--conformance-suite", default="smoke", help="smoke | standard | full (default smoke)")
    group.addoption("--conformance-check", default="numerics,syncs,graphs,draft-loop,determinism", help="comma-separated checks")
    group.addoption("--conformance-device", default=None, help="cpu or cuda (default: cuda when visible)")


class ConformanceFailure(Exception):
    def __init__(self, result) -> None:
        super().__init__(result.reason)
        self.result = result


class ConformanceItem(pytest.Item):
    def __init__(self, *, backend_cls, check_name: str, case, device, **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend_cls, self.check_name, self.case, self.device = backend_cls, check_name, case, device

    def runtest(self) -> None:
        from conformance.checks import make_check
        from conformance.results import Verdict

        check = make_check(self.check_name)
        reason = check.skip_reason(self.backend_cls, self.device) or check.case_skip_reason(self.backend_cls, self.case, self.device)
        if reason:
            pytest.skip(reason)
        result = check.run_case(self.backend_cls, self.case, self.device)
        if result.verdict == Verdict.SKIP:
            pytest.skip(result.reason)
        if result.verdict != Verdict.PASS:
            raise ConformanceFailure(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            result = excinfo.value.result
            evidence = json.dumps(result.evidence, indent=1, default=str)[:4000] if result.evidence else ""
            return f"{result.verdict.value}: {result.reason}\ncase: {result.case}\n{evidence}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"conformance {self.check_name} {self.case.id}"


def pytest_collection_modifyitems(session, config, items) -> None:
    target = config.getoption("conformance_backend")
    if not target:
        return
    from backends import registry
    from conformance.cases import CaseSyntaxError, suite
    from conformance.checks import CHECKS

    try:
        backend_cls = registry.load(target)
        cases = suite(config.getoption("conformance_suite"))
    except (registry.BackendLookupError, CaseSyntaxError) as error:
        raise pytest.UsageError(str(error)) from None
    checks = [name.strip() for name in config.getoption("conformance_check").split(",") if name.strip()]
    unknown = [name for name in checks if name not in CHECKS]
    if unknown:
        raise pytest.UsageError(f"unknown check {unknown[0]!r} (choose from {', '.join(CHECKS)})")
    device_name = config.getoption("conformance_device") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_name)
    for check_name in checks:
        for case in cases:
            items.append(ConformanceItem.from_parent(
                session, name=f"conformance[{check_name}-{case.id}]", backend_cls=backend_cls, check_name=check_name,
                case=case, device=device,
            ))


@pytest.fixture
def forbid_host_syncs(request):
    if not torch.cuda.is_available():
        pytest.skip("forbid_host_syncs needs a CUDA device")
    detector = HostSyncDetector("auto")
    with detector:
        request.node.stash[_DETECTOR_KEY] = detector
        yield detector


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # Judged right after the test body, so a sync fails the test itself (not its teardown).
    result = yield
    detector = item.stash.get(_DETECTOR_KEY, None)
    if detector is not None and detector.blocking_events:
        blocking = detector.blocking_events
        pytest.fail(
            f"{len(blocking)} host-blocking CUDA call(s) (detector: {detector.strategy_name}):\n" + format_events(blocking),
            pytrace=False,
        )
    return result
