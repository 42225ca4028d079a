"""Planted fp8-query defects (``backends.base``: "fp8 query"): torch_naive with the query's scale
dropped, dropped on decode rows only, the key's scale taken from the query, and the first layer's
query scale kept; a graph-safe backend reading the scale on the host; triton with its kernels
handed a scale of 1."""

from __future__ import annotations

from dataclasses import replace

import torch

from backends.base import PLAIN_LAYER
from backends.fp8 import from_cache
from backends.torch_naive import TorchNaiveBackend
from tests.planted.graph_backends import TorchGraphSafe


class QScaleDropped(TorchNaiveBackend):
    """Attends with the fp8 query's stored numbers, its scale never applied (vLLM #42080's Triton
    path without ``q_scale``)."""

    name = "planted_q_scale_dropped"

    def query_values(self, query, scales):
        return query.float() if self.spec.fp8_query else query


class QScaleDroppedInDecodeRows(TorchNaiveBackend):
    """Applies the query's scale on verify and prefill rows, and drops it on decode rows (a
    request of one token): a decode kernel of its own that was never handed ``q_scale``."""

    name = "planted_q_scale_dropped_in_decode_rows"

    def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
        self.decode_rows = torch.zeros(query.shape[0], dtype=torch.bool)
        starts = list(metadata.query_start_loc)
        for start, end in zip(starts, starts[1:]):
            if end - start == 1:
                self.decode_rows[start] = True
        return super().forward(query, kv_cache, metadata, out, layer=layer)

    def query_values(self, query, scales):
        scaled = super().query_values(query, scales)
        rows = self.decode_rows.to(query.device)[:, None, None]
        return torch.where(rows, query.float(), scaled)


class KeyScaleFromTheQuery(TorchNaiveBackend):
    """The q and k scales swapped where keys meet the cache: ``write_kv`` stores keys divided by
    ``q_scale`` and ``forward`` dequantizes them with it (consistent with itself, so its outputs
    alone look right): the stored cache is not the contract's."""

    name = "planted_key_scale_from_the_query"

    def scale_floats(self, scales):
        planes = super().scale_floats(scales)
        return planes if planes[0] is None else [scales.q_scale, planes[1]]


class KeepsFirstQScale(TorchNaiveBackend):
    """Keeps the first layer's query scale (a copy made at its first forward) for every layer."""

    name = "planted_keeps_first_q_scale"
    kept: float | None = None

    def query_values(self, query, scales):
        if not self.spec.fp8_query:
            return query
        if self.kept is None:
            self.kept = scales.q_scale
        return from_cache(query, self.kept)


class ReadsQScaleOnTheHost(TorchGraphSafe):
    """Graph-safe but for one thing: it reads the query's device scale on the host (``.item()``, a
    blocking sync every forward; SGLang #28144's neighbour, a scale read where a float was at hand)."""

    name = "planted_reads_q_scale_on_the_host"

    def device_query(self, query, scales):
        return query.float() * float(scales.q_scale_tensor.item())


def triton_q_scale_dropped():
    """triton whose kernels are handed a query scale of 1 (a launch that forgot the layer's)."""
    from backends.triton.backend import TritonAttentionBackend

    class TritonQScaleDropped(TritonAttentionBackend):
        def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
            ones = torch.ones_like(layer.scales.q_scale_tensor)
            layer = replace(layer, scales=replace(layer.scales, q_scale=1.0, q_scale_tensor=ones))
            return super().forward(query, kv_cache, metadata, out, layer=layer)

    return TritonQScaleDropped
