"""Hand vendor kernels the packed tensors their APIs assume, and write results back through
whatever view the engine gave.

An engine's query is a slice of a fused QKV projection and its output may be a view into a wider
buffer (the harness's ``strided`` cases do both). Our own kernels take strides; a vendor entry
point that checks or assumes contiguity gets a packed copy of the query and a packed scratch
output, copied back into the view afterwards. Contiguous tensors pass through untouched (no copy).
"""

from __future__ import annotations

from typing import Callable

import torch


def packed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def packed_output(out: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """(a contiguous tensor to write into, a function that lands it in ``out``)."""
    if out.is_contiguous():
        return out, lambda: None
    scratch = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    return scratch, lambda: out.copy_(scratch)
