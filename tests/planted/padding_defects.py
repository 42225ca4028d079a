"""Planted defects of vLLM's empty padding requests (query length 0, seq_len 0, block-table row
-1), each torch_naive claiming that padding style with one bug of a kind that reached vLLM and
FlashInfer users (vLLM #37442, #38436, #37815; FlashInfer #2883): a kernel that writes each
request's last query token, an empty request's 0/0, a -1 row read as a block id."""

from __future__ import annotations

import torch

from backends.base import PLAIN_LAYER, LayerParameters
from backends.torch_naive import TorchNaiveBackend


class EmptyRequestsMixin:
    def empty_requests(self, metadata) -> list[int]:
        starts = metadata.query_start_loc
        return [request for request in range(len(metadata.seq_lens)) if starts[request + 1] == starts[request]]


class WritesLastTokenOfEachRequest(EmptyRequestsMixin, TorchNaiveBackend):
    """Every request's program writes the output row ``query_start_loc[r + 1] - 1`` (its last query
    token, the one a sampler reads); an empty request's program has attended to nothing and
    writes zeros there, over the previous request's last token."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        super().forward(query, kv_cache, metadata, out, layer)
        for request in self.empty_requests(metadata):
            last = metadata.query_start_loc[request + 1] - 1
            if last >= 0:
                out[last] = 0


class EmptyRequestWritesNaN(EmptyRequestsMixin, TorchNaiveBackend):
    """A decode-style program per request that takes its query length to be 1: an empty request
    divides 0 by 0 and writes the NaN row at ``query_start_loc[r]``, the next request's first
    token or, at the end of the batch, a row past the real tokens."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        super().forward(query, kv_cache, metadata, out, layer)
        for request in self.empty_requests(metadata):
            row = metadata.query_start_loc[request]
            if row < out.shape[0]:
                out[row] = torch.zeros_like(out[row]) / 0.0


class ReadsBlockMinusOne(EmptyRequestsMixin, TorchNaiveBackend):
    """Clamps a sequence length of 0 to 1 (to avoid the 0/0) and so reads the first slot of the
    request's block-table row -1, block id -1 (Python: the pool's last block, another request's;
    a GPU: memory before the pool), and writes that key's value as the empty request's output."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        super().forward(query, kv_cache, metadata, out, layer)
        planes = self.slot_planes(kv_cache)
        for request in self.empty_requests(metadata):
            row = metadata.query_start_loc[request]
            slot = int(metadata.block_table[request, 0]) * self.spec.block_size
            if row < out.shape[0]:
                value = planes[-1][slot].float()  # [Hkv, Dv] (MLA: the latent row)
                out[row] = (
                    value[..., : self.spec.v_head_dim]
                    .repeat_interleave(self.spec.query_group_size, dim=0)
                    .to(out.dtype)
                )
