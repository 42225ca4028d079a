"""Planted decode-context-parallel defects (``backends.base``: "Decode context parallelism"):
torch_naive whose row with no key on its rank gives LSE 0 instead of -inf, whose empty row reads
one key anyway, and whose LSE is in base 2."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from backends.base import PLAIN_LAYER
from backends.features import DCP
from backends.torch_naive import TorchNaiveBackend


class EmptyRankLseZero(TorchNaiveBackend):
    """A row with no key on this rank: output 0 as asked, but LSE 0 (a log of 1) instead of -inf,
    so the merge gives that rank weight."""

    name = "planted_empty_rank_lse_zero"

    def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer=layer)
        if layer.lse is not None:
            for request, seq_len in enumerate(metadata.seq_lens):
                start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
                if seq_len == 0 and end > start:
                    layer.lse[start:end] = 0.0


class ClampsEmptyRankRowToOneKey(TorchNaiveBackend):
    """Clamps every row's length to at least one key (a loop that must run once), so a row with no
    key on its rank attends the first slot of its block-table row, a block no request owns here."""

    name = "planted_clamps_empty_rank_row_to_one_key"

    def build(self, common):
        metadata = super().build(common)
        return replace(metadata, seq_lens=[max(seq_len, 1) for seq_len in metadata.seq_lens])


class LseInBaseTwo(TorchNaiveBackend):
    """Writes its LSE in base 2 (the kernels' exp2 domain, not converted back): a merge in natural
    log then weighs the ranks wrongly (vLLM's ``is_lse_base_on_e``)."""

    name = "planted_lse_in_base_two"

    def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer=layer)
        if layer.lse is not None:
            layer.lse.div_(math.log(2))


class EmptyRankRowNaN(TorchNaiveBackend):
    """A row with no key on its rank left as a 0/0 softmax: output and LSE NaN (vLLM's merge zeroes
    such a rank; FlashInfer's ``merge_state`` and others would spread the NaN)."""

    name = "planted_empty_rank_row_nan"

    def forward(self, query, kv_cache, metadata, out, layer=PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer=layer)
        for request, seq_len in enumerate(metadata.seq_lens):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if seq_len == 0 and end > start:
                out[start:end] = float("nan")
                if layer.lse is not None:
                    layer.lse[start:end] = float("nan")


def flashinfer_claiming_dcp():
    """The real flashinfer adapter claiming DCP, unchanged otherwise: what measures whether
    FlashInfer's decode gives a row with no key (sequence length 0) output 0 and LSE -inf."""
    import dataclasses

    from backends.flashinfer.gqa import FlashInferBackend

    claims = FlashInferBackend.capabilities
    not_claimed = {feature: why for feature, why in claims.not_claimed.items() if feature is not DCP}

    class FlashInferClaimingDcp(FlashInferBackend):
        name = "planted_flashinfer_claiming_dcp"
        capabilities = dataclasses.replace(claims, features=claims.features | {DCP}, not_claimed=not_claimed)

    return FlashInferClaimingDcp


class UpdatesLikeTorchNaive(TorchNaiveBackend):
    """torch_naive with a draft-step update that takes the step's lengths (what DCP needs: each
    rank's own). The control of ``AdvancesEveryRankEachDraftStep``."""

    name = "planted_updates_like_torch_naive"
    capabilities = replace(TorchNaiveBackend.capabilities, draft_step_update=True)

    def update_for_draft_step(self, metadata, common):
        return self.build(common)


class AdvancesEveryRankEachDraftStep(UpdatesLikeTorchNaive):
    """Advances its own copy of the lengths by one each draft step (every request one token
    longer: right without DCP), where under DCP only the rank holding the new position gains a
    key: the local length taken from the global step."""

    name = "planted_advances_every_rank_each_draft_step"

    def update_for_draft_step(self, metadata, common):
        return replace(metadata, seq_lens=[length + 1 for length in metadata.seq_lens])


@functools.cache
def triton_advances_every_rank_each_draft_step():
    """triton keeping its own lengths, copied in ``build`` and advanced by one in every
    ``update_for_draft_step`` (on the device: graph-safe, and right without DCP), where under DCP
    only the rank holding the new position gains a key."""
    import torch

    from backends.triton.backend import TritonAttentionBackend

    class TritonAdvancesEveryRank(TritonAttentionBackend):
        def __init__(self, spec, limits, device):
            super().__init__(spec, limits, device)
            # Persistent, as a graph-safe backend's own copy is: a replay reads this very buffer.
            self.own_lens = torch.zeros(limits.max_num_reqs, dtype=torch.int32, device=self.device)

        def build(self, common):
            metadata = super().build(common)
            metadata.seq_lens = self.own_lens[: common.num_reqs]
            metadata.seq_lens.copy_(common.seq_lens[: common.num_reqs])
            return metadata

        def update_for_draft_step(self, metadata, common):
            metadata = super().update_for_draft_step(metadata, common)
            metadata.seq_lens = self.own_lens[: common.num_reqs]
            metadata.seq_lens.add_(1)
            return metadata

    TritonAdvancesEveryRank.__qualname__ = TritonAdvancesEveryRank.__name__  # loadable by name (the engine's)
    return TritonAdvancesEveryRank


def __getattr__(name: str):
    """``tests.planted.dcp_defects:TritonAdvancesEveryRank`` loads like any backend: the engine
    loads its backend by reference, and triton is imported only when asked for."""
    if name == "TritonAdvancesEveryRank":
        return triton_advances_every_rank_each_draft_step()
    raise AttributeError(name)


class NotClaimingDcp(TorchNaiveBackend):
    """torch_naive without the DCP claim: what the engine refuses under ``--dcp``."""

    name = "planted_not_claiming_dcp"
    capabilities = replace(TorchNaiveBackend.capabilities, features=TorchNaiveBackend.capabilities.features - {DCP})
