"""bench: how fast — ``build()`` on the CPU, ``forward()`` on the GPU, graph replay — against
ceilings measured in the same process (a large device copy; a large bf16 matmul).

forward() is timed with CUDA events around each call, the L2 cache flushed before every call (a
write over twice its size), median of many. Before the start event the GPU is held in a short
sleep kernel, so the host has enqueued the whole forward before the clock starts: the interval
is GPU execution, not Python launch latency (which graph replay removes anyway). build() is timed
with the host clock, median of many calls after warm-up. Data is drawn on the device (the oracle
is not needed), never zeros.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from backends.base import AttentionBackend, CGSupport, CommonAttentionMetadata
from conformance.cases.grammar import Case
from conformance.checks.base import EVERY_KIND, Check
from conformance.harness.graph_batches import graph_class_reason
from conformance.harness.step import PreparedCase, poisoned_output, prepare_case
from conformance.results import Outcome, Verdict

BUILD_CALLS = 200
TIMED_CALLS = 30
TIME_BUDGET_S = 0.3  # per measurement: slow backends get fewer calls
LAUNCH_HEADROOM_CYCLES = 2_000_000  # ~1 ms of GPU sleep: time for the host to enqueue a forward


def _l2_flusher(device: torch.device) -> Callable[[], None]:
    size = 2 * torch.cuda.get_device_properties(device).L2_cache_size
    scratch = torch.empty(size, dtype=torch.uint8, device=device)
    return lambda: scratch.fill_(1)


def time_gpu(function: Callable[[], None], flush: Callable[[], None]) -> float:
    """Median µs of ``function`` by CUDA events, L2 flushed before each call."""
    function()
    torch.cuda.synchronize()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < TIMED_CALLS and (len(samples) < 3 or time.perf_counter() - started < TIME_BUDGET_S):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(LAUNCH_HEADROOM_CYCLES)
        start.record()
        function()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def time_cpu(function: Callable[[], Any]) -> float:
    """Median µs of ``function`` on the host clock."""
    for _ in range(5):
        function()
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < BUILD_CALLS and (len(samples) < 5 or time.perf_counter() - started < TIME_BUDGET_S):
        begin = time.perf_counter()
        function()
        samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate on this GPU, now."""
    source = torch.empty(2**30, dtype=torch.uint8, device=device).fill_(3)
    target = torch.empty_like(source)
    copy_us = time_gpu(lambda: target.copy_(source), lambda: None)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    matmul_us = time_gpu(lambda: a @ b, lambda: None)
    return {"copy_GBps": 2 * source.numel() / copy_us / 1e3, "bf16_TFLOPs": 2 * 8192**3 / matmul_us / 1e6}


def traffic(case: Case) -> tuple[float, float]:
    """(bytes, FLOPs) the step must move and compute at the least (the layer kind says how much:
    ``LayerKind.keys_read``, ``scores``): the cache entries read once (in the cache's dtype: an fp8
    cache moves half the bytes; a sparse layer's top-k and window part only), Q read (an fp8 query
    in one byte an element), O written."""
    spec, layout = case.spec, case.spec.layout
    element = torch.finfo(spec.dtype).bits // 8
    cache_element = torch.finfo(spec.effective_kv_cache_dtype).bits // 8
    kv_bytes_per_token = layout.cache_row(spec) * cache_element
    kv_bytes = sum(layout.keys_read(spec, context + query) for context, query in case.batch) * kv_bytes_per_token
    # An fp8 query is read in its own width (one byte), the rest of the token's I/O in the compute dtype.
    query_narrowing = spec.num_heads * spec.head_dim * (element - torch.finfo(spec.handed_query_dtype).bits // 8)
    io_bytes = case.num_tokens * (layout.io_elements(spec) * element - query_narrowing)
    flops = sum(layout.scores(spec, context, query) for context, query in case.batch) * layout.flops_per_score(spec)
    return kv_bytes + io_bytes, flops


@dataclass
class TimedInputs:
    """What a timed forward is handed: the step's rows already written, its metadata built from
    host lengths (``common`` kept to time ``build`` and to capture), the query with the case's
    padding rows (zeros: the bench times, the checks judge what padding holds), and an output."""

    common: CommonAttentionMetadata
    metadata: Any
    query: torch.Tensor
    out: torch.Tensor


def timed_inputs(prepared: PreparedCase) -> TimedInputs:
    """One case's step made ready to time, as ``conformance bench`` and the tuning sweeps time it."""
    batch, backend = prepared.batch, prepared.backend
    common = batch.common_metadata(with_host_lengths=True)
    key, value, slots = batch.step_rows()
    backend.write_kv(prepared.kv_cache, key, value, slots, layer=prepared.layer)
    query = torch.cat([batch.query, batch.query.new_zeros(batch.case.padding, *batch.query.shape[1:])])
    return TimedInputs(common, backend.build(common), query, poisoned_output(batch))


class BenchCheck(Check):
    name = "bench"
    drives_trees = True  # its step hands the case's trees to the backend and the oracle
    kinds = EVERY_KIND
    question = "build µs (CPU), forward µs (GPU), graph replay µs, achieved bandwidth vs measured peak"

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self._ceilings: dict[str, float] | None = None
        self._flush: Callable[[], None] | None = None

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        return None if device.type == "cuda" else "benchmarks need a CUDA device"

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        if self._ceilings is None:
            self._ceilings = measure_ceilings(device)
            self._flush = _l2_flusher(device)
        prepared = prepare_case(backend_cls, case, device, poison=False)
        backend, layer = prepared.backend, prepared.forward_layer
        inputs = timed_inputs(prepared)
        common, query, out = inputs.common, inputs.query, inputs.out

        build_us = time_cpu(lambda: backend.build(common))
        metadata = backend.build(common)
        forward_us = time_gpu(
            lambda: backend.forward(query, prepared.kv_cache, metadata, out, layer=layer), self._flush
        )
        replay_us = None
        claims = backend_cls.capabilities.cuda_graphs
        if claims != CGSupport.NEVER and graph_class_reason(claims, case) is None:
            graph = torch.cuda.CUDAGraph()
            capture_metadata = backend.build_for_capture(common)
            with torch.cuda.graph(graph):
                backend.forward(query, prepared.kv_cache, capture_metadata, out, layer=layer)
            replay_us = time_gpu(graph.replay, self._flush)
        moved, flops = traffic(case)
        bandwidth = moved / forward_us / 1e3
        rate = flops / forward_us / 1e6
        metrics = {
            "build_us": build_us,
            "forward_us": forward_us,
            "replay_us": replay_us,
            "bytes": moved,
            "flops": flops,
            "GBps": bandwidth,
            "TFLOPs": rate,
            "roofline_fraction": max(bandwidth / self._ceilings["copy_GBps"], rate / self._ceilings["bf16_TFLOPs"]),
            **self._ceilings,
        }
        summary = f"forward {forward_us:.1f} µs ({bandwidth:.0f} GB/s), build {build_us:.1f} µs"
        return Outcome(Verdict.PASS, summary, metrics=metrics)
