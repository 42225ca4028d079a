"""How many kernels the Triton backends compile: a fixed few per layer variant, not one per batch.

Triton specializes integer arguments by value class (1, multiples of 16, the rest) unless told not
to; for the request count, the split count and the block-table width that multiplied a suite's
compiles (a cold standard run of the triton backend compiled for minutes) without a faster kernel.
The small kernels take head counts, tokens per request and the page size as plain integers, so two
layers that differ only there share them.
"""

import pytest
import torch

from backends.triton import kernels
from backends.triton.backend import DECODE_PROGRAMS_PER_MULTIPROCESSOR, TritonAttentionBackend
from conformance.cases.grammar import parse_case
from conformance.harness.step import prepare_case, run_step

# A layer no other test uses, so every kernel it needs is compiled here. Contexts of 2000 allow up
# to 16 splits (of at least split_floor_tokens = 128 keys); 100 allows one (no merge). Widths of the
# block table: 32 and 2 blocks of 64.
LAYER = "gqa-h24/8-d64-fp16-p64"
BATCHES = ["2000+1", "2000+1x3", "2000+1x16", "2000+1x17", "2000+1x48", "100+1x5"]


def compiled(kernel) -> int:
    """Kernels compiled so far for the current device (Triton keeps one cache per device)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_two_decode_kernels_and_one_merge_kernel_serve_every_request_and_split_count():
    device = torch.device("cuda")
    watched = {"decode": kernels.decode_split_kernel, "merge": kernels.merge_splits_kernel}
    before = {name: compiled(kernel) for name, kernel in watched.items()}
    splits, requests = set(), set()
    for batch in BATCHES:
        case = parse_case(f"{LAYER}:{batch}")
        prepared = prepare_case(TritonAttentionBackend, case, device)
        backend = prepared.backend
        splits.add(
            backend.splits_for(case.num_reqs, 1, backend.spec.num_kv_heads, DECODE_PROGRAMS_PER_MULTIPROCESSOR[1])
        )
        requests.add(case.num_reqs)
        out = run_step(prepared)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    # The batches did reach every class Triton would specialize on.
    assert 1 in splits and 16 in splits and splits - {1, 16}, splits
    assert 1 in requests and 16 in requests and 48 in requests and requests - {1, 16, 48}, requests
    added = {name: compiled(kernel) - before[name] for name, kernel in watched.items()}
    # The decode kernel's two: one split (ONE_SPLIT, writes the output) and any other count.
    assert added == {"decode": 2, "merge": 1}, added


@pytest.mark.gpu
def test_the_merge_and_the_cache_write_serve_every_head_count_and_page_size():
    device = torch.device("cuda")
    watched = {"merge": kernels.merge_splits_kernel, "write": kernels.write_kv_kernel}
    # Both decode with several splits (a merge), spec-verify too (tokens per request 1 and 4);
    # they differ in query heads (40, 24) and page size (32, 16), not in KV heads, width or dtype.
    layers = ["gqa-h40/8-d64-fp16-p32", "gqa-h24/8-d64-fp16-p16"]
    counts = []
    for layer in layers:
        for batch in ("4000+1x3", "4000+4x3"):
            prepared = prepare_case(TritonAttentionBackend, parse_case(f"{layer}:{batch}"), device)
            assert torch.isfinite(run_step(prepared)).all()
        torch.cuda.synchronize()
        counts.append({name: compiled(kernel) for name, kernel in watched.items()})
    assert counts[1] == counts[0], counts
