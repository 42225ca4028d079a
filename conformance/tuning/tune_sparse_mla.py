"""Sweep triton_mla's sparse (DSA) kernel tiling on the GPU:
``python -m conformance.tuning.tune_sparse_mla [CASE NAME ...]``.

For each of DeepSeek-V3.2's sparse shapes (top 2048): FlashMLA's sparse decode time, then ours for
every (heads per program, index entries per tile, warps, stages). Heads per program decide how
often a token's gathered keys are read (128 heads in programs of 16 read them eight times) and
whether a tile is large enough for Hopper's warpgroup MMA; a layer of fewer heads pads them.
Prints forward µs (CUDA events, L2 flushed), the ratio to FlashMLA's and the largest difference
from its output, one run."""

import itertools
import sys

import torch

from backends.triton import sparse_mla
from conformance.tuning.timed_case import Sweep

CASES = {
    "sparse decode b64 ctx4096": "mla-h128-d512+64-bf16-p64-topk2048:4096+1x64",
    "fp8_ds_mla decode b64 ctx4096": "mla-h128-d512+64-bf16-fp8dsmla-p64-topk2048:4096+1x64",
    "sparse TP8 decode b64 ctx32768": "mla-h16-d512+64-bf16-p64-topk2048:32768+1x64",
}
TILINGS = list(itertools.product((16, 32, 64), (32, 64), (4, 8), (2, 3)))  # heads, BLOCK_N, warps, stages


def main(names: list[str]) -> None:
    device = torch.device("cuda")
    shipped = (
        sparse_mla.MIN_HEADS_PER_PROGRAM,
        sparse_mla.MAX_HEADS_PER_PROGRAM,
        sparse_mla.LAUNCH,
        sparse_mla.WINDOW_LAUNCH,
    )
    for name in names or CASES:
        sweep = Sweep(name, CASES[name], "flashmla_sparse", "triton_mla", device)
        for heads, block_n, warps, stages in TILINGS:
            sparse_mla.MAX_HEADS_PER_PROGRAM = heads
            sparse_mla.MIN_HEADS_PER_PROGRAM = heads  # a layer of fewer heads pads its programs
            sparse_mla.LAUNCH = sparse_mla.WINDOW_LAUNCH = {heads: (block_n, warps, stages)}
            print(sweep.line(f"heads={heads:2d} block_n={block_n:2d} warps={warps} stages={stages}"), flush=True)
        (
            sparse_mla.MIN_HEADS_PER_PROGRAM,
            sparse_mla.MAX_HEADS_PER_PROGRAM,
            sparse_mla.LAUNCH,
            sparse_mla.WINDOW_LAUNCH,
        ) = shipped
        del sweep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
