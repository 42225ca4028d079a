"""``triton_indexer`` on a GPU: ``test_triton_indexer.py``'s batches of one padded shape, eager and
as one CUDA graph captured once and replayed for each (then a draft step advanced in place), each
token's choice right, the padding rows untouched, and no host sync in any step's build, forward,
replay or draft update (metadata from device tensors only, no host lengths)."""

import pytest
import torch

from host_syncs import detect_host_syncs
from host_syncs.detector import format_events
from tests.backends.test_triton_indexer import run_batches

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(
    "kv_cache_dtype,topk", [(torch.float8_e4m3fn, 16), (None, 80)], ids=["fp8-topk16", "bf16-topk80"]
)
def test_batches_of_one_shape_choose_right_with_no_host_sync(kv_cache_dtype, topk, capture):
    device = torch.device("cuda")
    if kv_cache_dtype is not None and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("Triton's e4m3 conversions need SM89 or newer (the backend's feature_gpus)")
    assert run_batches(device, kv_cache_dtype, topk) == []  # warm-up: Triton compiles, the allocator grows
    torch.cuda.synchronize()
    with detect_host_syncs(only_in_phases=True) as detector:
        problems = run_batches(device, kv_cache_dtype, topk, capture=capture, watch=lambda: detector.phase("step"))
    assert problems == []
    assert detector.blocking_events == [], format_events(detector.blocking_events)
