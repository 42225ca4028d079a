"""Planted defects that show only after many steps (the steady check's), each the graph-safe
torch backend (device lengths, no sync) with one bug that a look at one step, or at the handful a
draft loop or a graph replay makes, cannot see: a host-side cache refreshed now and then, a sync
every Nth step, a workspace regrown as the contexts grow and the old one kept. And the bugs a
fixed batch (every request one token longer each step) cannot see either, because they follow
the batch's composition, which a serving engine changes nearly every step: a re-plan with a sync
only when the number of requests changes, a plan reused when the batch's shape comes back with
other requests, and (torch_naive, for its log-sum-exp) an LSE written only on the steps that
re-planned."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import PLAIN_LAYER, LayerParameters
from backends.torch_naive import NaiveMetadata, TorchNaiveBackend
from tests.planted.graph_backends import TorchGraphSafe

EVERY = 64


class SyncsWhenBatchChanges(TorchGraphSafe):
    """Re-plans from the longest length, read from the device (``.item()``: a blocking sync),
    whenever a batch has another number of requests than its last build's (a plan cached by batch
    size): never while the same requests decode, once each time a request joins or leaves."""

    name = "planted_syncs_when_batch_changes"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.last_num_reqs: int | None = None

    def build(self, common):
        if common.num_reqs != self.last_num_reqs:
            self.last_num_reqs = common.num_reqs
            self.longest = int(common.seq_lens.max().item())
        return super().build(common)


class SkipsRefreshEveryNthBuild(TorchGraphSafe):
    """Keeps its own copy of the lengths, refreshed by every build but the 64th, 128th, …: those
    steps run with the last step's lengths (one token short: the newest key is never seen)."""

    name = "planted_skips_refresh_every_nth_build"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.own_seq_lens = torch.zeros(limits.max_num_reqs, dtype=torch.int32, device=device)
        self.builds = 0

    def build(self, common):
        metadata = super().build(common)
        self.builds += 1
        if self.builds % EVERY:
            self.own_seq_lens[: common.num_reqs].copy_(common.seq_lens)
        metadata.seq_lens = self.own_seq_lens[: common.num_reqs]
        return metadata


class SyncsEveryNthBuild(TorchGraphSafe):
    """Refreshes a host-side copy of the longest length on every 64th build, reading it from the
    device (``.item()``: a blocking sync once in 64 steps)."""

    name = "planted_syncs_every_nth_build"
    builds = 0

    def build(self, common):
        self.builds += 1
        if self.builds % EVERY == 0:
            self.longest = int(common.seq_lens.max().item())
        return super().build(common)


class KeepsEveryWorkspace(TorchGraphSafe):
    """Sizes a workspace by the longest context, regrowing it every 32 tokens, and keeps the old
    ones in a cache keyed by size that nothing ever empties."""

    name = "planted_keeps_every_workspace"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.workspaces: dict[int, torch.Tensor] = {}

    def build(self, common):
        size = -(-common.max_seq_len // 32) * 32
        if size not in self.workspaces:
            self.workspaces[size] = torch.empty(size * 4096, dtype=torch.float32, device=self.device)
        return super().build(common)


class SyncsOnTheThirdBuild(TorchGraphSafe):
    """Reads the longest length from the device (``.item()``, a blocking sync) on one build only,
    the ``sync_on``-th: the third is a sync in the steady state, one step after the warm-up of
    both kinds of batch (the steady look's schedule: decode-only, then with verify rows)."""

    name = "planted_syncs_on_the_third_build"
    sync_on = 3
    builds = 0

    def build(self, common):
        self.builds += 1
        if self.builds == self.sync_on:
            self.longest = int(common.seq_lens.max().item())
        return super().build(common)


class SyncsOnTheFirstBuild(SyncsOnTheThirdBuild):
    """The same sync on the first build only: a lazy initialisation, which the steady check (as the
    syncs check's warm-up step) does not count."""

    name = "planted_syncs_on_the_first_build"
    sync_on = 1


class SyncsOnItsFirstVerifyStep(TorchGraphSafe):
    """Not a defect: a verify kernel loaded lazily, at the first step with a longer row (a sync
    there, once), as FlashInfer loads XQA's speculative-decoding module on trtllm's first verify
    step. An engine's warm-up runs such a step, so the steady look PASSes it."""

    name = "planted_syncs_on_its_first_verify_step"
    loaded = False

    def build(self, common):
        if common.max_query_len > 1 and not self.loaded:
            self.loaded = True
            self.longest = int(common.seq_lens.max().item())
        return super().build(common)


class ReusesPlanWhenShapeRepeats(TorchGraphSafe):
    """Plans once per batch shape (number of requests, number of tokens): copies the block table and
    the query starts into a plan of its own (FlashInfer-style page indices and indptr) the first
    time it sees a shape, and reuses that plan whenever the shape comes back; only the lengths are
    read afresh each step. A fixed batch keeps its block table and query starts, so it is right
    there; in a serving engine the same shape comes back with other requests in it (one left,
    another joined) or with the verify rows elsewhere, and it attends over the wrong blocks. (Unlike
    ``input_defects.ReusesPlanForSameShape``, which keeps the lengths too and is wrong at the next
    step of any batch.)"""

    name = "planted_reuses_plan_when_shape_repeats"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.plans: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def build(self, common):
        metadata = super().build(common)
        shape = (common.num_reqs, common.num_actual_tokens)
        if shape not in self.plans:
            self.plans[shape] = (common.block_table.clone(), common.query_start_loc.clone())
        metadata.block_table, metadata.query_start_loc = self.plans[shape]
        return metadata


@dataclass
class PlannedMetadata(NaiveMetadata):
    replanned: bool = False


class StaleLseUnlessReplanned(TorchNaiveBackend):
    """Returns the log-sum-exp only from steps whose build re-planned (its LSE output bound to the
    plan, as a wrapper's ``return_lse`` chosen at plan time), which it does when the number of
    requests differs from its previous build's; on other steps ``forward`` leaves the caller's
    ``lse`` as it was. A single step (numerics' LSE pass: build, then forward with the same
    metadata) is right; so is every step that re-planned."""

    name = "planted_stale_lse_unless_replanned"
    planned_for = None

    def build(self, common):
        metadata = super().build(common)
        replanned = common.num_reqs != self.planned_for
        self.planned_for = common.num_reqs
        return PlannedMetadata(**vars(metadata), replanned=replanned)

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        super().forward(query, kv_cache, metadata, out, layer if metadata.replanned else layer.with_lse(None))
