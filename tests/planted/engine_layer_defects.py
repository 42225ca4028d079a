"""Planted defects that the engine check's self-comparisons cannot see: each is wrong the same way
in every run of the engine (plain, speculative, sync, async, drafting through it), so only a run
through an independent backend (torch_naive) or a look at the steps where the batch changes shows it.

Two keep the first layer's state for every layer: the engine's model has two layers of one spec,
served by one backend object, each with its own learned sinks and fp8 scales. One syncs only when
the number of requests changes, which a steady state of identical batches never does."""

from __future__ import annotations

import torch

from backends.base import KVScales
from backends.torch_naive import TorchNaiveBackend
from tests.planted.graph_backends import TorchGraphSafe


class KeepsFirstLayerSinks(TorchNaiveBackend):
    """Copies the sinks of its first forward into a persistent buffer (as a backend that stages
    per-head constants once for its kernel, or for a CUDA graph, does) and attends with that
    buffer from then on: every layer it serves gets layer 0's sinks."""

    name = "planted_keeps_first_layer_sinks"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.kept_sinks: torch.Tensor | None = None

    def forward(self, query, kv_cache, metadata, out, scales=None, sinks=None, lse=None) -> None:
        if sinks is not None:
            if self.kept_sinks is None:
                self.kept_sinks = sinks.clone()
            sinks = self.kept_sinks
        super().forward(query, kv_cache, metadata, out, scales=scales, sinks=sinks, lse=lse)


class KeepsFirstLayerScales(TorchNaiveBackend):
    """Writes with each layer's fp8 scales, but its attention dequantizes with a copy of the scales
    its first forward saw (a descale staged once, as for a CUDA graph, and never refreshed): every
    later layer reads its cache at layer 0's scale, its keys and values off by the ratio of the two."""

    name = "planted_keeps_first_layer_scales"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.kept_scales: KVScales | None = None

    def forward(self, query, kv_cache, metadata, out, scales=None, sinks=None, lse=None) -> None:
        if scales is not None:
            if self.kept_scales is None:
                self.kept_scales = KVScales.on(self.device, scales.k_scale, scales.v_scale)
            scales = self.kept_scales
        super().forward(query, kv_cache, metadata, out, scales=scales, sinks=sinks, lse=lse)


class SyncsWhenBatchChanges(TorchGraphSafe):
    """Re-plans from the longest length, read from the device (``.item()``: a blocking sync),
    whenever a batch has another number of requests than its last build's (a plan cached by batch
    size): never while the same requests decode, once each time a request joins or leaves."""

    name = "planted_syncs_when_batch_changes"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.last_num_reqs: int | None = None

    def build(self, common):
        if common.num_reqs != self.last_num_reqs:
            self.last_num_reqs = common.num_reqs
            self.longest = int(common.seq_lens.max().item())
        return super().build(common)
