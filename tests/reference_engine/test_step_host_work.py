"""The host's work per steady decode step, counted on a CPU: the torch operators a step runs
outside its CUDA graphs (each one a launch the host makes every step on a GPU), for the sync and
the async loop with the scripted drafter over a graph-safe backend that claims vLLM's empty
requests (triton's path: padded graphs, attention's padding view, no host lengths in build).

Graphs are emulated (``CountedGraphs``): a segment runs eagerly, as a replay computes it, and its
operators are not counted; the backend's ``build`` before a replay is. ``prepare_step_inputs``
counts as one launch (one Triton kernel on CUDA; a CPU runs its torch version). Counts, never
times: the test fails when a change adds launches to every step."""

import contextlib
import dataclasses

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from backends.base import CGSupport
from reference_engine import batched_engine
from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.graphs import StepGraphs
from reference_engine.sampling import SamplingParams
from tests.planted.graph_backends import GraphSafeEmptyRequests

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7], list(range(100, 117)), [3, 1, 4]]  # pad to 8 rows
GREEDY = SamplingParams(max_tokens=24)

# What a steady step launches outside its graphs (both loops): the upload's copy, the rows' committed
# lengths (an index), the step-input kernel, attention's view of the padding rows (six), the
# download's copy. 19 before the padding view was folded and the int32 fields uploaded as such.
MAX_LAUNCHES_PER_STEADY_STEP = 10

# Operators that make no kernel on a GPU: views, and host scalars or host tensors being wrapped.
NO_LAUNCH = {
    "view",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "t",
    "transpose",
    "permute",
    "alias",
    "as_strided",
    "_unsafe_view",
    "reshape",
    "detach",
    "lift_fresh",
    "scalar_tensor",
}


class GraphSafeOnCpu(GraphSafeEmptyRequests):
    """A graph-safe plain-PyTorch backend (its build only references the step's device tensors, as
    triton's does) that claims vLLM's empty requests, allowed on a CPU."""

    name = "test_graph_safe_on_cpu"
    capabilities = dataclasses.replace(GraphSafeEmptyRequests.capabilities, devices=frozenset({"cpu"}))


class StepLaunches(TorchDispatchMode):
    """Operators per loop iteration, outside ``captured()``."""

    def __init__(self) -> None:
        super().__init__()
        self.iteration = None
        self.inside = 0
        self.launches: dict[int, list[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.iteration is not None and not self.inside and name not in NO_LAUNCH:
            self.launches.setdefault(self.iteration, []).append(name)
        return func(*args, **(kwargs or {}))

    def launch(self, name: str) -> None:
        if self.iteration is not None and not self.inside:
            self.launches.setdefault(self.iteration, []).append(name)

    @contextlib.contextmanager
    def captured(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


class CountedGraphs(StepGraphs):
    """``StepGraphs.run`` on a CPU: eager on a key's first use; then the capture's metadata (from
    ``build_for_capture``) and, before every later run, ``build`` on the host as before a replay;
    the segment itself inside ``captured``."""

    def __init__(self, engine, counter: StepLaunches) -> None:
        super().__init__(engine)
        self.enabled, self.support = True, CGSupport.ALWAYS
        self.counter = counter

    def run(self, key, common, segment):
        backend = self.engine.backend
        if key not in self.seen:
            self.seen.add(key)
            return segment(backend.build(common) if common is not None else None)
        if key not in self.graphs:
            self.graphs[key] = (None, backend.build_for_capture(common) if common is not None else None)
            self.captures += 1
        elif common is not None:
            backend.build(common)
        self.replays += 1
        with self.counter.captured():
            return segment(self.graphs[key][1])


def steady_launches(scheduling: bool, monkeypatch) -> tuple[list[list[int]], dict[int, list[str]]]:
    counter = StepLaunches()
    prepare = batched_engine.prepare_step_inputs

    def one_kernel(*args, **kwargs):
        counter.launch("prepare_step_inputs")
        with counter.captured():
            return prepare(*args, **kwargs)

    monkeypatch.setattr(batched_engine, "prepare_step_inputs", one_kernel)
    engine = BatchedEngine(
        EngineConfig(
            backend=f"{__name__}:GraphSafeOnCpu",
            num_spec_tokens=3,
            drafter="scripted:random:0.6",
            async_scheduling=scheduling,
        )
    )
    engine.graphs = CountedGraphs(engine, counter)
    for _ in range(2):  # every segment's key seen, then captured: the measured run replays
        engine.generate(PROMPTS, GREEDY)
    iterate, first = engine._iterate, engine.iteration

    def counted(requests, on_step):
        counter.iteration = engine.iteration
        try:
            return iterate(requests, on_step)
        finally:
            counter.iteration = None

    engine._iterate = counted
    with counter:
        outputs = engine.generate(PROMPTS, GREEDY)
    records = engine.steps
    steady = [
        record.iteration
        for previous, record in zip(records, records[1:])
        if record.uniform_decode and not record.captured and previous.uniform_decode
        if previous.num_reqs == record.num_reqs and record.iteration > first
    ]
    assert len(steady) >= 5, "the run has too few steady decode steps to count"
    return [out.tokens for out in outputs], {index: counter.launches.get(index, []) for index in steady}


@pytest.mark.parametrize("scheduling", [False, True])
def test_a_steady_step_launches_few_operators_outside_its_graphs(scheduling, monkeypatch):
    plain = [out.tokens for out in Engine(EngineConfig()).generate(PROMPTS, GREEDY)]
    tokens, launches = steady_launches(scheduling, monkeypatch)
    assert tokens == plain
    worst = max(launches.values(), key=len)
    assert len(worst) <= MAX_LAUNCHES_PER_STEADY_STEP, f"a steady step launches {len(worst)}: {worst}"
