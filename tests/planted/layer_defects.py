"""Planted defects of state shared across layers: engines build a step's metadata once and call
``write_kv`` + ``forward`` for every layer, each with its own pool, fp8 scales and learned sinks.
Each is torch_naive (or, for the passes under CUDA graphs, the graph-safe torch backend) with one
bug that a pass over a single layer cannot see; and an LSE written on the eager path only. (The
fp8 scales kept in the step's metadata: ``fp8_defects.KeepsFirstLayerScales``.)"""

from __future__ import annotations

import dataclasses

import torch

from backends.base import PLAIN_LAYER, Fp8Scales, LayerParameters
from backends.features import ATTENTION_SINKS, LSE
from backends.torch_naive import NaiveMetadata, TorchNaiveBackend
from tests.planted.graph_backends import TorchGraphSafe


@dataclasses.dataclass
class StashingMetadata(NaiveMetadata):
    stashed: dict = dataclasses.field(default_factory=dict)


class StashesSinksInMetadata(TorchNaiveBackend):
    """Keeps the sinks of the first forward of a step in the step's metadata (a per-step cache of
    per-head constants, filled lazily): every later layer of the step reuses the first layer's."""

    name = "planted_stashes_sinks_in_metadata"

    def build(self, common):
        return StashingMetadata(**vars(super().build(common)))

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if layer.sinks is not None:
            layer = dataclasses.replace(layer, sinks=metadata.stashed.setdefault("sinks", layer.sinks.clone()))
        super().forward(query, kv_cache, metadata, out, layer)


class KeepsFirstSinks:
    """Copies the sinks of its first forward into a persistent buffer (as a backend that stages
    per-head constants once for its kernel, or for a CUDA graph, does) and attends with that
    buffer from then on: every layer it serves gets layer 0's sinks. (A mixin over a backend.)"""

    kept_sinks: torch.Tensor | None = None

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if layer.sinks is not None:
            if self.kept_sinks is None:
                self.kept_sinks = layer.sinks.clone()
            layer = dataclasses.replace(layer, sinks=self.kept_sinks)
        super().forward(query, kv_cache, metadata, out, layer)


class KeepsFirstLayerSinks(KeepsFirstSinks, TorchNaiveBackend):
    """``KeepsFirstSinks`` over torch_naive."""

    name = "planted_keeps_first_layer_sinks"


class KeepsFirstScalesInACopy(TorchNaiveBackend):
    """Writes with each layer's fp8 scales, but its attention dequantizes with a copy of the scales
    its first forward saw (a descale staged once, as for a CUDA graph, and never refreshed): every
    later layer reads its cache at layer 0's scale, its keys and values off by the ratio of the two."""

    name = "planted_keeps_first_scales_in_a_copy"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.kept_scales: Fp8Scales | None = None

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if layer.scales is not None:
            if self.kept_scales is None:
                self.kept_scales = Fp8Scales.on(self.device, layer.scales.k_scale, layer.scales.v_scale)
            layer = dataclasses.replace(layer, scales=self.kept_scales)
        super().forward(query, kv_cache, metadata, out, layer)


class GraphSafeWithSinksAndLse(TorchGraphSafe):
    """The graph-safe torch backend claiming learned sinks and the LSE (a correct control)."""

    name = "test_graph_safe_with_sinks_and_lse"
    capabilities = dataclasses.replace(
        TorchGraphSafe.capabilities, features=TorchGraphSafe.capabilities.features | {ATTENTION_SINKS, LSE}
    )


class KeepsFirstScalesOnDevice(TorchGraphSafe):
    """Copies the fp8 scale tensors of its first forward into buffers of its own (graph-safe: read
    on the device at replay) and dequantizes every later forward with them, whatever layer calls."""

    name = "planted_keeps_first_scales_on_device"
    kept = None

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        scales = layer.scales
        if scales is not None:
            if self.kept is None:
                self.kept = dataclasses.replace(
                    scales, k_scale_tensor=scales.k_scale_tensor.clone(), v_scale_tensor=scales.v_scale_tensor.clone()
                )
            layer = dataclasses.replace(layer, scales=self.kept)
        super().forward(query, kv_cache, metadata, out, layer)


class GraphSafeKeepsFirstSinks(KeepsFirstSinks, GraphSafeWithSinksAndLse):
    """``KeepsFirstSinks``, graph-safe: the copy is read on the device at every replay."""

    name = "planted_graph_safe_keeps_first_sinks"


class LseOnlyEager(GraphSafeWithSinksAndLse):
    """Writes the LSE on its eager path and launches its captured path without it (a second
    kernel variant, chosen when the stream is capturing): a replay leaves the buffer as it was."""

    name = "planted_lse_only_eager"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        super().forward(query, kv_cache, metadata, out, layer.with_lse(None) if capturing else layer)
