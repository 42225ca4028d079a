"""The plugin's results document: every item's result gathered where pytest reports, into the
``RunResult`` a ``conformance run`` writes (``--conformance-json``, ``--conformance-html``,
``--conformance-markdown``).

Each conformance item carries its result as an event (the same events an isolated child sends,
``conformance.run.execution``) in its report's ``user_properties``, which pytest-xdist sends from
the worker that ran it to the controller. The controller (or the only process, without xdist)
feeds them to one ``BackendEvents`` per backend and assembles the checks exactly as the runner
does. An item whose worker died under it (a crash, an ``exit`` from C code, a hang past
``--conformance-timeout``) has a report but no event: its case is CRASH. A case nobody reported
is ERROR "not run", as in a ``conformance run``.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from conformance.cases.grammar import Case
from conformance.results import BackendResult, CaseResult, RunResult, Verdict
from conformance.run.environment import collect_environment
from conformance.run.isolation import BackendEvents
from conformance.run.journal import Journal
from conformance.run.runner import annotate_bench_ratios, assemble_checks, failed_backend, unavailable_checks

EVENT_PROPERTY = "conformance_event"  # the user_properties key of an item's result event


def event_property(backend: str, event: dict[str, Any]) -> tuple[str, str]:
    """What an item appends to its ``user_properties``: JSON text, which every xdist transport carries."""
    return EVENT_PROPERTY, json.dumps({"backend": backend, "event": event})


@dataclass
class PlannedCase:
    backend: str
    check: str
    case: Case


@dataclass(eq=False)
class ResultCollector:
    """Registered as a plugin on the reporting process; ``case_items`` maps a case item's name
    (``conformance[...]``) to what it runs, for the reports that carry no event. Compared by
    identity (``eq=False``) so that it stays hashable: pytest 9.0 keeps the plugins whose fixtures
    it has parsed in a set."""

    backends: list[str]
    backend_classes: dict[str, type]
    checks: list[str]
    cases: list[Case]
    check_options: dict[str, Any]
    suite: str
    case_items: dict[str, PlannedCase]
    events: dict[str, BackendEvents] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    journal: Journal | None = None  # each event as it lands, so that a run killed outright keeps it
    load_failures: dict[str, tuple[Verdict, str]] = field(default_factory=dict)  # backend -> its import's verdict

    def pytest_runtest_logreport(self, report) -> None:
        # An item's events ride on each of its later phases' reports (call, then teardown): taken once, from the call.
        recorded = [json.loads(value) for key, value in report.user_properties if key == EVENT_PROPERTY]
        if report.when == "call":
            for item in recorded:
                self._record(item["backend"], item["event"])
        planned = self.case_items.get(item_name(report.nodeid))
        if planned is None:
            return
        # A failed report without a result, for an item that has none yet. One whose result came
        # first is a worker that ended after reporting it (a sticky CUDA error): xdist then reports
        # that item crashed too, and its result stands.
        unreported = report.failed and not recorded and not self._reported(planned)
        if report.when == "call" or unreported:
            self.seconds[planned.backend] = self.seconds.get(planned.backend, 0.0) + (report.duration or 0.0)
        if unreported:
            # The worker died under the item (xdist reports it "crashed"), or the plugin itself failed.
            lines = (report.longreprtext or "").strip().splitlines() or ["the item failed without a result"]
            crash = next((line for line in lines if "crashed while running" in line), None)
            verdict = Verdict.CRASH if crash else Verdict.ERROR
            worker = crash.split("'")[1] if crash and crash.count("'") >= 2 else "?"
            reason = (
                f"pytest worker {worker} died during the case: a crash, an exit from C code, or a hang past "
                "--conformance-timeout (a fresh worker went on with the rest)"
                if crash
                else lines[-1]
            )
            result = CaseResult(planned.case.id, verdict, reason[:400], tag=planned.case.tag)
            self._record(planned.backend, {"event": "result", "check": planned.check, "result": result.to_dict()})

    def _record(self, backend: str, event: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.event(backend, event)
        if event["event"] == "unavailable":
            self.unavailable[backend] = event["reason"]
        else:
            self.events.setdefault(backend, BackendEvents()).record(event)

    def _reported(self, planned: PlannedCase) -> bool:
        events = self.events.get(planned.backend)
        return events is not None and (planned.check, planned.case.id) in events.results

    def run_result(
        self, device, interrupted: bool, environment_extra: dict[str, Any], stopped: str | None = None
    ) -> RunResult:
        """``stopped``: why the only process ran no more cases (the cases left are "not run" for it)."""
        from backends import registry

        not_run = "not run: no pytest worker reported this case"
        if interrupted or stopped:
            not_run = "not run: the run was interrupted" if interrupted else f"not run: {stopped}"
        results = []
        for name in self.backends:
            ref = registry.resolve(name)
            if name in self.load_failures:  # its import raised or exited: every check says so, as a run's probe row
                verdict, why = self.load_failures[name]
                results.append(failed_backend(name, ref.origin, verdict, why, self.checks))
                continue
            claims = self.backend_classes[name].capabilities.to_dict()
            if name in self.unavailable:
                reason = self.unavailable[name]
                checks = unavailable_checks(self.checks, reason)
                results.append(BackendResult(name, False, reason, ref.origin, claims, checks))
                continue
            events = self.events.get(name, BackendEvents())
            checks = assemble_checks(self.checks, self.cases, events, self.check_options, not_run)
            # Process-seconds: the items' times summed over every worker that ran them.
            wall_s = round(self.seconds.get(name, 0.0), 3)
            results.append(BackendResult(name, True, "", ref.origin, claims, checks, wall_s=wall_s))
        annotate_bench_ratios(results)
        command = shlex.join(["pytest", *sys.argv[1:]])  # collect_environment names a `conformance` command
        environment = {**collect_environment(device), "command": command, **environment_extra}
        return RunResult(environment, results, self.suite, list(self.checks), interrupted=interrupted)


def item_name(nodeid: str) -> str:
    """A conformance item's name from its node id: the name ends at the id's last ``]`` (a case id
    holds ``@seed`` itself, and pytest-xdist may still append a suffix to a node id)."""
    start = nodeid.find("conformance[")
    end = nodeid.rfind("]")
    return nodeid[start : end + 1] if start >= 0 and end > start else nodeid
