"""``plan_staging``: a plan made while the last step is queued must not overwrite that step's
page-locked schedule before its copy has run. A stand-in wrapper does what FlashInfer's ``plan``
does (fill the page-locked buffer, ``cudaMemcpyAsync`` it to the device on the current stream)."""

import pytest
import torch

from backends.flashinfer.plan_staging import PlanStaging
from conformance.harness.step import on_a_busy_stream


class StandInWrapper:
    def __init__(self, device):
        self._pin_memory_int_workspace_buffer = torch.zeros(4, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.int_workspace = torch.zeros(4, dtype=torch.int32, device=device)

    def plan(self, value: int) -> None:
        self._pin_memory_int_workspace_buffer.fill_(value)
        self.int_workspace.copy_(self._pin_memory_int_workspace_buffer, non_blocking=True)


def test_a_wrapper_without_the_staging_buffer_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="_pin_memory_int_workspace_buffer"):
        PlanStaging(object(), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("staged", [False, True], ids=["plain plan", "staged plan"])
def test_a_queued_steps_schedule_survives_the_next_plan_only_when_staged(staged):
    device = torch.device("cuda")
    wrapper = StandInWrapper(device)
    plan = PlanStaging(wrapper, device).plan if staged else wrapper.plan
    plan(0)
    wrapper.int_workspace.clone()
    torch.cuda.synchronize()  # kernels loaded: host work inside the spin stays far shorter than it (H100: not so, cold)
    seen = []
    with on_a_busy_stream(device):  # neither step's copy runs before both plans are made
        for step in (1, 2):
            plan(step)
            seen.append(wrapper.int_workspace.clone())  # what this step's kernels would read
    first, second = (int(tensor[0]) for tensor in seen)
    assert second == 2
    assert first == (1 if staged else 2)  # plain: the first step ran with the second one's schedule
