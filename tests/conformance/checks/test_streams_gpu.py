"""numerics' second layer runs on a busy side stream: a backend that launches on the default
stream instead of the current one reads that layer's pool and inputs before they exist. Its two
steps in flight run there too: a backend whose next build overwrites a pinned buffer that the
queued step's copy has not read yet gets the next step's lengths."""

import pytest
import torch

from backends.torch_naive import TorchNaiveBackend
from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge
from tests.planted.graph_backends import StagesLengthsInOnePinnedBuffer, TorchGraphSafe
from tests.planted.input_defects import LaunchesOnTheDefaultStream

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
CASE = parse_case("gqa-h8/2-d128-bf16-p16:700+1,3000+4,1+1")


@pytest.mark.parametrize("backend", [TorchNaiveBackend, TritonAttentionBackend], ids=["torch_naive", "triton"])
def test_backends_on_the_current_stream_pass(backend):
    assert judge(NumericsCheck(), backend, CASE, CUDA).verdict == Verdict.PASS


def test_a_forward_on_the_default_stream_fails_the_second_layer():
    result = judge(NumericsCheck(), LaunchesOnTheDefaultStream, CASE, CUDA)
    assert result.verdict == Verdict.FAIL and result.reason.startswith("a second layer"), result.reason
    assert result.metrics["mismatched"] == 0  # the first two passes, on the default stream themselves, are right


def test_a_build_that_overwrites_a_queued_steps_pinned_lengths_fails_two_steps_in_flight():
    assert judge(NumericsCheck(), TorchGraphSafe, CASE, CUDA).verdict == Verdict.PASS
    result = judge(NumericsCheck(), StagesLengthsInOnePinnedBuffer, CASE, CUDA)
    assert result.verdict == Verdict.FAIL, result.reason
    assert result.reason.startswith("two steps in flight: this step (the next one built before it ran) is wrong"), (
        result.reason
    )
    assert result.metrics["mismatched"] == 0 and result.metrics["second layer max abs error"] < 0.1
