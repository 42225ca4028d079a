"""Planted log-sum-exp defects, each torch_naive claiming ``returns_lse`` with one convention slip
of a kind a merge then compounds: base 2 (FlashInfer's default) handed over as natural log, and
the learned sink's term left out of the LSE while the output includes it."""

from __future__ import annotations

import math

from backends.torch_naive import TorchNaiveBackend


class LseInBaseTwo(TorchNaiveBackend):
    """Returns log2 of the denominator where the contract says natural log."""

    def log_sum_exp(self, query, key, context_len, sinks=None):
        return super().log_sum_exp(query, key, context_len, sinks) / math.log(2)


class LseWithoutTheSink(TorchNaiveBackend):
    """Leaves the learned sink's term out of the LSE (the output has it)."""

    def log_sum_exp(self, query, key, context_len, sinks=None):
        return super().log_sum_exp(query, key, context_len, None)
