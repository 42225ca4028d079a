"""Planted sparse-attention defects (DeepSeek's DSA), each torch_naive with one bug of a kind sparse
backends have shipped or nearly shipped: the indices ignored (a dense kernel on a sparse layer),
-1 taken as a slot, an entry past the token's own position attended (the indexer's causal edge
trusted), the window part placed once per request instead of per token (position-dependent
metadata computed from the request's length: the class of vLLM #41162), and the window part
dropped."""

from __future__ import annotations

import torch

from backends.base import PLAIN_LAYER, LayerParameters
from backends.fp8_ds_mla import DsMlaLayout
from backends.torch_naive import TorchNaiveBackend
from backends.triton.mla_backend import TritonMLABackend


class IgnoresTheIndices(TorchNaiveBackend):
    """Attends to every earlier position, as a dense MLA kernel does: the indexer's choice is lost."""

    def indexed(self, rows, context_len):
        return super().indexed(torch.full_like(rows, -1), context_len) | self._causal(rows, context_len)

    @staticmethod
    def _causal(rows, context_len):
        seq_len = context_len + rows.shape[0]
        query_positions = context_len + torch.arange(rows.shape[0], device=rows.device)
        return torch.arange(seq_len, device=rows.device)[None, :] <= query_positions[:, None]


class GathersItsKeys(TorchNaiveBackend):
    """Sparse attention as the kernels do it: each token's entries translated to cache slots
    through the block table and gathered, one softmax term per slot (a correct base for the
    defects below that live in the translation)."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if layer.topk_indices is None:
            return super().forward(query, kv_cache, metadata, out, layer)
        plane = self.slot_planes(kv_cache)[0][:, 0]  # [slots, Dk]
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            for row in range(start, end):
                position = seq_len - (end - start) + row - start
                slots = self.slots_of(layer.topk_indices[row].long(), position, metadata.block_table[request])
                key = plane[slots].float()
                if self.spec.fp8_kv_cache:
                    key = self.dequantize(key, layer.scales.k_scale)
                weights = ((query[row].float() @ key.T) * self.softmax_scale()).softmax(dim=-1)  # [H, n]
                out[row] = (weights @ key[:, : self.spec.kv_lora_rank]).to(out.dtype)

    def slots_of(self, entries: torch.Tensor, position: int, block_table_row: torch.Tensor) -> torch.Tensor:
        """The cache slots one token attends: its entries up to its own position, then its window part."""
        listed = entries[(entries >= 0) & (entries <= position)]
        window = self.spec.sparse_window or 0
        recent = torch.arange(max(0, position - window + 1), position + 1, device=entries.device)
        positions = torch.cat([listed, recent])
        return self.translate(positions, block_table_row)

    def translate(self, positions: torch.Tensor, block_table_row: torch.Tensor) -> torch.Tensor:
        block_size = self.spec.block_size
        return block_table_row.long()[positions // block_size] * block_size + positions % block_size


class MinusOneIsSlotMinusOne(GathersItsKeys):
    """Masks entries past the token's position but not -1, which the translation turns into slot
    -1: the pool's last slot (a free block's, poisoned) joins the softmax of every row with a -1."""

    def slots_of(self, entries, position, block_table_row):
        slots = super().slots_of(entries, position, block_table_row)
        unfilled = int((entries == -1).sum())
        return torch.cat([slots, torch.full((unfilled,), -1, dtype=slots.dtype, device=slots.device)])


class AttendsPastItsPosition(TorchNaiveBackend):
    """Trusts the indexer's causal edge: every listed position inside the sequence is attended, a
    later token's too (a sparse kernel that masks only -1 and the sequence's end). Shows on a
    ``messyidx`` case (an indexer's own rows never list such a position)."""

    def indexed(self, rows, context_len):
        seq_len = context_len + rows.shape[0]
        keys = torch.arange(seq_len, device=rows.device)
        listed = (rows.long()[:, :, None] == keys[None, None, :]).any(dim=1)
        return listed | super().indexed(rows, context_len)

    def visible(self, query_positions, key_positions):
        # The listed entries decide alone: no causal mask over them.
        return torch.ones(len(query_positions), len(key_positions), dtype=torch.bool, device=key_positions.device)


class WindowOfTheRequestsLastToken(TorchNaiveBackend):
    """Places the window part once per request, at its last token (the window's first position
    computed from seq_len, as metadata built per request is): every earlier token of a verify or a
    prefill gets the last token's window, positions past its own masked off by causality only."""

    def indexed(self, rows, context_len):
        seq_len = context_len + rows.shape[0]
        window = self.spec.sparse_window
        keys = torch.arange(seq_len, device=rows.device)
        query_positions = context_len + torch.arange(rows.shape[0], device=rows.device)
        listed = (rows.long()[:, :, None] == keys[None, None, :]).any(dim=1)
        listed &= keys[None, :] <= query_positions[:, None]
        if window is None:
            return listed
        last_window = (keys >= seq_len - window)[None, :] & (keys[None, :] <= query_positions[:, None])
        return listed | last_window


class DropsTheWindowPart(TorchNaiveBackend):
    """Attends only to the indexed positions: the window part (``sparse_window``) is never read."""

    def indexed(self, rows, context_len):
        seq_len = context_len + rows.shape[0]
        keys = torch.arange(seq_len, device=rows.device)
        query_positions = context_len + torch.arange(rows.shape[0], device=rows.device)
        listed = (rows.long()[:, :, None] == keys[None, None, :]).any(dim=1)
        return listed & (keys[None, :] <= query_positions[:, None])


class KeepsBuildPositions:
    """``update_for_draft_step`` re-points the lengths but keeps every token's position from
    ``build`` (a mixin for the Triton backends whose sparse metadata places tokens)."""

    def update_for_draft_step(self, metadata, common):
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table = (
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
        )
        return metadata


class StalePositionsInDraftSteps(KeepsBuildPositions, TritonMLABackend):
    """triton_mla whose draft update keeps every token's position from ``build``: the causal edge
    and the window part stay at the first draft step (vLLM #41162: the sparse layer's window
    metadata not rebuilt in MTP's draft steps)."""


class _OneScaleAToken(DsMlaLayout):
    def pack(self, entry):
        latent = entry[:, : self.latent].float()
        # Every block stored over the token's one scale (max over the whole latent): a per-128 layout
        # filled with per-token scales.
        one = (latent.abs().amax(dim=-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(
            min=torch.finfo(torch.float32).tiny
        )
        tiled = entry.clone()
        packed = super().pack(tiled)
        scales = one.expand(-1, self.blocks).contiguous()
        stored = (latent / one).clamp(-448, 448).to(torch.float8_e4m3fn)
        packed[:, : self.latent] = stored.view(torch.uint8)
        packed[:, self.latent : self.latent + 4 * self.blocks] = scales.view(torch.uint8).reshape(entry.shape[0], -1)
        return packed


class ScalesPerTokenInDsMla(TorchNaiveBackend):
    """DeepSeek's fp8_ds_mla with one scale a token copied into each block's place (the per-128
    scales applied per token): blocks of small numbers lose their precision."""

    def __init__(self, spec, limits, device) -> None:
        super().__init__(spec, limits, device)
        if self.packed is not None:
            self.packed = _OneScaleAToken(spec)
