"""Backends that touch memory they do not own while every output they write stays right: the
memory check exists for them.

The CPU ones (plain PyTorch) show the NaN-poison pass; the Triton ones are the issue's three
GPU defects, each an extra access beside our correct Triton backend, masked so numerics passes.
"""

from __future__ import annotations

import functools

import torch

from backends.base import PLAIN_LAYER, LayerParameters
from backends.torch_naive import TorchNaiveBackend


class ReadsWholeLastBlock(TorchNaiveBackend):
    """Gathers the request's last block whole and relies on the causal mask to hide the slots past
    its length: their weights are 0, but 0 × NaN is NaN."""

    name = "planted_reads_whole_last_block"

    def gather(self, plane, block_table_row, seq_len):
        block_size = self.spec.block_size
        blocks = block_table_row[: -(-seq_len // block_size)].long()
        offsets = torch.arange(block_size, device=plane.device)
        return plane[(blocks[:, None] * block_size + offsets[None, :]).reshape(-1)]


class WritesNextSlot(TorchNaiveBackend):
    """Writes every row at slot + 1 too, before the real write (which covers it for all but each
    request's last token): the last token's copy lands in the slot past the request's length."""

    name = "planted_writes_next_slot"

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER):
        block_size = self.spec.block_size
        inside = (slot_mapping >= 0) & ((slot_mapping + 1) % block_size != 0)  # kept inside its block
        super().write_kv(kv_cache, key, value, torch.where(inside, slot_mapping + 1, -1), layer)
        super().write_kv(kv_cache, key, value, slot_mapping, layer)


@functools.cache
def _triton_defects():
    """Defined on first use: Triton is imported only where a GPU test runs."""
    import triton
    import triton.language as tl

    from backends.triton.backend import TritonAttentionBackend

    @triton.jit
    def masked_extra_read_kernel(
        v_cache_ptr,
        block_table_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        out_ptr,
        zero,
        num_blocks,
        stride_table,
        stride_cache_block,
        stride_cache_token,
        stride_out_token,
        NEXT_ROW: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Reads one more KV block per request and adds it with weight ``zero`` to head 0 of the
        request's first output row: the result is unchanged unless the block holds NaN."""
        request = tl.program_id(0)
        blocks = tl.cdiv(tl.load(seq_lens_ptr + request), PAGE_SIZE)
        if NEXT_ROW:  # the next request's row (past the table for the last request)
            entry = (request + 1) * stride_table + blocks - 1
        else:  # the entry after the request's last block (a loop bound one too far)
            entry = request * stride_table + blocks
        block = tl.load(block_table_ptr + entry).to(tl.int64)
        # A block id read past the table is replaced by block 0 when outside the pool, so that
        # outside compute-sanitizer the
        # defect reads garbage inside the pool rather than crashing the checks not looking for it.
        block = tl.where((block >= 0) & (block < num_blocks), block, 0)
        tokens = tl.arange(0, PAGE_SIZE)
        dims = tl.arange(0, BLOCK_D)
        value = tl.load(
            v_cache_ptr + block * stride_cache_block + tokens[:, None] * stride_cache_token + dims[None, :],
            mask=dims[None, :] < HEAD_DIM,
            other=0.0,
        )
        row = out_ptr + tl.load(query_start_loc_ptr + request) * stride_out_token + dims
        current = tl.load(row, mask=dims < HEAD_DIM)
        tl.store(row, current + zero * tl.sum(value.to(tl.float32), axis=0), mask=dims < HEAD_DIM)

    @triton.jit
    def write_one_row_past_kernel(
        key_ptr,
        k_cache_ptr,
        slot_mapping_ptr,
        num_slots,
        stride_key_token,
        stride_cache_block,
        stride_cache_token,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """A write_kv grid one program too large: the last program reads the slot mapping and the
        key one row past their ends (and writes head 0 there when the slot it read is in the pool)."""
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token)
        dims = tl.arange(0, BLOCK_D)
        key = tl.load(key_ptr + token * stride_key_token + dims, mask=dims < HEAD_DIM)
        if (slot >= 0) & (slot < num_slots):
            tl.store(
                k_cache_ptr + (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_token + dims,
                key,
                mask=dims < HEAD_DIM,
            )

    class MaskedExtraRead(TritonAttentionBackend):
        next_row = False

        def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
            super().forward(query, kv_cache, metadata, out, layer)
            v_cache = kv_cache[1]  # [blocks, kv heads, page, dim]
            masked_extra_read_kernel[(metadata.num_reqs,)](
                v_cache,
                metadata.block_table,
                metadata.query_start_loc,
                metadata.seq_lens,
                out,
                0.0,
                v_cache.shape[0],
                metadata.block_table.stride(0),
                v_cache.stride(0),
                v_cache.stride(2),
                out.stride(0),
                NEXT_ROW=self.next_row,
                PAGE_SIZE=self.spec.block_size,
                HEAD_DIM=self.spec.head_dim,
                BLOCK_D=self.block_d,
            )

    class ReadsBlockPastEnd(MaskedExtraRead):
        """Reads the block-table entry after the request's last block, and that block, masked."""

        name = "planted_reads_block_past_end"

    class ReadsNextTableRow(MaskedExtraRead):
        """Reads the next request's block-table row (past the table for the last request), masked."""

        name = "planted_reads_next_table_row"
        next_row = True

    class WritesRowPastSlotMapping(TritonAttentionBackend):
        """write_kv launches one program more than there are rows."""

        name = "planted_writes_row_past_slot_mapping"

        def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
            super().write_kv(kv_cache, key, value, slot_mapping, layer)
            k_cache = kv_cache[0]
            write_one_row_past_kernel[(slot_mapping.shape[0] + 1,)](
                key,
                k_cache,
                slot_mapping,
                k_cache.shape[0] * self.spec.block_size,
                key.stride(0),
                k_cache.stride(0),
                k_cache.stride(2),
                PAGE_SIZE=self.spec.block_size,
                HEAD_DIM=self.spec.head_dim,
                BLOCK_D=self.block_d,
            )

    defects = (ReadsBlockPastEnd, ReadsNextTableRow, WritesRowPastSlotMapping)
    for defect in defects:
        defect.__qualname__ = defect.__name__  # loadable as tests.planted.memory:NAME
    return defects


def __getattr__(name: str):
    """``tests.planted.memory:ReadsBlockPastEnd`` loads like any backend (the sanitized child
    imports it by that name)."""
    defects = {cls.__name__: cls for cls in _triton_defects()} if name in TRITON_DEFECTS else {}
    if name in defects:
        return defects[name]
    raise AttributeError(name)


TRITON_DEFECTS = ("ReadsBlockPastEnd", "ReadsNextTableRow", "WritesRowPastSlotMapping")
