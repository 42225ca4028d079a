"""DeepSeek-V3.2's lightning indexer as a model layer: what chooses, for every token of a sparse
MLA layer, the positions it attends (``backends.base``: "The indexer", "Sparse attention").

Per token, from the layer's normed hidden state: ``index_heads`` index queries of
``index_head_dim`` and one index key (RMS-normed), both rotated by RoPE over their first
``qk_rope_dim`` channels as DeepSeek's are, and one weight per index head (``weights_proj``, times
``heads^-1/2 · dim^-1/2``, DeepSeek's scaling with the softmax scale folded in). The key goes into
the indexer's own fp8 cache through an indexer backend's ``write_kv``; its ``forward`` chooses each
token's top ``index_topk`` positions by ``Σ_h w_h · relu(q_h · k_s)``. With a window part (DeepSeek-V4's
``index_window``) the window attends the most recent positions itself, so the indexer's choices
inside it are dropped (-1): the contract's rows hold only positions older than the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backends.base import AttentionBackend, LayerParameters

if TYPE_CHECKING:
    from reference_engine.attention_split import Call
    from reference_engine.model import ModelConfig


@dataclass(frozen=True)
class IndexerView:
    """One layer's indexer this step: its backend, its cache and the step's calls."""

    backend: AttentionBackend
    kv_cache: Any
    calls: list["Call"]


class LightningIndexer(torch.nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.config = config
        heads, dim = config.index_heads, config.index_head_dim
        self.wq = torch.nn.Linear(config.hidden_size, heads * dim, bias=False)
        self.wk = torch.nn.Linear(config.hidden_size, dim, bias=False)
        self.k_norm = torch.nn.Parameter(torch.ones(dim))
        self.weights_proj = torch.nn.Linear(config.hidden_size, heads, bias=False)

    def forward(
        self, normed: torch.Tensor, positions: torch.Tensor, view: IndexerView, slot_mapping: torch.Tensor
    ) -> torch.Tensor:
        """Each token's index row, int32 ``[T, index_topk]`` on the device: positions in its
        request, -1 for no entry (every row past the step's real tokens -1, as the contract hands
        padding rows)."""
        from reference_engine.model import apply_rope, rms_norm

        config = self.config
        tokens, heads, dim, rope = normed.shape[0], config.index_heads, config.index_head_dim, config.qk_rope_dim
        query = self.wq(normed).view(tokens, heads, dim)
        key = rms_norm(self.wk(normed), self.k_norm, config.rms_norm_eps)[:, None, :]
        query = torch.cat([apply_rope(query[..., :rope], positions, config.rope_theta), query[..., rope:]], dim=-1)
        query = query.contiguous()
        key = torch.cat([apply_rope(key[..., :rope], positions, config.rope_theta), key[..., rope:]], dim=-1)[:, 0]
        weights = self.weights_proj(normed).float() * (heads**-0.5 * dim**-0.5)
        view.backend.write_kv(view.kv_cache, key.contiguous(), None, slot_mapping)
        rows = torch.full((tokens, config.index_topk), -1, dtype=torch.int32, device=normed.device)
        for call in view.calls:
            parameters = LayerParameters(index_weights=call.rows(weights))
            call.backend.forward(call.rows(query), view.kv_cache, call.metadata, call.rows(rows), layer=parameters)
        if config.index_window:  # the window part attends these itself
            rows = torch.where(rows.long() > positions[:, None] - config.index_window, -1, rows)
        return rows
