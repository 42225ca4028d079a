"""The split-KV floor of triton's decode kernel on every GQA bench shape:
``python -m conformance.tuning.tune_split_floor [TOKENS ...]`` (default 256 128 64).

A step may split a request's keys only into pieces of at least ``split_floor_tokens`` keys at the
longest context, so a short context gets few splits (512 keys: 2 or 3) however few programs its
batch launches. For each bench shape of the GQA layer: FlashInfer's forward time, then ours with
each floor, prepared afresh (the scratch and the split cap are sized at allocation), all in one
process; µs (CUDA events, L2 flushed, median) and the ratio to FlashInfer in the same run."""

from __future__ import annotations

import sys

import torch

from backends.triton.backend import TritonAttentionBackend
from conformance.cases.grammar import format_case
from conformance.cases.suites import bench_suite
from conformance.tuning.timed_case import TimedCase

FLOORS = (256, 128, 64)


def main(arguments: list[str]) -> None:
    if not all(argument.isdigit() and int(argument) > 0 for argument in arguments):
        print("usage: python -m conformance.tuning.tune_split_floor [TOKENS ...] (positive integers)", file=sys.stderr)
        sys.exit(2)
    floors = [int(argument) for argument in arguments] or list(FLOORS)
    device = torch.device("cuda")
    shipped = TritonAttentionBackend.split_floor_tokens
    for case in bench_suite():
        if case.spec.kind == "mla":
            continue
        text = format_case(case)
        vendor = TimedCase("flashinfer", text, device).micros()
        cells = []
        for floor in floors:
            TritonAttentionBackend.split_floor_tokens = floor
            timed = TimedCase("triton", text, device)
            micros = timed.micros()
            cells.append(f"floor {floor:3d}: {micros:8.1f} µs x{micros / vendor:4.2f}")
            del timed
        TritonAttentionBackend.split_floor_tokens = shipped
        print(f"{text:52s} flashinfer {vendor:8.1f} µs | " + " | ".join(cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
