"""Planted defects that show only after many steps (the steady check's), each the graph-safe
torch backend (device lengths, no sync) with one bug that a look at one step, or at the handful a
draft loop or a graph replay makes, cannot see: a host-side cache refreshed now and then, a sync
every Nth step, a workspace regrown as the contexts grow and the old one kept."""

from __future__ import annotations

import torch

from tests.planted.graph_backends import TorchGraphSafe

EVERY = 64


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


class SyncsOnTheSecondBuild(TorchGraphSafe):
    """Reads the longest length from the device (``.item()``, a blocking sync) on one build only,
    the ``sync_on``-th: the second is a sync in the steady state, one step after the first."""

    name = "planted_syncs_on_the_second_build"
    sync_on = 2
    builds = 0

    def build(self, common):
        self.builds += 1
        if self.builds == self.sync_on:
            self.longest = int(common.seq_lens.max().item())
        return super().build(common)


class SyncsOnTheFirstBuild(SyncsOnTheSecondBuild):
    """The same sync on the first build only: a lazy initialisation, which the steady check (as the
    syncs check's warm-up step) does not count."""

    name = "planted_syncs_on_the_first_build"
    sync_on = 1
