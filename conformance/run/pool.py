"""Every isolated run: a pool of slots, each running one child at a time
(``isolation.run_isolated``: crash and hang isolation, resume after a crash, tamper checks). One
slot, the device as given, unless ``conformance run --gpus all|0,1,... [--workers N]`` asks for
more: the same code path for the CPU, one GPU and many.

Unless the run is one backend on one slot without ``--warm``, one probe child first asks every
backend what it is and, with several slots or ``--warm``, plans it over the run's checks and cases
(``Probe.plan``), on the first slot's GPU. The unit of work is one check of one backend over a few
cases (``units``): the cases the check runs, cut into parts balanced by expected seconds
(``shard.assign``), about two units a slot over the whole run, each check's in proportion to its
expected seconds, so that no backend's long cases bound the run and no child starts for cases
that only skip; the units go longest first to whichever slot is free. What a plan skips is
reported from the plan (``planned_skips``), as the children would have reported it. A unit's
child plans its check over the whole run's cases and runs only its own (``Job.only``), so the run
plans as one child would. With ``--warm`` each backend's checks wait for its own warm units
(``warm``). A slot is a GPU (``CUDA_VISIBLE_DEVICES`` in its children's environment, round robin
over ``--gpus``) or, without GPUs, one of ``--workers`` CPU slots; its children take their share
of the cores. What each backend's units reported is joined into its row (``runner.backend_row``).
A signal stops every child; what finished is kept.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Iterator

import torch

from backends import registry
from backends.registry import BackendRef
from conformance.cases.grammar import Case
from conformance.checks import make_check
from conformance.results import BackendResult, CaseResult, RunResult, Verdict
from conformance.run.environment import collect_environment
from conformance.run.execution import Job
from conformance.run.interrupts import Interrupted
from conformance.run.isolation import BackendEvents, CrashBudget, Probe, Stopped, run_isolated
from conformance.run.runner import (
    Progress,
    RunOptions,
    _cannot_run,
    _not_started,
    annotate_bench_ratios,
    backend_row,
    not_run_here,
    probe,
)
from conformance.run.shard import assign, attention_work
from conformance.run.warm import warm_parts

# Events every unit of a backend sends alike: the progress hears each once.
ONCE_A_BACKEND = ("backend", "plan", "check_skipped")


@dataclass(frozen=True)
class Slot:
    """Where one child at a time runs: its environment's changes (a GPU), and its name."""

    name: str
    env: dict[str, str] = field(default_factory=dict)


def slots_for(gpus: list[str] | None, workers: int) -> list[Slot]:
    """``workers`` slots over ``gpus`` round robin (each child sees its GPU as cuda:0), or CPU slots;
    each child's CPU threads its share of the cores (``OMP_NUM_THREADS``, unless set already):
    torch's default of one thread a core in every child oversubscribes the machine, and spinning
    OpenMP threads then slow each child many times (measured on 2 cores, two CPU slots: the
    smoke suite's cases 0.1 s at one thread a child, 8.7 s at the default)."""
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(max(1, cpu_count() // workers))}
    if gpus:
        chosen = [gpus[index % len(gpus)] for index in range(workers)]
        return [Slot(f"GPU {gpu}", {"CUDA_VISIBLE_DEVICES": gpu, **threads}) for gpu in chosen]
    return [Slot(f"worker {index + 1}", threads) for index in range(workers)]


def cpu_count() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class Unit:
    ref: BackendRef
    only: list[str]
    work: float
    checks: list[str] | None = None  # the checks it runs (None: every check of the run)


# Units a slot, over all backends: twice as many as slots lets longest-first even out what the
# estimates misjudge; more would pay each child's start-up (importing torch and the backend, CUDA,
# planning: seconds) more often than it saves.
UNITS_PER_SLOT = 2
ATTENTION_SECONDS = 1e-5  # roughly what a unit of attention work (``shard.attention_work``) adds to a case


def case_weight(check_seconds: float, case: Case) -> float:
    """A (check, case)'s expected seconds: the check's own span plus its attention work."""
    return check_seconds + ATTENTION_SECONDS * attention_work(case)


def units(options: RunOptions, refs: list[BackendRef], slots: int, plans: dict[str, dict | None]) -> list[Unit]:
    """The pool's units, longest first. A backend with a plan: each check's cases that it runs,
    cut into parts balanced by expected seconds (``case_weight``, ``shard.assign``); the parts
    number about ``UNITS_PER_SLOT`` a slot over the whole run, each check's in proportion to its
    expected seconds, at least one and at most one a slot; a case a check skips takes no unit
    (``planned_skips`` reports it). A backend without one (its planning failed): every case, every
    check, in parts by the same expected seconds."""
    cases = options.reported_cases
    groups: list[tuple[BackendRef, list[str] | None, dict[str, float]]] = []
    for ref in refs:
        plan = plans.get(ref.name)
        if plan is None:  # every check over each case: weighed in the same seconds as the planned
            seconds = sum(make_check(check, options.check_options).case_seconds for check in options.checks)
            groups.append((ref, None, {case.id: case_weight(seconds, case) for case in cases}))
            continue
        for check, whole in plan["checks"].items():
            runs = [case for case in cases if not whole and not plan["cases"][check][case.id]]
            seconds = make_check(check, options.check_options).case_seconds
            if runs:
                groups.append((ref, [check], {case.id: case_weight(seconds, case) for case in runs}))
    total = sum(sum(weight.values()) for _, _, weight in groups if weight) or 1.0
    found = []
    for ref, checks, weight in groups:
        chosen = [case for case in cases if case.id in weight]
        share = round(UNITS_PER_SLOT * slots * sum(weight.values()) / total)
        parts = assign(chosen, max(1, min(slots, len(chosen), share)), weight)
        for part in sorted(set(parts)):
            ids = [case.id for case, at in zip(chosen, parts) if at == part]
            found.append(Unit(ref, ids, sum(weight[case_id] for case_id in ids), checks))
    return sorted(found, key=lambda unit: -unit.work)


def planned_skips(options: RunOptions, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The events a backend's children would send for what its plan skips, which no unit runs
    (``units``): the plan, each check that skips as a whole, and each case a check skips."""
    events: list[dict[str, Any]] = [plan]
    for check, whole in plan["checks"].items():
        if whole:
            events.append({"event": "check_skipped", "check": check, "reason": whole})
            continue
        for case in options.reported_cases:
            skip = plan["cases"][check][case.id]
            if skip:
                result = CaseResult(case.id, Verdict.SKIP, skip, tag=case.tag)
                events.append({"event": "result", "check": check, "result": result.to_dict()})
    return events


class _Told:
    """The progress, told from every unit's thread in turn, each backend's shared events once; and
    a backend not asked ahead (None in ``probes``) is what its first child says it is: ``ready``
    hears it, and the progress starts it where it can run."""

    def __init__(self, progress: Progress, options: RunOptions, probes: dict[str, Probe | None]) -> None:
        self.progress, self.options, self.probes = progress, options, probes
        self.lock, self.seen = threading.Lock(), set()
        self.started: set[str] = set()  # backends whose progress began

    def start(self, name: str) -> None:
        if name not in self.started:
            self.started.add(name)
            self.progress.backend_started(name, len(self.options.checks), len(self.options.reported_cases))

    def event(self, name: str, event: dict[str, Any]) -> None:
        with self.lock:
            key = (name, event["event"], event.get("check"))
            if event["event"] in ONCE_A_BACKEND:
                if key in self.seen:
                    return
                self.seen.add(key)
            if event["event"] == "backend" and self.probes[name] is None:
                self.probes[name] = said = Probe.of(registry.resolve(name), event)
                if self.options.ready is not None and None not in self.probes.values():
                    self.options.ready(self.probes)
                if not _cannot_run(said):
                    self.start(name)
            if name not in self.started:  # nothing of it drawn yet: a case result starts it
                if event["event"] in ("backend", "plan", "done"):
                    return
                self.start(name)
            self.progress.event(name, event)


def run_pooled(options: RunOptions, progress: Progress) -> RunResult:
    """``runner.run`` for isolated children: every backend asked in one probe child (``ready``
    hears them before anything else), then the pool over ``options.slots`` (one slot, the device
    as given, by default). A GPU slot's children see their GPU as the device's type alone."""
    slots = options.slots or [Slot(str(options.device))]
    if any("CUDA_VISIBLE_DEVICES" in slot.env for slot in slots):
        options = replace(options, device=torch.device(options.device.type))
    probe_s = None
    if len(options.backends) == 1 and len(slots) == 1 and not options.warm:  # its one child says what it is
        probes: dict[str, Probe | None] = {options.backends[0]: None}
    else:  # asked, and planned for the units (``units``) and the warm phase (``warm``)
        try:
            # On the first slot's GPU: the plan's skips (a GPU's kind, its memory) are its slots'.
            asked = time.monotonic()
            probes = dict(probe(options, planned=len(slots) > 1 or options.warm, env=slots[0].env))
            probe_s = round(time.monotonic() - asked, 3)
        except Interrupted as interrupted:  # while the probe child imports: every backend not run
            rows = [
                _not_started(registry.resolve(name), None, options, interrupted.not_run) for name in options.backends
            ]
            interrupted.partial = RunResult(
                collect_environment(options.device),
                rows,
                options.suite,
                list(options.checks),
                True,
                shard=options.shard,
            )
            raise
        if options.ready is not None:
            options.ready(probes)
    return run_pool(options, probes, progress, slots, probe_s)


def run_pool(
    options: RunOptions,
    probes: dict[str, Probe | None],
    progress: Progress,
    slots: list[Slot],
    probe_s: float | None = None,
) -> RunResult:
    """Every backend through the checks over the pool (module docstring); a backend whose probe
    is None is asked by its first child; ``probe_s``: the probe child's seconds, where one ran. On
    ``Interrupted`` (in this, the main thread) every child is stopped and the exception leaves
    with ``partial``; any other exception stops them too."""
    refs = [registry.resolve(name) for name in options.backends]
    runnable = [ref for ref in refs if not _cannot_run(probes[ref.name])]
    # Asked by their first child instead: what every unit's children said decides (``rows``), so
    # that one child that could not load it does not stand for the others.
    asked_by_child = {name for name, said in probes.items() if said is None}
    plans = {ref.name: probes[ref.name].plan if probes[ref.name] is not None else None for ref in runnable}
    work = units(options, runnable, len(slots), plans)
    told = _Told(progress, options, probes)
    unit_events = [BackendEvents() for _ in work]
    skipped = {ref.name: BackendEvents() for ref in runnable}  # what the plans skip whole: no child runs it
    free: queue.Queue[Slot] = queue.Queue()
    for slot in slots:
        free.put(slot)
    stop = threading.Event()
    seconds = {ref.name: 0.0 for ref in runnable}  # each backend's process-seconds over its units
    budgets = {ref.name: CrashBudget() for ref in runnable}  # a backend's crashes, over all its units
    lock = threading.Lock()

    def job_for(unit: Unit) -> Job:
        return Job(
            backend=unit.ref.name,
            device=str(options.device),
            checks=unit.checks or list(options.checks),
            cases=[{"id": case.id, "tag": case.tag} for case in options.cases],
            options=options.check_options,
            only=unit.only,
        )

    # The warm phase (``warm``): each layout's case once, its result thrown away, its time kept.
    warmers = [
        Unit(ref, ids, 0.0, [check])
        for ref in runnable
        if options.warm and plans[ref.name]
        for check, ids in warm_parts(options, plans[ref.name], len(slots))
    ]
    warm_seconds = {ref.name: 0.0 for ref in runnable}
    # Each backend's checks wait for its own warm units, not for every backend's.
    warm_left = Counter(unit.ref.name for unit in warmers)
    warmed = {ref.name: threading.Event() for ref in runnable}
    for ref in runnable:
        if not warm_left[ref.name]:
            warmed[ref.name].set()
    warm_failed: set[str] = set()  # a warm case crashed or hung: the backend's other warm units are not run
    # What failed on a warm (cold, first) run: a check's result for that case, since a fault on the
    # first run of a layout (a compile, an autotune, a first load) is the backend's fault as much.
    cold_failures: dict[str, dict[tuple[str, str], CaseResult]] = {ref.name: {} for ref in runnable}
    began = time.monotonic()
    warmed_s: list[float] = []  # the warm phase's wall time, once its last unit ended

    @contextmanager
    def on_a_slot(name: str, spent: dict[str, float]) -> Iterator[Slot]:
        """A free slot for one of backend ``name``'s units, freed however the unit ends (a stop
        too), its seconds added to ``spent``."""
        slot = free.get()
        began = time.monotonic()
        try:
            yield slot
        except Stopped:
            pass
        finally:
            with lock:
                spent[name] += time.monotonic() - began
            free.put(slot)

    def warm_unit(unit: Unit) -> None:
        name = unit.ref.name
        try:
            with on_a_slot(name, warm_seconds) as slot:
                if stop.is_set() or name in warm_failed:
                    return
                # A crash or a hang ends it (no resume) and the backend's warming: its checks meet it.
                events = BackendEvents()
                run_isolated(
                    job_for(unit),
                    lambda event: None,
                    case_timeout_s=options.case_timeout_s,
                    events=events,
                    env=slot.env,
                    stop=stop,
                    budget=CrashBudget(limit=0),
                )
                if events.answer is None or any(r.verdict == Verdict.CRASH for r in events.results.values()):
                    warm_failed.add(name)
                with lock:  # cases the warm run did not reach are "not run", not the backend's failure
                    cold_failures[name].update(
                        (key, result)
                        for key, result in events.results.items()
                        if result.verdict.is_failure and not result.reason.startswith("not run")
                    )
        finally:
            with lock:
                warm_left[name] -= 1
                if not warm_left[name]:
                    warmed[name].set()
                last = not any(warm_left.values())
            if last:
                warmed_s.append(round(time.monotonic() - began, 3))
                with told.lock:
                    progress.warmed(len(warmers), warmed_s[0])

    def run_unit(index: int) -> None:
        unit = work[index]
        while not warmed[unit.ref.name].wait(0.2):  # its own warm units first (holding no slot)
            if stop.is_set():
                return
        with on_a_slot(unit.ref.name, seconds) as slot:
            if stop.is_set() or budgets[unit.ref.name].exhausted:  # ``rows`` says why
                return
            run_isolated(
                job_for(unit),
                lambda event: told.event(unit.ref.name, event),
                case_timeout_s=options.case_timeout_s,
                # One slot: one unit a backend, whose limit --backend-timeout is (refused with more).
                backend_timeout_s=options.backend_timeout_s if len(slots) == 1 else None,
                events=unit_events[index],
                env=slot.env,
                stop=stop,
                budget=budgets[unit.ref.name],
            )

    def rows(not_run: str) -> list[BackendResult]:
        found = []
        for ref in refs:
            said = None if ref.name in asked_by_child else probes[ref.name]
            if _cannot_run(said):
                found.append(not_run_here(said, options))
                continue
            events = BackendEvents()
            events.absorb(skipped.get(ref.name, BackendEvents()))
            mine = [reported for unit, reported in zip(work, unit_events) if unit.ref.name == ref.name]
            for reported in mine:
                events.absorb(reported)
            for key, cold in cold_failures.get(ref.name, {}).items():
                again = events.results.get(key)
                if again is None or not again.verdict.is_failure:
                    then = f"; run again by the check: {again.verdict.value}" if again else ""
                    events.results[key] = replace(
                        cold, reason=f"on the case's first, cold run (--warm): {cold.reason}{then}"
                    )
            budget = budgets[ref.name]
            answers = [reported.answer for reported in mine if reported.answer]
            failed = [answer["failure"] for answer in answers if answer.get("failure")]
            unavailable = [answer["unavailable"] for answer in answers if answer.get("unavailable")]
            why = not_run
            if failed and not stop.is_set():  # a unit's child could not load what the probe loaded
                why = f"not run: this part's process could not load the backend ({failed[0]})"
            elif unavailable and not stop.is_set():  # a slot's GPU of another kind than the others'
                why = f"not run: this part's slot cannot run the backend ({unavailable[0]})"
            if budget.exhausted and not stop.is_set():
                why = budget.given_up
            row = backend_row(ref, said, options, events, why, seconds[ref.name])
            found.append(replace(row, warm_s=round(warm_seconds.get(ref.name, 0.0), 3)))
        return found

    # The warm units first (they take the slots first), then the checks' units, longest first; a
    # thread each, so that a unit waiting for its backend's warming holds no slot.
    tasks = [partial(warm_unit, unit) for unit in warmers] + [partial(run_unit, index) for index in range(len(work))]
    with ThreadPoolExecutor(max_workers=max(1, len(tasks)), thread_name_prefix="conformance-slot") as pool:
        pending: set = set()
        try:
            for ref in runnable:
                if probes[ref.name] is not None:
                    told.start(ref.name)
                for event in planned_skips(options, plans[ref.name]) if plans[ref.name] else []:
                    skipped[ref.name].record(event)
                    told.event(ref.name, event)
            for task in tasks:
                pending.add(pool.submit(task))
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()  # a refusal from ``ready`` (a typo), or a bug in the pool itself
        except BaseException as error:
            stop.set()  # every other child ends before this leaves
            if not isinstance(error, Interrupted):
                raise
            interrupted = error
            wait(pending)
            interrupted.partial = RunResult(
                collect_environment(options.device),
                rows(interrupted.not_run),
                options.suite,
                list(options.checks),
                interrupted=True,
                shard=options.shard,
            )
            raise
    backends = rows("not run: no worker reported this case")
    for backend in backends:
        progress.backend_finished(backend)
    annotate_bench_ratios(backends)
    environment = collect_environment(options.device)
    environment["pool"] = [slot.name for slot in slots]
    if probe_s is not None:  # the probe child's asking and planning, before any unit started
        environment["probe_s"] = probe_s
    if warmed_s:
        environment["warm_s"] = warmed_s[0]
    return RunResult(environment, backends, options.suite, list(options.checks), shard=options.shard)
