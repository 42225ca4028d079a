"""Writing K/V rows into a paged cache, honouring slot -1, with no host sync.

Shared by the backends whose vendor kernels do not include a cache write of their own contract.
On CUDA the write is our Triton ``write_kv_kernel``, whose padding rows (slot -1) touch no memory;
on the CPU it is plain PyTorch, which parks padding rows on the reserved block (see below).
"""

from __future__ import annotations

import torch

from backends.fp8 import to_cache


def write_paged_rows(
    plane: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    scale: torch.Tensor | None = None,
) -> None:
    """plane: [num_blocks, page_size, ...] (any strides, the last dim contiguous on CUDA);
    rows: [T, ...]; slot -1 writes nothing. ``scale`` (an fp8 plane's 1-element device scale):
    rows are stored as the contract's fp8 numbers, ``row / scale`` rounded and saturated, the
    scale read on the device."""
    if plane.is_cuda:
        _write_with_kernel(plane, rows, slot_mapping, page_size, scale)
    else:
        if scale is not None:
            rows = to_cache(rows, scale, plane.dtype)
        _write_with_index_put(plane, rows, slot_mapping, page_size)


def _write_with_kernel(
    plane: torch.Tensor,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_size: int,
    scale: torch.Tensor | None = None,
) -> None:
    """One program per row. The plane is seen as [blocks, page, heads, dim] (MLA: one head)."""
    import triton

    from backends.triton.kernels import write_kv_kernel

    if plane.dim() == 3:
        plane, rows = plane.unsqueeze(2), rows.unsqueeze(1)
    if plane.stride(-1) != 1 or rows.stride(-1) != 1:
        raise ValueError("write_paged_rows on CUDA needs the cache's and the rows' last dimension contiguous")
    heads, head_dim = plane.shape[2], plane.shape[3]
    write_kv_kernel[(slot_mapping.shape[0],)](
        rows,
        rows,
        plane,
        plane,
        slot_mapping,
        rows.stride(0),
        rows.stride(1),
        rows.stride(0),
        rows.stride(1),
        plane.stride(0),
        plane.stride(2),
        plane.stride(1),
        slot_mapping if scale is None else scale,
        slot_mapping,  # no scale: rows stored as they are
        heads,
        page_size,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_VALUE=False,
        QUANTIZE=scale is not None,
        FP8_MAX=float(torch.finfo(plane.dtype).max) if scale is not None else 448.0,
    )


def _write_with_index_put(plane: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, page_size: int) -> None:
    """Rows with slot -1 are parked on block 0, offset 0, and rewrite the value it already holds:
    block 0 is reserved and never owned by a request, so no real row targets it, and masking on
    the host instead would need a device-to-host sync. (It reads the reserved block, which the
    memory check's initcheck would report: hence the kernel on CUDA.)"""
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, torch.zeros_like(slot_mapping))
    parked = plane[0, 0].expand_as(rows)
    keep = valid.view(-1, *([1] * (rows.dim() - 1)))
    plane.index_put_((slots // page_size, slots % page_size), torch.where(keep, rows.to(plane.dtype), parked))


def read_paged_rows(plane: torch.Tensor, slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """The rows ``write_paged_rows`` stored at ``slot_mapping`` (every slot >= 0), as stored: an
    adapter's ``read_kv`` over the same plane views its ``write_kv`` writes through."""
    return plane[slot_mapping // page_size, slot_mapping % page_size]
