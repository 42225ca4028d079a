"""GPU idle inside steps (reference_engine.gpu_timeline): the trace arithmetic on the CPU, the
step ranges through the real profiler on the CPU, and a planted mid-step host stall on the GPU."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from reference_engine.gpu_timeline import (
    STEP_RANGE,
    StepActivity,
    profile_in_step_idle,
    step_activity,
    summarize,
    union_length,
)
from reference_engine.metrics import StepTimer


def test_union_counts_overlap_once():
    assert union_length([]) == 0.0
    assert union_length([(0, 10), (5, 15), (20, 30)]) == 25.0
    assert union_length([(0, 100), (10, 20), (30, 40)]) == 100.0


def span(ts, dur, tid=1):
    return {"cat": "user_annotation", "name": STEP_RANGE, "ts": ts, "dur": dur, "tid": tid}


def launch(ts, correlation, category="cuda_runtime", tid=1):
    return {
        "cat": category,
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "tid": tid,
        "args": {"correlation": correlation},
    }


def activity(ts, dur, correlation, category="kernel"):
    return {"cat": category, "name": "k", "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": correlation}}


def test_each_activity_belongs_to_the_step_whose_range_launched_it():
    events = [
        span(0, 50),
        span(100, 50),
        launch(5, 1),
        launch(10, 2, "cuda_driver"),
        launch(20, 3),  # step 0: a kernel, a Triton kernel, a graph
        activity(1000, 10, 1),
        activity(1010, 5, 2),
        activity(1030, 10, 3),
        activity(1035, 10, 3),  # 15 idle at 1015..1030
        launch(110, 4),
        activity(1100, 20, 4, "gpu_memcpy"),
        activity(1110, 20, 5, "gpu_memset"),
        launch(112, 5),
        launch(60, 6),
        activity(1050, 40, 6),  # launched between steps: no step's
        launch(120, 7, tid=2),
        activity(1200, 40, 7),  # another thread's launch during step 1: not step 1's
        {"cat": "cpu_op", "name": "aten::add", "ts": 11, "dur": 3, "tid": 1},
    ]
    steps = step_activity(events)
    assert steps == [StepActivity(45.0, 30.0), StepActivity(30.0, 30.0)]
    assert steps[0].idle_us == 15.0
    summary = summarize(steps + [StepActivity(0.0, 0.0)])  # a step that ran nothing is not counted
    assert summary.steps == 2
    assert summary.fraction == pytest.approx(15 / 75)
    assert summary.idle_ms_per_step == pytest.approx(7.5e-3) and summary.busy_ms_per_step == pytest.approx(30e-3)


def test_step_timer_opens_one_profiler_range_per_step_only_while_labelling(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    timer = StepTimer(enabled=False)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for labelled in (True, True, False, True):
            timer.label_steps = labelled
            timer.begin()
            torch.ones(4).add_(1)
            timer.end()
    profiler.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == STEP_RANGE]
    assert len(ranges) == 3
    assert len(step_activity(events)) == 3


def test_off_cuda_there_is_no_profiled_pass():
    engine = SimpleNamespace(device=torch.device("cpu"), timer=StepTimer(False), generate=lambda *a: pytest.fail("ran"))
    assert profile_in_step_idle(engine, [], None) is None


class StallingEngine:
    """A stand-in engine: each step launches GPU work, waits ``stall_s`` on the host, launches more."""

    def __init__(self, stall_s: float) -> None:
        self.device = torch.device("cuda")
        self.timer = StepTimer(True)
        self.stall_s = stall_s
        self.steps = []
        self.x = torch.randn(256, 256, device=self.device)

    def generate(self, prompts, params):
        self.steps = []
        for _ in range(6):
            self.timer.begin()
            y = self.x @ self.x
            time.sleep(self.stall_s)
            (y @ self.x).relu_()
            self.timer.end()
            self.steps.append(SimpleNamespace(captured=False))


@pytest.mark.gpu
def test_a_mid_step_host_stall_shows_as_idle_inside_the_step():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    quiet, stalled = StallingEngine(0.0), StallingEngine(0.005)
    for engine in (quiet, stalled):
        engine.generate([], None)  # warm, as the engine is when its profiled pass runs (cuBLAS set-up)
    quiet, stalled = profile_in_step_idle(quiet, [], None), profile_in_step_idle(stalled, [], None)
    assert quiet.steps == stalled.steps == 6
    assert stalled.idle_ms_per_step > 3.0, stalled  # most of the 5 ms stall, inside the step
    assert quiet.idle_ms_per_step < 1.0, quiet
    assert 0.0 < stalled.busy_ms_per_step < 1.0
