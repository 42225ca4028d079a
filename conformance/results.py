"""The results document: versioned JSON that every report writer and ``compare`` reads.

{schema_version, environment, suite, checks, backends: [
    {name, origin, available, reason, claims, checks: [
        {name, verdict, summary, cases: [{case, tag, verdict, reason, metrics, evidence}]}]}]}
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from conformance.atomic_write import write_atomically

SCHEMA_VERSION = 1
GATED_METRICS = (
    "max_abs_error",
    "forward_us",
    "GBps",
    "roofline_fraction",
    "build_us",
    "replay_us",
)  # what compare and reports do arithmetic on


class Verdict(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"  # claim not made, or not available here; the reason says which
    ERROR = "ERROR"  # the backend raised
    CRASH = "CRASH"  # the isolated child died (or hung past its time limit)

    @property
    def is_failure(self) -> bool:
        return self in (Verdict.FAIL, Verdict.ERROR, Verdict.CRASH)


# Worst first: a check's verdict is the worst of its cases'.
_SEVERITY = [Verdict.CRASH, Verdict.ERROR, Verdict.FAIL, Verdict.PASS, Verdict.SKIP]


def worst(verdicts) -> Verdict:
    verdicts = set(verdicts)
    for verdict in _SEVERITY:
        if verdict in verdicts:
            return verdict
    return Verdict.SKIP


def _to_json(result) -> dict[str, Any]:
    """A result's fields as JSON: a verdict by its name, nested results through their own ``to_dict``."""
    data = {}
    for name in (f.name for f in fields(result)):
        value = getattr(result, name)
        if isinstance(value, Verdict):
            value = value.value
        elif isinstance(value, list):
            value = [item.to_dict() if hasattr(item, "to_dict") else item for item in value]
        data[name] = value
    return data


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a field's declared type (a float field takes an integer, no
    field takes a boolean for a number; a dict's keys are strings, its values anything)."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_conforms(value, option) for option in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool):
        return type(value) is hint
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, str) and value in {member.value for member in hint}
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(isinstance(key, str) for key in value)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(element, item) for element in value)
    return False


def _from_json(result_class, data: Any, **nested):
    """The inverse of ``_to_json``: missing keys take the field's default, unknown keys are ignored
    (a newer writer's extra field), ``nested`` names the list fields of results and their class.
    A value not of its field's type is a ValueError naming it: a file this suite did not write."""
    what = result_class.__name__
    if not isinstance(data, dict):
        raise ValueError(f"a {what} is a JSON object, not {type(data).__name__}")
    hints = typing.get_type_hints(result_class)
    values = {}
    for name in (f.name for f in fields(result_class)):
        if name not in data:
            continue
        value = data[name]
        if name in nested:
            if not isinstance(value, list):
                raise ValueError(f"{what}.{name} is {type(value).__name__}, not a list")
            value = [nested[name].from_dict(item) for item in value]
        elif not _conforms(value, hints[name]):
            shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
            raise ValueError(f"{what}.{name} is {shown}, not {_type_name(hints[name])}")
        values[name] = Verdict(value) if name == "verdict" else value
    return result_class(**values)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


@dataclass
class CaseResult:
    case: str  # the case id (reproduces the case: `conformance run --case ID`)
    verdict: Verdict
    reason: str = ""  # one line: why it failed, skipped or crashed
    tag: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)  # numbers (errors, timings)
    evidence: dict[str, Any] = field(default_factory=dict)  # where it went wrong (worst location, stderr)
    seconds: float | None = None  # wall time of the case in the worker (where the run's time goes)

    def to_dict(self) -> dict[str, Any]:
        return _to_json(self)

    @classmethod
    def of(cls, case: str, tag: str, outcome: "Outcome") -> "CaseResult":
        """The result of case ``case`` (its id) from what its check said."""
        return cls(case, outcome.verdict, outcome.reason, tag, outcome.metrics, outcome.evidence)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "CaseResult":
        return _from_json(CaseResult, data)


@dataclass
class Outcome:
    """What a check says of one case: the verdict, why, the figures and the evidence. The runner
    makes it the case's ``CaseResult`` (``CaseResult.of``): the case's id and tag are the runner's
    to stamp, never a check's."""

    verdict: Verdict
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckResult:
    name: str
    verdict: Verdict
    summary: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # check-wide facts (tolerances, strategy)

    def to_dict(self) -> dict[str, Any]:
        return _to_json(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "CheckResult":
        return _from_json(CheckResult, data, cases=CaseResult)

    @property
    def ran(self) -> int:
        """Cases that ran (every verdict but SKIP)."""
        return sum(1 for case in self.cases if case.verdict != Verdict.SKIP)

    @property
    def passed(self) -> int:
        return sum(1 for case in self.cases if case.verdict == Verdict.PASS)

    def tally(self) -> str:
        """ "PASSED/RAN pass[, N skip]": what the terminal and HTML show beside a check's verdict."""
        skipped = len(self.cases) - self.ran
        return f"{self.passed}/{self.ran} pass" + (f", {skipped} skip" if skipped else "")


@dataclass
class BackendResult:
    name: str
    available: bool
    reason: str = ""  # why not available (or empty)
    origin: str = "builtin"
    claims: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    wall_s: float = 0.0
    warm_s: float = 0.0  # ``--warm``: the process-seconds of its warm phase, apart from ``wall_s``

    def bench_cases(self) -> list["CaseResult"]:
        """The bench check's cases that have a forward time (those that ran)."""
        bench = self.check("bench")
        return [case for case in (bench.cases if bench else []) if case.metrics.get("forward_us")]

    def to_dict(self) -> dict[str, Any]:
        return {**_to_json(self), "wall_s": round(self.wall_s, 3), "warm_s": round(self.warm_s, 3)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "BackendResult":
        return _from_json(BackendResult, data, checks=CheckResult)

    def check(self, name: str) -> CheckResult | None:
        return next((check for check in self.checks if check.name == name), None)


@dataclass
class RunResult:
    environment: dict[str, Any]
    backends: list[BackendResult]
    suite: str = ""
    checks: list[str] = field(default_factory=list)
    interrupted: bool = False  # stopped by SIGINT/SIGTERM: only what finished is here
    schema_version: int = SCHEMA_VERSION
    # One part of a sharded run (``--shard I/N``): {"index", "count", "cases": every case id of the
    # whole run in order, "times": what balanced the cut, "assigned": this part's case ids};
    # ``conformance merge`` joins the parts.
    shard: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return _to_json(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "RunResult":
        if not isinstance(data, dict):
            raise ValueError(f"a results document is a JSON object, not {type(data).__name__}")
        version = data.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:  # True == 1 in Python: the type first
            raise ValueError(f"results schema_version {version!r}; this version of the suite reads {SCHEMA_VERSION}")
        run = _from_json(RunResult, {"environment": {}, **data}, backends=BackendResult)
        run.validate()
        return run

    def validate(self) -> None:
        """Raise ValueError for what a writer of this suite never produces and a reader would
        misjudge: names that are not strings, metrics the gate compares that are not finite numbers."""
        for backend in self.backends:
            for check in backend.checks:
                for case in check.cases:
                    where = f"{backend.name} / {check.name} / {case.case}"
                    if not all(isinstance(text, str) for text in (backend.name, check.name, case.case, case.reason)):
                        raise ValueError(f"{where}: names and reasons must be strings")
                    if not isinstance(case.metrics, dict) or not isinstance(case.evidence, dict):
                        raise ValueError(f"{where}: metrics and evidence must be JSON objects")
                    for key in GATED_METRICS:
                        value = case.metrics.get(key)
                        if value is not None and not (
                            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                        ):
                            raise ValueError(f"{where}: metric {key} is {value!r}, not a finite number")

    INTERRUPTED_NOTE = "Interrupted (SIGINT/SIGTERM): only the cases that finished are here; the rest did not run."

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        write_atomically(path, self.to_json())

    @staticmethod
    def load(path: str | Path) -> "RunResult":
        return RunResult.from_dict(json.loads(Path(path).read_text()))

    def ran_anything(self) -> bool:
        return any(
            case.verdict != Verdict.SKIP
            for backend in self.backends
            for check in backend.checks
            for case in check.cases
        )

    def any_failure(self) -> bool:
        return any(check.verdict.is_failure for backend in self.backends for check in backend.checks)
