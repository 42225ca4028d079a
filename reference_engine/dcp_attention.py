"""Decode context parallelism (DCP) in the engine, simulated on one device: ``DcpAttention`` puts
R backend instances, one a rank, behind the one contract the engine calls.

* **The KV.** vLLM interleaves each request's KV over the DCP group token by token: position ``p``
  on rank ``p % R`` at local position ``p // R``. The engine's block is a virtual block of R × B
  tokens (``EngineConfig.kv_block_size``), as vLLM's scheduler counts it: block ``b`` of a request
  holds the local positions ``b·B … (b+1)·B - 1`` on every rank, in that rank's block ``b`` of the
  same id. So a step's slot ``s`` lives on rank ``s % R`` at its slot ``s // R``, and every rank reads
  the engine's block table as it is. Each rank has a cache of its own (``allocate_kv_cache``: one
  a rank) and ``write_kv`` writes a key on its owner rank only (slot -1 on the others).
* **The rows.** Each query token goes to every rank as a decode row of its own: its request's
  table, and as sequence length the keys of that rank before it and itself (vLLM's
  ``dcp_local_seq_lens`` for a decode token; for the tokens of a verify row or a prefill chunk, each
  token's causal cut over the rank's keys, which one row of several tokens cannot express with the
  contract's causal rule). So a rank's backend sees decode batches only, the batches the DCP
  contract hands it, whatever the step; a rank holding no key of a row gets sequence length 0 and
  must give output 0 and LSE -inf.
* **The merge.** Every rank attends every query head and returns its output and natural-log LSE;
  ``merge`` weighs them as vLLM's ``cp_lse_ag_out_rs`` does.

All of it runs on the device from the step's device tensors (searchsorted, gathers, arithmetic),
into persistent buffers, so ``build`` adds no host sync and a graph replays it: each rank's metadata
is its backend's own ``build`` / ``build_for_capture`` / ``update_for_draft_step`` over the rank's
batch. Host lengths go to a rank only where the engine knew them (else the rank's upper bound).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionSpec,
    BackendLimits,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import EMPTY_REQUESTS, Needs


def dcp_refusal(model, plans, world: int, device: torch.device, token_trees: bool = False) -> str | None:
    """Why ``model`` cannot run under DCP over ``world`` ranks with these layer groups' backends
    (``model_attention.plan_attention``), or None: dense attention without a window or learned
    sinks, chains, and every group's backend claiming DCP over that many ranks."""
    if world < 1:
        return f"--dcp {world}: the ranks must be at least 1"
    refused = [
        (model.index_topk is not None, "sparse attention (an indexer's)"),
        (model.sliding_window is not None, "a sliding window"),
        (model.attention_sinks, "learned sinks"),
        (token_trees, "token trees"),
    ]
    for applies, what in refused:
        if applies:  # a rank's keys are every R-th position: its local window and sink need their own rule
            return f"decode context parallelism with {what} is not in the contract"
    for plan in plans:
        reason = plan.backend_cls.capabilities.skip_reason(Needs(plan.spec, (1,), lse=True, dcp=world), device)
        if reason:
            return (
                f"backend {plan.backend_cls.name or plan.backend_cls.__name__} cannot run under DCP {world}: {reason}"
            )
    return None


def local_lengths(keys: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Of a request's first ``keys`` positions, how many ``rank`` holds (vLLM's
    ``get_dcp_local_seq_lens`` at interleave size 1), elementwise on a tensor of key counts."""
    return torch.div(keys - rank + world - 1, world, rounding_mode="floor").clamp(min=0)


def rank_slots(slot_mapping: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The engine's slots as ``rank`` writes them: its local slot where it owns the slot, else -1."""
    owned = (slot_mapping >= 0) & (slot_mapping % world == rank)
    return torch.where(owned, torch.div(slot_mapping, world, rounding_mode="floor"), -1)


def merge(
    outputs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``cp_lse_ag_out_rs`` in ``dtype``: (merged output, merged natural-log LSE). A NaN or
    +inf LSE counts as -inf; a rank of zero weight adds 0 (its output, NaN or not, is not read); a
    row no rank holds a key of gives output 0 and LSE -inf."""
    stacked = torch.stack([lse.to(dtype) for lse in lses])  # [R, T, H]
    stacked = torch.where(stacked.isnan() | (stacked == float("inf")), float("-inf"), stacked)
    top = stacked.amax(0)
    top = torch.where(top == float("-inf"), 0.0, top)
    merged_lse = top + torch.log(torch.exp(stacked - top).sum(0))
    merged = torch.zeros(outputs[0].shape, dtype=dtype, device=outputs[0].device)
    for out, lse in zip(outputs, stacked):
        factor = torch.exp(lse - merged_lse)[..., None]
        merged += torch.where(factor > 0, out.to(dtype) * factor, 0.0)
    return merged, merged_lse


@dataclass(frozen=True)
class DcpMetadata:
    """One step's metadata under DCP: the step's token count and each rank's own metadata."""

    num_tokens: int
    ranks: list[Any]


class RankRows:
    """A rank's persistent batch: one decode row per query token of the step (``rank_batch``)."""

    def __init__(self, rank: int, world: int, limits: BackendLimits, device: torch.device) -> None:
        self.rank, self.world = rank, world
        tokens = limits.max_num_tokens
        self.query_start_loc = torch.arange(tokens + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.tables: dict[int, torch.Tensor] = {}  # by the engine's table width (one in practice)
        self.device = device

    def table(self, width: int) -> torch.Tensor:
        if width not in self.tables:
            self.tables[width] = torch.zeros(self.seq_lens.shape[0], width, dtype=torch.int32, device=self.device)
        return self.tables[width]

    def rank_batch(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """The step as this rank's backend sees it: token t a decode row of its request's table,
        with the keys this rank holds up to and including t's position; the slots it owns."""
        tokens, rank, world = common.num_actual_tokens, self.rank, self.world
        starts = common.query_start_loc[: common.num_reqs + 1]
        token = self.query_start_loc[:tokens]
        request = torch.searchsorted(starts[1:], token, right=True, out_int32=True).clamp(max=common.num_reqs - 1)
        # A token's position: its request's length less the tokens after it in its row.
        keys = common.seq_lens[request] - (starts[request + 1] - token) + 1
        self.seq_lens[:tokens].copy_(local_lengths(keys, rank, world))
        self.slot_mapping[:tokens].copy_(rank_slots(common.slot_mapping[:tokens], rank, world))
        table = self.table(common.block_table.shape[1])
        table[:tokens].copy_(common.block_table.index_select(0, request.long()))
        host_keys = self._host_keys(common)
        bound = -(-common.max_seq_len // world)  # rank 0 holds the most keys of a request: ceil(S / R)
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=self.query_start_loc[: tokens + 1],
            seq_lens=self.seq_lens[:tokens],
            block_table=table[:tokens],
            slot_mapping=self.slot_mapping[:tokens],
            query_starts=range(tokens + 1),
            host_seq_lens=[bound] * tokens if host_keys is None else local_lengths(host_keys, rank, world).tolist(),
            lengths_known=host_keys is not None,
            max_seq_len=bound,
        )

    @staticmethod
    def _host_keys(common: CommonAttentionMetadata) -> torch.Tensor | None:
        """Each token's keys up to and including it, on the host, where the engine knew its lengths."""
        if not common.has_host_seq_lens:
            return None
        starts = common.query_start_loc_cpu
        query_lens = starts[1:] - starts[:-1]
        token = torch.arange(common.num_actual_tokens, dtype=torch.int32)
        request = torch.repeat_interleave(torch.arange(common.num_reqs), query_lens.long())
        return common.host_seq_lens[request] - (starts[request + 1] - token) + 1


class DcpAttention(AttentionBackend):
    """``world`` instances of ``backend_cls`` behind the one contract the engine calls (module
    docstring). Its KV cache per layer is the list of the ranks' caches."""

    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        spec: AttentionSpec,
        limits: BackendLimits,
        device: torch.device,
        world: int,
    ) -> None:
        super().__init__(spec, limits, device)
        # Each query token is a row of its own on a rank, holding at most ceil(max_model_len / R) keys.
        tokens = limits.max_num_tokens
        rank_limits = BackendLimits(tokens, tokens, -(-limits.max_model_len // world))
        self.ranks = [backend_cls(spec, rank_limits, device) for _ in range(world)]
        self.rows = [RankRows(rank, world, limits, self.device) for rank in range(world)]
        self.world = world
        self.name = f"{backend_cls.name or backend_cls.__name__} (DCP {world})"
        # Every step reaches a rank as decode rows, so the engine may hand any batch; the engine's
        # padding is rows (an empty request has no token, so it would change a rank's row count).
        claims = backend_cls.capabilities
        self.capabilities = dataclasses.replace(
            claims, max_query_len=None, uniform_query_len=False, features=claims.features - {EMPTY_REQUESTS}
        )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.ranks[0].kv_cache_shape(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        return [backend.allocate_kv_cache(num_blocks) for backend in self.ranks]

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        for rank, (backend, cache) in enumerate(zip(self.ranks, kv_cache)):
            backend.write_kv(cache, key, value, rank_slots(slot_mapping, rank, self.world), layer=layer)

    def _build(self, common: CommonAttentionMetadata, build_name: str) -> DcpMetadata:
        return DcpMetadata(
            common.num_actual_tokens,
            [getattr(backend, build_name)(rows.rank_batch(common)) for backend, rows in zip(self.ranks, self.rows)],
        )

    def build(self, common: CommonAttentionMetadata) -> DcpMetadata:
        return self._build(common, "build")

    def build_for_capture(self, common: CommonAttentionMetadata) -> DcpMetadata:
        return self._build(common, "build_for_capture")

    def update_for_draft_step(self, metadata: DcpMetadata, common: CommonAttentionMetadata) -> DcpMetadata:
        # Each rank's lengths advance by its own pattern: only the new position's owner gains a key.
        return DcpMetadata(
            common.num_actual_tokens,
            [
                backend.update_for_draft_step(previous, rows.rank_batch(common))
                for backend, rows, previous in zip(self.ranks, self.rows, metadata.ranks)
            ],
        )

    def forward(self, query, kv_cache, metadata: DcpMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        tokens = metadata.num_tokens
        outputs, lses = [], []
        for backend, cache, rank_metadata in zip(self.ranks, kv_cache, metadata.ranks):
            rank_out = torch.empty_like(out)
            lse = torch.empty(out.shape[:2], dtype=torch.float32, device=out.device)
            backend.forward(query, cache, rank_metadata, rank_out, layer=layer.with_lse(lse))
            outputs.append(rank_out[:tokens])
            lses.append(lse[:tokens])
        merged, merged_lse = merge(outputs, lses)
        out[:tokens].copy_(merged)
        if layer.lse is not None:
            layer.lse[:tokens].copy_(merged_lse)
