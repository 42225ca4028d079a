"""Token trees (``backends.base``: "Token trees"): a spec-verify request's new tokens as a tree of
drafts, each token's parent among them, and what a token sees. Plain PyTorch, for the oracle, the
harness and the backends that read a tree on the host (``torch_naive``); a kernel reads the same
parents on the device.

A request's new tokens come in an order where every parent precedes its children: ``parents[i]``
is the index of token i's parent among the request's new tokens, -1 where its parent is the
context's last token (the root: the token the last step accepted). A chain is ``[-1, 0, 1, ...]``.
Token i sits at position ``context_len + depth(i)`` (the root's depth 0): what rope and a sliding
window see. It sees every context key and, among the new tokens, its ancestors and itself; with a
sliding window W only the keys whose position is within W of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chain(length: int) -> tuple[int, ...]:
    """The parents of a chain of ``length`` tokens: each the child of the one before."""
    return tuple(range(-1, length - 1))


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth: 0 for a child of the context, its parent's + 1 otherwise."""
    depth: list[int] = []
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            raise ValueError(f"token {index}'s parent {parent}: a parent is -1 or an earlier token")
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


def ancestors(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[q, q] bool: row i holds token i's ancestors among the new tokens, and i itself."""
    count = len(parents)
    seen = torch.eye(count, dtype=torch.bool)
    for index, parent in enumerate(parents):
        if parent >= 0:
            seen[index] |= seen[parent]
    return to_device(seen, device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without a sync: through pinned memory, asynchronously, to a GPU
    (a pageable copy would stall the host until the device has it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def visible(
    parents: Sequence[int], context_len: int, sliding_window: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[q, context_len + q] bool: which keys of the request each new token sees (module docstring);
    the keys in slot order, the context's then the new tokens'."""
    return visible_in_steps([parents], context_len, sliding_window, device)


def visible_in_steps(
    steps: Sequence[Sequence[int]],
    context_len: int,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``visible`` for a request whose new tokens came in several steps, one after another, each
    step's a tree by its parents (a decode step: [-1]): a token sees every key written before its
    step, as the next step's context, at its slot's position, and in its own step its ancestors
    and itself, at the step's start + depth. [q, context_len + q] bool, q every step's tokens."""
    total = sum(len(parents) for parents in steps)
    seen = torch.zeros(total, context_len + total, dtype=torch.bool)
    positions = torch.zeros(total, dtype=torch.long)
    start = 0
    for parents in steps:
        begin, end = context_len + start, context_len + start + len(parents)
        rows = slice(start, start + len(parents))
        seen[rows, :begin] = True
        seen[rows, begin:end] = ancestors(parents)
        positions[rows] = begin + torch.tensor(depths(parents), dtype=torch.long)
        start += len(parents)
    if sliding_window is not None:
        # A key before the token's step sits at its slot's position; one of its step, at its depth.
        step_of = torch.repeat_interleave(
            torch.arange(len(steps)), torch.tensor([len(parents) for parents in steps], dtype=torch.long)
        )
        key_positions = torch.arange(context_len + total).expand(total, -1).clone()
        same_step = step_of[:, None] == step_of[None, :]
        key_positions[:, context_len:] = torch.where(same_step, positions[None, :], key_positions[:, context_len:])
        seen &= positions[:, None] - key_positions < sliding_window
    return to_device(seen, device)


def full(width: int, depth: int) -> tuple[int, ...]:
    """The parents of the full tree of ``width`` children a token down to ``depth``, breadth
    first: the root, its ``width`` children, theirs, ... (EAGLE's static top-k tree)."""
    parents, level = [-1], [0]
    for _ in range(depth):
        following = []
        for parent in level:
            for _ in range(width):
                following.append(len(parents))
                parents.append(parent)
        level = following
    return tuple(parents)


MAX_BIT_TOKENS = 64  # a tree's tokens an int64 ancestor bitmask holds
_JUMPS = 6  # pointer jumps that reach every ancestor of a tree of MAX_BIT_TOKENS (depth < 2**6)


def chain_parents(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """On the device, no host value read: the ``tree_parents`` of a step whose requests are all
    chains (int32 [num_tokens]: each token's parent the token before it, -1 at a request's
    first), for a kernel that reads every verify row as a tree (``ancestor_bits``)."""
    rows = torch.arange(num_tokens, device=query_start_loc.device)
    return (rows - _first_rows(query_start_loc, rows) - 1).to(torch.int32)


def _first_rows(query_start_loc: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each row's request's first row."""
    starts = query_start_loc.long()
    return starts[torch.searchsorted(starts[1:], rows, right=True).clamp_(max=starts.shape[0] - 2)]


def ancestor_bits(query_start_loc: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, no host value read (graph-safe): each token's ancestors among its request's
    new tokens as an int64 bitmask (bit j: new token j, itself included) and its depth (int32),
    from ``parents`` (int32 [n], the metadata's ``tree_parents``) and the step's
    ``query_start_loc``. By pointer jumping: each of ``_JUMPS`` rounds doubles the levels a
    token's mask holds; a request's tree must have at most ``MAX_BIT_TOKENS`` tokens."""
    rows = torch.arange(parents.shape[0], device=parents.device)
    first = _first_rows(query_start_loc, rows)
    bits = torch.bitwise_left_shift(torch.ones_like(rows), rows - first)
    jump = torch.where(parents >= 0, first + parents.long(), -1)
    depth = (parents >= 0).long()
    for _ in range(_JUMPS):
        has = jump >= 0
        target = jump.clamp(min=0)
        bits, depth, jump = (
            bits | torch.where(has, bits[target], 0),
            depth + torch.where(has, depth[target], 0),
            torch.where(has, jump[target], -1),
        )
    return bits, depth.to(torch.int32)


def chains(query_lens: Sequence[int]) -> list[int]:
    """The parents of requests that are chains, one after another (a batch's flat list)."""
    return [parent for length in query_lens for parent in chain(length)]
