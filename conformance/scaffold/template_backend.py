"""``template``: a new attention backend, written by ``conformance new-backend template``.

It already passes the smoke suite on a CPU: plain PyTorch over the paged cache, one request at a
time, from host lengths. Replace the math with your kernels one method at a time and keep
running the suite:

    conformance run --backend template_backend:TemplateBackend --suite smoke
    pytest test_template_backend.py

Every claim in ``capabilities`` is verified by a check: claim only what passes. The contract
(slot numbering, block 0 reserved, padding rows with slot -1, the MLA shapes) is in
``backends/base.py``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    Capabilities,
    CGSupport,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import LOGITS_SOFT_CAP, SLIDING_WINDOW


@dataclass
class TemplateMetadata:
    """What ``build`` hands ``forward``: here host lists, read on the host in ``forward``. A
    graph-capturable backend keeps device tensors here instead (see ``backends/triton``)."""

    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor


class TemplateBackend(AttentionBackend):
    name = "template"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),  # add "mla" once forward handles the absorbed latent cache
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_query_len=None,  # None: prefill too; 1: decode only; k: spec-verify up to k
        features=frozenset({SLIDING_WINDOW, LOGITS_SOFT_CAP}),  # the contract's features it serves (backends.features)
        cuda_graphs=CGSupport.NEVER,  # forward reads host lengths: nothing here can be captured
        needs_cpu_seq_lens=True,  # build reads seq_lens on the host: a sync when the engine lacks them
        devices=frozenset({"cpu", "cuda"}),
    )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The paged cache for ``num_blocks`` blocks (block 0 included): here K and V planes of
        [num_blocks, block_size, kv_heads, head_dim], so each views as [slots, kv_heads, head_dim]."""
        spec = self.spec
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        """Store this step's key/value rows at their slots; slot -1 (a padding row) writes nothing.
        Rows with slot -1 are aimed at block 0, offset 0, and write back what it holds: masking
        them on the host instead would need the slots on the host (a device-to-host sync).
        ``layer`` (``LayerParameters``) holds what a layer hands beyond the step's tensors: fp8
        scales, learned sinks, an LSE buffer. Read only the fields of the features you claim
        (none here)."""
        valid = (slot_mapping >= 0).view(-1, 1, 1)
        slots = slot_mapping.clamp(min=0)
        for plane, rows in zip(kv_cache, (key, value)):
            flat = plane.view(-1, *plane.shape[2:])  # [slots, kv_heads, head_dim]
            flat.index_put_((slots,), torch.where(valid, rows.to(flat.dtype), flat[0].expand_as(rows)))

    def build(self, common: CommonAttentionMetadata) -> TemplateMetadata:
        """This step's metadata, made on the host before every forward. ``seq_lens_cpu`` copies
        the lengths from the device when the engine did not know them (the syncs check reports
        it; ``needs_cpu_seq_lens=True`` says so)."""
        return TemplateMetadata(common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist(), common.block_table)

    def forward(self, query, kv_cache, metadata: TemplateMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        """Attention of each request's new tokens over its cached sequence, into ``out``."""
        keys, values = (plane.view(-1, *plane.shape[2:]) for plane in kv_cache)
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if end == start:
                continue
            slots = self.slots(metadata.block_table[request], seq_len)
            out[start:end] = self.attend(query[start:end], keys[slots], values[slots], seq_len - (end - start)).to(
                out.dtype
            )

    def slots(self, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The slots of a request's first ``seq_len`` positions, in order."""
        block_size = self.spec.block_size
        blocks = block_table_row[: -(-seq_len // block_size)].long()
        offsets = torch.arange(block_size, device=blocks.device)
        return (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:seq_len]

    def attend(self, query, key, value, context_len: int) -> torch.Tensor:
        """query [q, H, D] at positions context_len.., key/value [s, Hkv, D] → [q, H, D] float32:
        causal, within the sliding window, soft-capped; query head h reads KV head h // group."""
        spec = self.spec
        group = spec.query_group_size
        key = key.float().repeat_interleave(group, dim=1)
        value = value.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), key) * spec.softmax_scale
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        query_positions = context_len + torch.arange(query.shape[0], device=query.device)
        distance = query_positions[:, None] - torch.arange(key.shape[0], device=query.device)[None, :]
        visible = distance >= 0
        if spec.sliding_window is not None:
            visible &= distance < spec.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, value)
