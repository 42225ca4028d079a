"""Planted token-tree defects: torch_naive with one bug each of the kinds a tree-attention kernel
has (``backends.base``: "Token trees"): the tree treated as a chain, siblings seeing each other,
the parent but not the grandparent, positions by query index (the window's edge moves), one
request's tree applied to every request, and the window kept off the tree's own keys; and triton
with the step's tree dropped, or its masks kept from its first build; trtllm with the step's tree
dropped, or its draft masks packed bit-reversed into XQA's words."""

from __future__ import annotations

from dataclasses import replace

import torch

from backends import token_tree
from backends.torch_naive import TorchNaiveBackend


class TreeAsChain(TorchNaiveBackend):
    """Ignores the tree: query order is causality (every earlier token of the request visible)."""

    def build(self, common):
        return replace(super().build(common), tree_parents=None)


class SiblingsVisible(TorchNaiveBackend):
    """Masks by position alone: every new token at a depth up to its own is visible, its siblings
    and its cousins too (causal by depth, no ancestor mask)."""

    def seen(self, context_len, num_queries, num_keys, rows=None, tree=None):
        seen = super().seen(context_len, num_queries, num_keys, rows, tree)
        if tree is not None:
            depth = torch.tensor(token_tree.depths(tree), device=self.device)
            seen[:, context_len : context_len + num_queries] = depth[None, :] <= depth[:, None]
        return seen


class ParentButNotGrandparent(TorchNaiveBackend):
    """Sees its parent and itself among the new tokens, not the ancestors above the parent (an
    ancestor mask built one level deep)."""

    def seen(self, context_len, num_queries, num_keys, rows=None, tree=None):
        seen = super().seen(context_len, num_queries, num_keys, rows, tree)
        if tree is not None:
            one_level = torch.eye(num_queries, dtype=torch.bool, device=self.device)
            for index, parent in enumerate(tree):
                if parent >= 0:
                    one_level[index, parent] = True
            seen[:, context_len : context_len + num_queries] &= one_level
        return seen


class PositionsByQueryIndex(TorchNaiveBackend):
    """Places each tree token at context + its query index, not its depth: the ancestor mask is
    right, but a sliding window's edge falls where a chain's would (it hides context keys a deep
    branch's tokens see)."""

    def seen(self, context_len, num_queries, num_keys, rows=None, tree=None):
        seen = super().seen(context_len, num_queries, num_keys, rows, None)  # positions by query index
        if tree is not None:
            seen[:, context_len : context_len + num_queries] &= token_tree.ancestors(tree, self.device)
        return seen


class FirstRequestsTree(TorchNaiveBackend):
    """Reads the mask for request 0 only: every request with as many new tokens gets its tree."""

    def build(self, common):
        metadata = super().build(common)
        if metadata.tree_parents is not None:
            starts = metadata.query_start_loc
            first = metadata.tree_parents[starts[0] : starts[1]]
            parents = list(metadata.tree_parents)
            for request in range(1, len(starts) - 1):
                if starts[request + 1] - starts[request] == len(first):
                    parents[starts[request] : starts[request + 1]] = first
            metadata = replace(metadata, tree_parents=parents)
        return metadata


def triton_tree_as_chain():
    """triton whose build drops the step's tree: its kernels mask by query order (a chain)."""
    from backends.triton.backend import TritonAttentionBackend

    class TritonTreeAsChain(TritonAttentionBackend):
        def build(self, common):
            metadata = super().build(common)
            metadata.tree = False
            return metadata

    return TritonTreeAsChain


def trtllm_masks_bit_reversed():
    """trtllm that lays each row's draft mask in XQA's words the wrong way round (bit 63 - j for
    the request's new token j, a big-endian packing): every verify row, chain or tree, sees
    other drafts than its own ancestors."""
    from backends.flashinfer.trtllm import TrtllmBackend

    class TrtllmMasksBitReversed(TrtllmBackend):
        def build(self, common):
            metadata = super().build(common)
            if metadata.verify:
                bits = self.masks.clone()
                reversed_ = torch.zeros_like(bits)
                for j in range(64):
                    reversed_ |= ((bits >> j) & 1) << (63 - j)
                self.masks.copy_(reversed_)
            return metadata

    return TrtllmMasksBitReversed


def trtllm_tree_as_chain():
    """trtllm whose build drops the step's tree: XQA gets a chain's masks (query order)."""
    from backends.flashinfer.trtllm import TrtllmBackend

    class TrtllmTreeAsChain(TrtllmBackend):
        def build(self, common):
            return super().build(replace(common, tree_parents=None, tree_parents_cpu=None))

    return TrtllmTreeAsChain


def triton_tree_kept_from_first_build():
    """triton that makes its ancestor masks in its first build only (as a mask baked into a
    captured graph): later steps with other trees read the first step's."""
    from backends.triton.backend import TritonAttentionBackend

    class TritonTreeKeptFromFirstBuild(TritonAttentionBackend):
        placed = False

        def build(self, common):
            if not self.placed:
                self.placed = True
                return super().build(common)
            metadata = super(TritonAttentionBackend, self).build(common)  # the lengths, not the tree
            metadata.tree = common.tree_parents is not None
            return metadata

    return TritonTreeKeptFromFirstBuild


class WindowOverTheContextOnly(TorchNaiveBackend):
    """Applies the sliding window to the context's keys only: a tree token always sees all of its
    ancestors, however far above it (a kernel that masks the window in its context loop alone)."""

    def seen(self, context_len, num_queries, num_keys, rows=None, tree=None):
        seen = super().seen(context_len, num_queries, num_keys, rows, tree)
        if tree is not None:
            seen[:, context_len : context_len + num_queries] = token_tree.ancestors(tree, self.device)
        return seen


class AncestorsIn32Bits(TorchNaiveBackend):
    """Keeps each token's ancestors in a 32-bit mask: a tree token past index 31 loses every
    ancestor it has there (a kernel whose mask word is an int32)."""

    def seen(self, context_len, num_queries, num_keys, rows=None, tree=None):
        seen = super().seen(context_len, num_queries, num_keys, rows, tree)
        if tree is not None and num_queries > 32:
            seen[:, context_len + 32 : context_len + num_queries] = False
        return seen


class TreesKeptForTheirShape(TorchNaiveBackend):
    """Keeps a step's trees for every later step of the same shape (its query lengths), as a backend
    that caches its masks by the batch's shape: right while the trees stay, wrong once they change."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: dict[tuple[int, ...], list[int]] = {}

    def build(self, common):
        metadata = super().build(common)
        if metadata.tree_parents is not None:
            shape = tuple(common.query_lens_cpu.tolist())
            metadata = replace(metadata, tree_parents=self.kept.setdefault(shape, metadata.tree_parents))
        return metadata
