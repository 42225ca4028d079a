"""FlashInfer's CSR page layout (indptr, indices, last_page_len), built without device reads.

Host lengths give the indptr and last-page lengths on the host; the page indices are gathered
from the device block table with host-computed coordinates (pinned, non-blocking copy), so a plan
fed this way makes no device-to-host copy. Without host lengths, ``common.seq_lens_cpu`` copies
from the device, a sync the syncs check reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import CommonAttentionMetadata


@dataclass
class PagedLayout:
    kv_indptr: torch.Tensor  # [num_reqs + 1] int32, host
    kv_indices: torch.Tensor  # [total pages] int32, device
    last_page_len: torch.Tensor  # [num_reqs] int32, host
    seq_lens: torch.Tensor  # [num_reqs] int32, host


def host_page_counts(seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pages per request, indptr, last page length), all on the host."""
    pages = (seq_lens + page_size - 1) // page_size
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = (seq_lens - (pages - 1) * page_size).to(torch.int32)
    return pages, indptr, last_page_len


def paged_layout(common: CommonAttentionMetadata, page_size: int) -> PagedLayout:
    seq_lens = common.seq_lens_cpu.to(torch.int32)
    pages, indptr, last_page_len = host_page_counts(seq_lens, page_size)
    requests = torch.repeat_interleave(torch.arange(common.num_reqs, dtype=torch.int64), pages.long())
    columns = torch.arange(int(indptr[-1]), dtype=torch.int64) - indptr[:-1].long()[requests]
    coordinates = torch.stack([requests, columns])
    if common.block_table.is_cuda:
        coordinates = coordinates.pin_memory().to(common.block_table.device, non_blocking=True)
    indices = common.block_table[coordinates[0], coordinates[1]].to(torch.int32)
    return PagedLayout(indptr, indices, last_page_len, seq_lens)
