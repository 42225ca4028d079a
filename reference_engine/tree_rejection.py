"""Rejection over a token tree (``draft_tree``), batched on the device with no host sync.

A row's nodes: 0 the root (the token the last step emitted), 1..n its drafts, ``parents[j]`` the
node whose next token node j proposes (breadth-first order: parents first). The walk starts at the
root; at each node it moves to the first child the target accepts, and where none is accepted it
emits one more token drawn at that node and stops. The tokens of the path's drafts and that final
token are emitted; the path's nodes are what the engine keeps (``path``: their indices).

Greedy: a child is accepted when its token is the target's argmax at its parent (siblings are
distinct tokens, so at most one is); the final token is the argmax at the last node.

With a temperature the drafts are the drafter's likeliest tokens, not samples, so each is a
certain proposal: at a node whose target distribution is p, its children c_1, c_2, ... are tried
in order, c_i accepted with probability p(c_i) / (1 - p(c_1) - ... - p(c_{i-1})) (p with the
rejected siblings removed, renormalized); if none is, the final token is drawn from p with every
child removed. Each token then follows p exactly: P(c_i) = p(c_i), P(x) = p(x) for the rest
(SpecInfer's multi-candidate rejection with deterministic drafts), and so the emitted sequence
follows the target, whatever tree the drafter chose.

Outputs as ``rejection``'s: tokens [B, n + 1] (-1 past each row's emitted length) and the emitted
count [B]; and the path [B, n + 1], the node index of each kept position (-1 past it): position
j of the row's KV belongs to node path[j].
"""

from __future__ import annotations

import torch

from reference_engine.rejection import PLACEHOLDER
from reference_engine.sampling import gumbel_argmax


def _nodes(drafts: torch.Tensor, parents: torch.Tensor, num_drafts: torch.Tensor):
    """Each node's token (the root's unused), and which nodes are drafts this step."""
    tokens = torch.cat([torch.zeros_like(drafts[:, :1]), drafts], dim=1)
    index = torch.arange(tokens.shape[1], device=drafts.device)
    is_child = (index[None, :] <= num_drafts[:, None]) & (parents >= 0)
    return tokens, is_child


def tree_greedy_rejection(
    drafts: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor, num_drafts: torch.Tensor, depth: int
):
    """drafts [B, n]; parents [B, n + 1] (int64); target_argmax [B, n + 1] (the token after each node)."""
    tokens, is_child = _nodes(drafts, parents, num_drafts)
    wanted = target_argmax.gather(1, parents.clamp(min=0))
    return _walk(tokens, parents, is_child & (tokens == wanted), target_argmax, depth)


def tree_rejection_with_noise(
    drafts: torch.Tensor,
    parents: torch.Tensor,
    target_probabilities: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniform: torch.Tensor,
    final_uniform: torch.Tensor,
    depth: int,
):
    """target_probabilities [B, n + 1, V] (at each node); accept_uniform [B, n + 1] (one per node, as
    a child); final_uniform [B, n + 1, V] (the final token's draw at each node)."""
    batch, nodes, vocab = target_probabilities.shape
    tokens, is_child = _nodes(drafts, parents, num_drafts)
    flat = target_probabilities.reshape(batch, nodes * vocab)
    entry = parents.clamp(min=0) * vocab + tokens  # node j's token in its parent's distribution
    p_of = torch.where(is_child, flat.gather(1, entry), 0.0)
    index = torch.arange(nodes, device=drafts.device)
    earlier_sibling = (
        (parents[:, None, :] == parents[:, :, None]) & (index[None, :] < index[:, None]) & is_child[:, None, :]
    )
    tried_before = (earlier_sibling * p_of[:, None, :]).sum(dim=-1)  # mass of the siblings tried first
    accepted = is_child & accept_child(p_of, tried_before, accept_uniform)
    # What a node's final token is drawn from: p without its children.
    removed = torch.zeros_like(flat).scatter_add_(1, entry, is_child.to(flat.dtype))
    residual = (flat * (removed == 0)).view(batch, nodes, vocab)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probabilities)
    return _walk(tokens, parents, accepted, gumbel_argmax(residual, final_uniform), depth)


def accept_child(p_of: torch.Tensor, tried_before: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Accept a child with probability p(c) / (1 - the mass of its siblings tried before it): p
    with the rejected siblings removed, renormalized."""
    return uniform * (1.0 - tried_before).clamp(min=0.0) < p_of


def _walk(tokens: torch.Tensor, parents: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor, depth: int):
    """From the root, ``depth`` levels at most: to the first accepted child, else stop; then the
    final token of the last node."""
    batch, nodes = tokens.shape
    node = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    going = torch.ones(batch, dtype=torch.bool, device=tokens.device)
    emitted = torch.full((batch, nodes), PLACEHOLDER, dtype=torch.long, device=tokens.device)
    path = torch.full((batch, nodes), -1, dtype=torch.long, device=tokens.device)
    path[:, 0] = 0
    count = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    for level in range(depth):
        candidates = accepted & (parents == node[:, None])
        going = going & candidates.any(dim=1)
        child = candidates.int().argmax(dim=1)  # the first accepted child
        emitted[:, level] = torch.where(going, tokens.gather(1, child[:, None]).squeeze(1), PLACEHOLDER)
        path[:, level + 1] = torch.where(going, child, -1)
        node = torch.where(going, child, node)
        count += going.long()
    emitted.scatter_(1, count[:, None], final.gather(1, node[:, None]))
    return emitted, count + 1, path
