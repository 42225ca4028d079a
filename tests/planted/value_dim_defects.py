"""A planted defect of a value head dim other than the query/key one (DeepSeek-V3's prefill,
192 / 128): torch_naive reading each token's value at an offset computed from the value's own
width, as a kernel written for one head dim does, where the key before it is wider."""

from __future__ import annotations

from backends.torch_naive import TorchNaiveBackend


class ValueOffsetFromValueDim(TorchNaiveBackend):
    """Writes right; reads the value from channel ``v_head_dim`` of the token's [key | value] row
    instead of channel ``head_dim`` (right whenever the two dims are equal)."""

    def slot_planes(self, kv_cache):
        planes = super().slot_planes(kv_cache)
        if self.spec.kind == "mla" or self.spec.v_head_dim == self.spec.head_dim:
            return planes
        start = self.spec.v_head_dim
        return [planes[0], kv_cache[..., start : start + self.spec.v_head_dim].flatten(0, 1)]
