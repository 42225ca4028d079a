"""Planted defects of state shared across layers: engines build a step's metadata once and call
``write_kv`` + ``forward`` for every layer, each with its own pool, fp8 scales and learned sinks.
Each is torch_naive with one bug that a pass over a single layer cannot see."""

from __future__ import annotations

import dataclasses

from backends.torch_naive import NaiveMetadata, TorchNaiveBackend


@dataclasses.dataclass
class StashingMetadata(NaiveMetadata):
    stashed: dict = dataclasses.field(default_factory=dict)


class StashesSinksInMetadata(TorchNaiveBackend):
    """Keeps the sinks of the first forward of a step in the step's metadata (a per-step cache of
    per-head constants, filled lazily): every later layer of the step reuses the first layer's."""

    name = "planted_stashes_sinks_in_metadata"

    def build(self, common):
        return StashingMetadata(**vars(super().build(common)))

    def forward(self, query, kv_cache, metadata, out, scales=None, sinks=None, lse=None):
        if sinks is not None:
            sinks = metadata.stashed.setdefault("sinks", sinks.clone())
        super().forward(query, kv_cache, metadata, out, scales=scales, sinks=sinks, lse=lse)


class StashesScalesInMetadata(TorchNaiveBackend):
    """Keeps the fp8 scales of the first forward of a step in its metadata (read back once per
    step to save a host read per layer): every later layer dequantizes with the first layer's."""

    name = "planted_stashes_scales_in_metadata"

    def build(self, common):
        return StashingMetadata(**vars(super().build(common)))

    def forward(self, query, kv_cache, metadata, out, scales=None, sinks=None, lse=None):
        if scales is not None:
            scales = metadata.stashed.setdefault("scales", scales)
        super().forward(query, kv_cache, metadata, out, scales=scales, sinks=sinks, lse=lse)


class KeepsFirstSinks(TorchNaiveBackend):
    """Copies the sinks of its first forward into a persistent buffer (as a backend that stages
    per-head constants once) and attends with that buffer ever after, whatever layer calls."""

    name = "planted_keeps_first_sinks"
    kept = None

    def forward(self, query, kv_cache, metadata, out, scales=None, sinks=None, lse=None):
        if sinks is not None:
            if self.kept is None:
                self.kept = sinks.clone()
            sinks = self.kept
        super().forward(query, kv_cache, metadata, out, scales=scales, sinks=sinks, lse=lse)
