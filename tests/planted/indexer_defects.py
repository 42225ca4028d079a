"""Planted lightning-indexer defects, each torch_indexer with one bug of a kind an indexer kernel
can have: the top-k over the whole sequence (the token's causal edge not applied: later tokens'
keys chosen), the fp8 keys read without their per-token scales, the ReLU applied to the weighted
sum instead of to each head's score, and scales that are not the contract's powers of two; and
triton_indexer with one bug each that a single eager step cannot show (stale positions in draft
steps, weights kept from a graph's capture, a host sync, a plan kept per batch size)."""

from __future__ import annotations

from dataclasses import replace

import torch

from backends.base import PLAIN_LAYER
from backends.torch_indexer import TorchIndexerBackend
from backends.triton.indexer import TritonIndexerBackend
from backends.triton.sparse_mla import SparseMetadata
from tests.planted.sparse_defects import KeepsBuildPositions


class TopKOverTheWholeSequence(TorchIndexerBackend):
    """Ranks every position of the request, the step's later tokens' too."""

    def logits(self, query, keys, weights, context_len):
        return super().logits(query, keys, weights, context_len=keys.shape[0])  # every position "visible"


class WholePagesMaskedByAddition(TorchIndexerBackend):
    """Scores every slot of the request's pages, their unwritten tail too, and masks the positions
    past each token's own by adding -inf (as a kernel adds a mask tile): a finite value read there
    vanishes, a NaN stays NaN and pushes out a position that belongs in the top-k."""

    def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
        topk, block_size = self.spec.sparse_topk, self.spec.block_size
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if end == start:
                continue
            pages = -(-seq_len // block_size) * block_size
            keys = self.keys(kv_cache, metadata.block_table[request], pages)
            logits = self.logits(query[start:end], keys, layer.index_weights[start:end], pages)  # no mask
            positions = seq_len - (end - start) + torch.arange(end - start, device=query.device)
            causal = torch.arange(pages, device=query.device)[None, :] <= positions[:, None]
            logits = logits + torch.zeros_like(logits).masked_fill(~causal, float("-inf"))
            count = min(topk, seq_len)
            best, chosen = logits.topk(count, dim=1)
            rows = torch.full((end - start, topk), -1, dtype=out.dtype, device=out.device)
            rows[:, :count] = torch.where(best > float("-inf"), chosen, -1).to(out.dtype)
            out[start:end] = rows


class KeysWithoutTheirScales(TorchIndexerBackend):
    """Reads the stored e4m3 keys as they are, each token's scale left out."""

    def keys(self, kv_cache, block_table_row, seq_len):
        block_size = self.spec.block_size
        blocks = block_table_row[: -(-seq_len // block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=blocks.device)).reshape(-1)[:seq_len]
        return self.gather(kv_cache, slots)[0].float()


class ReluOfTheSum(TorchIndexerBackend):
    """Weighs the heads' raw scores and applies the ReLU once to their sum."""

    def logits(self, query, keys, weights, context_len):
        scores = torch.einsum("qhd,sd->qhs", query.float(), keys)
        logits = torch.einsum("qh,qhs->qs", weights.float(), scores).clamp(min=0)
        positions = context_len + torch.arange(query.shape[0], device=query.device)
        causal = torch.arange(keys.shape[0], device=query.device)[None, :] <= positions[:, None]
        return logits.masked_fill(~causal, float("-inf"))


class _OwnScales(TorchIndexerBackend):
    """torch_indexer whose keys are written over ``scales(rows)`` instead of the contract's."""

    @staticmethod
    def scales(rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def write_kv(self, kv_cache, key, value, slot_mapping, layer=None):
        from backends import torch_indexer

        original = torch_indexer.token_scales
        torch_indexer.token_scales = lambda rows, dtype: self.scales(rows)
        try:
            super().write_kv(kv_cache, key, value, slot_mapping)
        finally:
            torch_indexer.token_scales = original


class ExactScales(_OwnScales):
    """Stores each key over max|key| / 448 exactly, not the contract's power of two: the attention
    of its own keys is as good, but a reader of DeepSeek's ue8m0 cache format would misread them."""

    @staticmethod
    def scales(rows):
        return (rows.float().abs().amax(-1) / 448.0).clamp(min=1e-12)


class KeysQuantizedWithoutTheirScales(_OwnScales):
    """Stores each key cast to e4m3 as it is (a scale of 1, the per-token scale never computed):
    keys past 448 saturate, small ones fall among e4m3's subnormals."""

    @staticmethod
    def scales(rows):
        return torch.ones(rows.shape[0], device=rows.device)


# Defects of a graph-safe indexer (triton_indexer) that only the checks driving steps see: each
# chooses right in one eager step, as the indexer check runs it.
class StaleIndexerPositionsInDraftSteps(KeepsBuildPositions, TritonIndexerBackend):
    """triton_indexer whose draft update keeps each token's position from the first build: every
    draft step chooses among the positions of the first, one fewer than it has (vLLM #41162's
    class, in the indexer)."""


class WeightsKeptFromCapture(TritonIndexerBackend):
    """Copies the head weights it is handed on its first forward into a buffer of its own and
    reads that one from then on (a layer's weights cached like a constant): right in the step
    it was captured in, wrong in every replay with another step's weights."""

    kept = None

    def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
        if self.kept is None:
            self.kept = layer.index_weights.clone()
        super().forward(query, kv_cache, metadata, out, layer=replace(layer, index_weights=self.kept))


class LongestSequenceOnTheHost(TritonIndexerBackend):
    """Reads the batch's longest sequence back from the device in ``build``
    (``int(seq_lens.max())``, as a kernel sized by it would): a host sync every step, though it
    claims none."""

    def build(self, common):
        metadata = super().build(common)
        metadata.longest = int(common.seq_lens.max())
        return metadata


class RequestsPlacedOncePerBatchSize(TritonIndexerBackend):
    """Places each token's request and position again only when the number of requests
    changes (a plan cached by batch size): after a request leaves and another joins, the
    tokens are placed as the old batch had them."""

    placed_for = None

    def build(self, common):
        metadata = super(TritonIndexerBackend, self).build(common)  # the lengths, no token placed
        if self.placed_for != metadata.num_reqs:
            self.placed_for = metadata.num_reqs
            return self.positions.build(metadata)
        read = self.positions
        return SparseMetadata(
            **vars(metadata),
            token_request=read.token_request,
            token_position=read.token_position,
            num_tokens=read.num_tokens,
        )


class TiesBrokenAtRandom(TorchIndexerBackend):
    """Keeps its logits in e4m3 (a buffer of fp8 logits: many exact ties) and breaks ties in
    whichever order its top-k's threads finish (random here), while claiming ``deterministic``:
    two runs of one step choose other positions among the ties."""

    def logits(self, query, keys, weights, context_len):
        logits = super().logits(query, keys, weights, context_len)
        coarse = logits.to(torch.float8_e4m3fn).float()
        step = coarse.abs().clamp(min=1e-3) / 64  # far below e4m3's step: orders ties only
        return torch.where(torch.isfinite(logits), coarse + torch.rand_like(coarse) * step, logits)
