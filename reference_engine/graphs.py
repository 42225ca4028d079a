"""CUDA graphs for the batched engine: the pieces of a uniform step, captured per key and replayed.

A uniform step (every row decodes with the same query length: plain decode q = 1, spec-verify
q = 1 + k) is padded to the next captured batch size (1, 2, 4, 8, … up to max_num_reqs), its host
inputs uploaded at fixed offsets, and run as segments over persistent buffers of its size:

* ``scripted``: the scripted drafter's drafts (no attention);
* ``draft loop``: all k draft forwards in one graph, ``update_for_draft_step`` between them, when
  the backend claims ``draft_step_update``; otherwise ``draft step``: one draft forward captured
  once and replayed k times, the step index in a device scalar, the backend's ``build`` on the
  host between replays;
* ``verify``: target forward, rejection, commit into the device state, the results to download.

Each segment's first use of a key runs eagerly (Triton JIT, cuBLAS handles), the second is
captured, and from then on it is replayed. Before every replay the backend's ``build`` runs on the
host over the same persistent tensors, as the contract says; the input preparation that starts an
attention segment runs eagerly just before it, so a backend that needs host lengths reads this
step's lengths, not the last replay's. Padding rows decode from a spare device-state slot that
never commits (their seq_len = query_len, slot -1, block-table row 0: the reserved null block);
for a backend that claims vLLM's empty requests, attention sees them as such (query and seq_len 0,
block-table row -1: ``empty_padding``).
Only what the backend claims is captured: ``UNIFORM_SINGLE_TOKEN_DECODE`` allows q = 1,
``UNIFORM_BATCH`` and ``ALWAYS`` any uniform q, ``NEVER`` nothing (the engine runs eagerly).
"""

from __future__ import annotations

import gc
from typing import Callable

import torch

from backends.base import CGSupport, CommonAttentionMetadata


def padded_size(num_reqs: int, max_num_reqs: int) -> int | None:
    size = 1
    while size < num_reqs:
        size *= 2
    return size if size <= max_num_reqs else (max_num_reqs if num_reqs <= max_num_reqs else None)


class StepGraphs:
    def __init__(self, engine) -> None:
        self.engine = engine
        capabilities = engine.backend.capabilities
        self.support = capabilities.cuda_graphs
        self.one_graph_draft_loop = engine.draft_steps_update_metadata
        self.enabled = engine.device.type == "cuda" and self.support != CGSupport.NEVER
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.seen: set[tuple] = set()
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.replays = 0
        self.captures = 0

    def allows(self, query_len: int) -> bool:
        if not self.enabled:
            return False
        return query_len == 1 or self.support >= CGSupport.UNIFORM_BATCH

    def size_for(self, num_reqs: int, query_len: int) -> int | None:
        """The padded batch size a uniform step of ``num_reqs`` rows replays at; None: eager."""
        config = self.engine.config
        size = padded_size(num_reqs, config.max_num_reqs)
        # Draft steps (q = 1) run inside the step as well: the backend must allow both.
        drafting = self.engine.drafts_with_attention and config.num_spec_tokens
        if size is None or not self.allows(query_len) or (drafting and not self.allows(1)):
            return None
        return size if size * query_len <= config.max_num_tokens else None

    def run(self, key: tuple, common: CommonAttentionMetadata | None, segment: Callable[[object], object]):
        """``segment(metadata)``'s output: eager the first time ``key`` is seen, then from a graph.
        ``common``: the segment's attention batch (None: no attention), over persistent tensors."""
        backend = self.engine.backend
        entry = self.graphs.get(key)
        if entry is None and key not in self.seen:
            self.seen.add(key)
            return segment(backend.build(common) if common is not None else None)
        if entry is None:
            metadata = backend.build_for_capture(common) if common is not None else None
            graph = torch.cuda.CUDAGraph()
            collecting = gc.isenabled()
            gc.disable()  # a collection mid-capture could free another engine's graph: not allowed while capturing
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    output = segment(metadata)
            finally:
                if collecting:
                    gc.enable()
            entry = self.graphs[key] = (graph, output)
            self.captures += 1
        graph, output = entry
        if common is not None:
            backend.build(common)
        graph.replay()
        self.replays += 1
        return output
