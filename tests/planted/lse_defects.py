"""Planted log-sum-exp defects, each torch_naive claiming the ``lse`` feature with one convention slip
of a kind a merge then compounds: base 2 (FlashInfer's default) handed over as natural log, the
learned sink's term left out of the LSE while the output includes it, and the LSE kept per KV
head rather than per query head (GQA and MLA: a head handed another head of its group's LSE, or
its column never written)."""

from __future__ import annotations

import math

import torch

from backends.torch_naive import TorchNaiveBackend


class LseInBaseTwo(TorchNaiveBackend):
    """Returns log2 of the denominator where the contract says natural log."""

    def log_sum_exp(self, query, key, context_len, sinks=None, indexed=None):
        return super().log_sum_exp(query, key, context_len, sinks, indexed) / math.log(2)


class LseWithoutTheSink(TorchNaiveBackend):
    """Leaves the learned sink's term out of the LSE (the output has it)."""

    def log_sum_exp(self, query, key, context_len, sinks=None, indexed=None):
        return super().log_sum_exp(query, key, context_len, None, indexed)


class LsePerKVHead(TorchNaiveBackend):
    """Indexes the LSE with the KV head's index: query head h is handed query head h // group's
    (a kernel whose LSE offset is computed from the KV head it reads)."""

    def log_sum_exp(self, query, key, context_len, sinks=None, indexed=None):
        lse = super().log_sum_exp(query, key, context_len, sinks, indexed)
        heads = torch.arange(self.spec.num_heads, device=lse.device)
        return lse[:, heads // self.spec.query_group_size]


class LseOfGroupsFirstHead(TorchNaiveBackend):
    """Keeps one LSE per KV group, its first query head's, and hands it to every head of the group
    (a kernel tiling a group's heads that stores the tile's first row)."""

    def log_sum_exp(self, query, key, context_len, sinks=None, indexed=None):
        lse = super().log_sum_exp(query, key, context_len, sinks, indexed)
        group = self.spec.query_group_size
        heads = torch.arange(self.spec.num_heads, device=lse.device)
        return lse[:, heads // group * group]


class LseWrittenAtKVHeadSlot(TorchNaiveBackend):
    """Writes query head h's LSE to column h // group (the KV head's index): each group's last
    head's lands in its KV head's column, and the columns past the KV head count are never written
    (they keep the buffer's NaN)."""

    def log_sum_exp(self, query, key, context_len, sinks=None, indexed=None):
        lse = super().log_sum_exp(query, key, context_len, sinks, indexed)
        group = self.spec.query_group_size
        written = torch.full_like(lse, float("nan"))
        kv_heads = self.spec.num_heads // group
        written[:, :kv_heads] = lse[:, group - 1 :: group]
        return written
