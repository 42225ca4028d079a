"""A sparse layer's index rows as slots of the paged pool, for kernels that take slots (FlashMLA's
sparse kernels): one Triton launch on the GPU, the same formula in torch on a CPU.

Each token lists positions of its own request (its top-k row, -1 for none, then its window part:
the ``window`` positions up to its own); a slot is ``block_table[request, position // block_size]
* block_size + position % block_size``, and -1 for an entry that is -1, past the token's own
position, or in a row past the step's real tokens. A padding row lists the first token's own
slot in its first column (that step wrote it) so that the kernel reads nothing else for it and
still writes the row. Columns past ``topk + window`` (the kernel's multiple) are -1.

In torch this was eleven small kernels over [tokens, entries] int64 tensors: 72 µs at 8 tokens
of DeepSeek-V3.2's top 2048 on an H200, more than FlashMLA's sparse decode itself (44 µs), so a
bench of the adapter measured mostly the translation."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError as missing:  # an extra: the CPU path below needs none
    if missing.name != "triton":
        raise
    triton = None

COLUMNS_PER_PROGRAM = 512


def slots_with_torch(rows, request, position, num_tokens, block_table, out, *, window: int, block_size: int) -> None:
    """The formula on any device: ``out`` [tokens, entries] int32 from ``rows`` [tokens, topk]."""
    tokens = out.shape[0]
    request, position = request[:tokens, None], position[:tokens, None]
    entries = rows[:tokens].long()
    if window:
        recent = position - (window - 1) + torch.arange(window, device=out.device)[None, :]
        entries = torch.cat([entries, recent], dim=1)
    real = torch.arange(tokens, device=out.device)[:, None] < num_tokens
    usable = (entries >= 0) & (entries <= position) & real
    entries = torch.where(usable, entries, 0)
    blocks = block_table.long()[request, entries // block_size]
    slots = torch.where(usable, blocks * block_size + entries % block_size, -1)
    own = block_table.long()[request[0, 0], position[0, 0] // block_size] * block_size + position[0, 0] % block_size
    slots[:, :1] = torch.where(real, slots[:, :1], own)
    out.fill_(-1)
    out[:, : slots.shape[1]] = slots


if triton is not None:

    @triton.jit
    def slots_kernel(
        rows_ptr,
        row_stride_t,
        row_stride_e,
        request_ptr,
        position_ptr,
        num_tokens_ptr,
        table_ptr,
        table_stride_r,
        table_stride_b,
        out_ptr,
        out_stride,
        entries,
        TOPK: tl.constexpr,
        WINDOW: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        COLUMNS: tl.constexpr,
    ):
        token = tl.program_id(0)
        columns = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        request = tl.load(request_ptr + token)
        position = tl.load(position_ptr + token)
        num_tokens = tl.load(num_tokens_ptr)
        real, padding = token < num_tokens, token >= num_tokens
        listed = tl.load(rows_ptr + token * row_stride_t + columns * row_stride_e, mask=columns < TOPK, other=-1)
        in_window = (columns >= TOPK) & (columns < TOPK + WINDOW)
        entry = tl.where(in_window, position - (WINDOW - 1) + (columns - TOPK), listed.to(tl.int64))
        usable = (entry >= 0) & (entry <= position) & real
        entry = tl.where(usable, entry, 0)
        block = tl.load(table_ptr + request * table_stride_r + (entry // BLOCK_SIZE) * table_stride_b, mask=usable)
        slot = tl.where(usable, block.to(tl.int64) * BLOCK_SIZE + entry % BLOCK_SIZE, -1)
        # A padding row: the first token's own slot in its first column.
        first_request, first_position = tl.load(request_ptr), tl.load(position_ptr)
        first_row = table_ptr + first_request * table_stride_r
        first_block = tl.load(first_row + (first_position // BLOCK_SIZE) * table_stride_b)
        own = first_block.to(tl.int64) * BLOCK_SIZE + first_position % BLOCK_SIZE
        slot = tl.where((columns == 0) & padding, own, slot)
        tl.store(out_ptr + token * out_stride + columns, slot.to(tl.int32), mask=columns < entries)


def slots_with_triton(rows, request, position, num_tokens, block_table, out, *, window: int, block_size: int) -> None:
    """The formula in one launch (a program a token and 512 columns); the grid from host ints, so
    that a captured graph replays it."""
    tokens, entries = out.shape
    if out.stride(1) != 1 or rows.shape[1] + window > entries:
        raise ValueError(f"slots: out {tuple(out.shape)} must be row-major and hold {rows.shape[1]} + {window} entries")
    if tokens == 0:
        return
    grid = (tokens, triton.cdiv(entries, COLUMNS_PER_PROGRAM))
    slots_kernel[grid](
        rows,
        rows.stride(0),
        rows.stride(1),
        request,
        position,
        num_tokens,
        block_table,
        block_table.stride(0),
        block_table.stride(1),
        out,
        out.stride(0),
        entries,
        TOPK=rows.shape[1],
        WINDOW=window,
        BLOCK_SIZE=block_size,
        COLUMNS=COLUMNS_PER_PROGRAM,
    )


def slot_translation(device: torch.device):
    """The translation for tensors on ``device``: Triton's launch on a GPU, torch's on a CPU (where
    Triton launches only under its interpreter)."""
    return slots_with_triton if device.type == "cuda" else slots_with_torch
