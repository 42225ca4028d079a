"""CUDA graphs for the batched engine's uniform steps.

Target forward: a uniform batch (every row decodes with the same query length: plain decode q = 1,
spec-verify q = 1 + k) is padded to the next captured batch size (1, 2, 4, 8, … up to
max_num_reqs) and replayed from one graph per (padded size, query length), captured on first use.
Padding rows get seq_len = query_len, slot -1 (they write nothing) and block-table row 0 (the
reserved null block), so they read only memory the engine never hands out. Mixed batches run
eagerly. Only what the backend claims is captured: ``UNIFORM_SINGLE_TOKEN_DECODE`` allows q = 1,
``UNIFORM_BATCH`` and ``ALWAYS`` any uniform q, ``NEVER`` nothing (the engine runs eagerly).

The backend's ``build`` runs on the host before every replay, as the contract says; the graph was
captured with ``build_for_capture`` over the same persistent buffers.
"""
from __future__ import annotations

import torch

from backends.base import CGSupport, CommonAttentionMetadata
from reference_engine.model import StepInputs


def padded_size(num_reqs: int, max_num_reqs: int) -> int | None:
    size = 1
    while size < num_reqs:
        size *= 2
    return size if size <= max_num_reqs else (max_num_reqs if num_reqs <= max_num_reqs else None)


class _Buffers:
    """Persistent inputs of every graph with one query length, sized for the largest batch."""

    def __init__(self, max_reqs: int, query_len: int, max_blocks: int, device: torch.device) -> None:
        tokens = max_reqs * query_len
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_reqs + 1, dtype=torch.int32, device=device) * query_len
        self.seq_lens = torch.full((max_reqs,), query_len, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)


class StepGraphs:
    def __init__(self, engine) -> None:
        self.engine = engine
        config = engine.config
        self.support = type(engine.backend).capabilities.cuda_graphs
        self.enabled = engine.device.type == "cuda" and self.support != CGSupport.NEVER
        self.max_reqs = config.max_num_reqs
        self.max_blocks = -(-config.model.max_model_len // config.block_size)
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.replays = 0
        self.captures = 0

    def allows(self, query_len: int) -> bool:
        if not self.enabled:
            return False
        return query_len == 1 or self.support >= CGSupport.UNIFORM_BATCH

    def run(self, step, common: CommonAttentionMetadata) -> torch.Tensor | None:
        """The hidden states of a uniform step from a graph replay; None to run it eagerly."""
        query_len, num_reqs = common.max_query_len, common.num_reqs
        size = padded_size(num_reqs, self.max_reqs)
        if size is None or not self.allows(query_len):
            return None
        buffers = self.buffers.get(query_len)
        if buffers is None:
            buffers = self.buffers[query_len] = _Buffers(self.max_reqs, query_len, self.max_blocks, self.engine.device)
        real, padded = num_reqs * query_len, size * query_len
        buffers.input_ids[:real].copy_(step.input_ids)
        buffers.input_ids[real:padded].zero_()
        buffers.positions[:real].copy_(step.positions)
        buffers.positions[real:padded].zero_()
        buffers.slot_mapping[:real].copy_(step.slot_mapping)
        buffers.slot_mapping[real:padded].fill_(-1)
        buffers.seq_lens[:num_reqs].copy_(step.seq_lens)
        buffers.seq_lens[num_reqs:size].fill_(query_len)
        width = common.block_table.shape[1]
        buffers.block_table[:size].zero_()
        buffers.block_table[:num_reqs, :width].copy_(common.block_table)
        padded_common = CommonAttentionMetadata(
            query_start_loc=buffers.query_start_loc[: size + 1], seq_lens=buffers.seq_lens[:size],
            block_table=buffers.block_table[:size], slot_mapping=buffers.slot_mapping[:padded],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32) * query_len, num_reqs=size,
            num_actual_tokens=padded, max_query_len=query_len,
            max_seq_len=self.engine.config.model.max_model_len,  # a graph serves every length up to this
            host_seq_lens=None,
        )
        key = (size, query_len)
        if key not in self.graphs:
            self.graphs[key] = self._capture(buffers, padded_common, padded)
        graph, hidden = self.graphs[key]
        self.engine.backend.build(padded_common)
        graph.replay()
        self.replays += 1
        return hidden[:real]

    def _capture(self, buffers: _Buffers, common: CommonAttentionMetadata, tokens: int):
        engine = self.engine
        metadata = engine.backend.build_for_capture(common)
        inputs = StepInputs(engine.backend, metadata, engine.kv_caches, buffers.slot_mapping[:tokens])

        def forward():
            return engine.model(buffers.input_ids[:tokens], buffers.positions[:tokens], inputs)

        # Eager runs on a side stream first (lazy kernel compilation, cuBLAS workspaces). They
        # write this step's KV exactly as the replay will, so running them is harmless.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward()
        self.captures += 1
        return graph, hidden
