"""Writing K/V rows into a paged cache with plain PyTorch, honouring slot -1, with no host sync.

Shared by the backends whose vendor kernels do not include a cache write of their own contract.
"""
from __future__ import annotations

import torch


def write_paged_rows(plane: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, page_size: int) -> None:
    """plane: [num_blocks, page_size, ...] (any strides); rows: [T, ...]; slot -1 writes nothing.

    Rows with slot -1 are parked on block 0, offset 0, and rewrite the value it already holds:
    block 0 is reserved and never owned by a request, so no real row targets it, and masking on
    the host instead would need a device-to-host sync.
    """
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, torch.zeros_like(slot_mapping))
    parked = plane[0, 0].expand_as(rows)
    keep = valid.view(-1, *([1] * (rows.dim() - 1)))
    plane.index_put_((slots // page_size, slots % page_size), torch.where(keep, rows.to(plane.dtype), parked))
