"""Whether the host kept the GPU fed (reference_engine.metrics: ``StepTimer.drained``, ``feeding``):
the arithmetic on the CPU; on the GPU, a stand-in loop that queues ahead and one that holds the GPU
up inside every step."""

import time
from types import SimpleNamespace

import pytest
import torch

from reference_engine.metrics import StepTimer, feeding


def record(uniform=True, captured=False, schedule=1e-3, launch=2e-3, wait=3e-3, land=1e-3):
    return SimpleNamespace(
        uniform_decode=uniform,
        captured=captured,
        host_schedule_s=schedule,
        host_launch_s=launch,
        host_wait_s=wait,
        host_land_s=land,
    )


def test_fed_steps_are_the_decode_steps_queued_whole_and_captures_are_left_out():
    records = [
        record(uniform=False),
        record(),
        record(captured=True),
        record(),
        record(wait=5e-3),
        record(uniform=False),
    ]
    drained = [False, True, True, False, False]  # steps 1..5
    step_ms = [9.0, 4.0, 50.0, 6.0, 4.5, 7.0]
    fraction, fed, period = feeding(records, drained, step_ms)
    assert fraction == pytest.approx(1 / 4)  # step 2 captured: not counted; step 3 drained
    assert fed == pytest.approx(4.25)  # steps 1 and 4; step 3 drained, step 5 not decode
    assert period == pytest.approx(7.0)  # median of 7, 7, 10 ms over steps 1, 3, 4


def test_a_single_step_or_only_captures_measure_nothing():
    assert feeding([record()], [], [3.0]) == (None, None, None)
    assert feeding([record(), record(captured=True)], [True], [3.0, 3.0]) == (None, None, None)


def test_a_disabled_timer_records_no_drained_flags():
    timer = StepTimer(enabled=False)
    for _ in range(3):
        timer.begin()
        timer.end()
    assert timer.drained == [] and timer.pairs == []


def spin_cycles_per_ms() -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 / start.elapsed_time(end))


def run_steps(timer: StepTimer, gpu_cycles: int, host_stall_s: float, steps: int = 8) -> None:
    for _ in range(steps):
        timer.begin()
        torch.cuda._sleep(gpu_cycles)
        time.sleep(host_stall_s)  # the host busy in the middle of the step
        torch.cuda._sleep(gpu_cycles)
        timer.end()
    timer.gaps_ms()


@pytest.mark.gpu
def test_a_loop_that_queues_ahead_is_fed_and_one_that_stalls_inside_steps_runs_dry():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cycles = spin_cycles_per_ms()  # each spin: about 1 ms of GPU time
    records = [record() for _ in range(8)]
    fed, starved = StepTimer(True), StepTimer(True)
    run_steps(fed, cycles, 0.0)
    run_steps(starved, cycles // 10, 0.003)
    fed_fraction, fed_ms, _ = feeding(records, fed.drained, fed.step_ms())
    starved_fraction, starved_ms, _ = feeding(records, starved.drained, starved.step_ms())
    assert fed_fraction == 0.0, fed.drained
    assert 1.5 < fed_ms < 3.0, fed_ms  # two spins of about 1 ms each, nothing else
    assert starved_fraction == 1.0, starved.drained
    assert starved_ms is None  # every step ran dry: none times the GPU alone
