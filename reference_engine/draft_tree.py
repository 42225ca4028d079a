"""The shape of the token tree an EAGLE drafter proposes when it drafts more than one candidate per
position (EAGLE top-k > 1), and the tree each verify step then hands the backend.

Two kinds, as serving engines have them:

* **dynamic** (EAGLE-2, SGLang's ``topk``/``num_steps``/``num_draft_tokens``): ``depth`` draft
  steps; each step expands each of the ``topk`` best nodes of the last level into its ``topk``
  likeliest tokens and keeps the ``topk`` of those with the highest path probability; the verify
  tree is the ``num_drafts`` nodes of highest path probability among all kept (a node's path
  probability never exceeds its parent's, so the choice is closed under ancestors).
* **static** (EAGLE-1, vLLM's ``speculative_token_tree``): a fixed tree by its parents; each node's
  children are its likeliest tokens, the first child the likeliest.

A tree lives in breadth-first order: the root (the request's last token, index 0, parent -1), then
every node of depth 1, then depth 2, ...; so parents precede children, a prefix of the nodes is a
tree, and a draft step's query (every node above the level it expands) is a prefix. A chain
(top-k 1) is the tree [-1, 0, 1, ...].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from backends import token_tree


@dataclass(frozen=True)
class DraftTree:
    num_drafts: int  # the verify tree's nodes past the root
    depth: int  # draft steps: the verify tree's deepest node
    topk: int = 1  # dynamic: candidates kept per level and tokens per expansion; 0 for a static tree
    parents: tuple[int, ...] = ()  # static: the tree, root included, breadth-first

    @staticmethod
    def dynamic(topk: int, num_drafts: int, depth: int | None = None) -> DraftTree:
        """EAGLE-2's tree. ``depth`` by default as deep as the draft steps' queries fit in the
        verify row's slots (a step's query is every node above the level it expands)."""
        if topk < 1 or num_drafts < 1:
            raise ValueError(f"a draft tree needs top-k >= 1 and drafts >= 1, not {topk} and {num_drafts}")
        most = min(1 + num_drafts // topk, num_drafts)
        least = -(-num_drafts // topk)  # levels of top-k candidates that hold num_drafts
        depth = most if depth is None else depth
        if not least <= depth <= most:
            raise ValueError(
                f"a draft depth of {depth} with top-k {topk} and {num_drafts} drafts: from {least} (levels of "
                f"{topk} that hold the drafts) to {most} (each draft step's query, {topk} nodes per level above "
                f"it, must fit in the verify row's {1 + num_drafts} slots)"
            )
        return DraftTree(num_drafts, depth, topk)

    @staticmethod
    def static(parents: tuple[int, ...]) -> DraftTree:
        """A fixed tree by its parents, root included (``backends.token_tree``), put in
        breadth-first order."""
        depths = token_tree.depths(parents)  # ValueError for a malformed tree
        if len(parents) < 2 or depths.count(0) != 1:
            raise ValueError("a static draft tree has one root (parent -1) and at least one draft")
        order = sorted(range(len(parents)), key=lambda index: (depths[index], index))
        new_index = {old: new for new, old in enumerate(order)}
        bfs = tuple(-1 if parents[old] < 0 else new_index[parents[old]] for old in order)
        return DraftTree(len(parents) - 1, max(depths), 0, bfs)

    @staticmethod
    def parse(text: str, num_drafts: int, depth: int | None = None) -> DraftTree:
        """``topk=K`` (a dynamic tree of ``num_drafts`` drafts) or ``-1.P.P...`` (a static tree's
        parents, root included, bare or as the case grammar's ``tree[...]``)."""
        topk = re.fullmatch(r"topk=(\d+)", text)
        if topk:
            return DraftTree.dynamic(int(topk.group(1)), num_drafts, depth)
        parents = re.fullmatch(r"(?:tree\[)?(-1(?:\.\d+)+)\]?", text)
        if not parents:
            raise ValueError(f"draft tree {text!r}: topk=K or the parents -1.P.P... of a static tree (root first)")
        tree = DraftTree.static(tuple(int(parent) for parent in parents.group(1).split(".")))
        if tree.num_drafts != num_drafts:
            raise ValueError(f"a static tree of {tree.num_drafts} drafts with {num_drafts} speculative tokens")
        if depth is not None and depth != tree.depth:
            raise ValueError(f"a static tree of depth {tree.depth} with a draft depth of {depth}")
        return tree

    @property
    def is_static(self) -> bool:
        return bool(self.parents)

    @property
    def is_chain(self) -> bool:
        return self.depth == self.num_drafts

    def level_sizes(self) -> list[int]:
        """Nodes at each depth of the tree the draft steps grow (dynamic: every kept candidate)."""
        if self.is_static:
            depths = token_tree.depths(self.parents)
            return [depths.count(level) for level in range(self.depth + 1)]
        return [1] + [self.topk] * self.depth

    def query_sizes(self) -> list[int]:
        """Draft step d's query: every node of depth <= d (d = 0 .. depth - 1)."""
        sizes, total = [], 0
        for count in self.level_sizes()[:-1]:
            total += count
            sizes.append(total)
        return sizes

    def child_ranks(self) -> tuple[int, ...]:
        """Static: each node's rank among its parent's children (0: the likeliest token)."""
        ranks, seen = [], {}
        for parent in self.parents:
            ranks.append(seen.get(parent, 0))
            seen[parent] = ranks[-1] + 1
        return tuple(ranks)

    def describe(self) -> str:
        if self.is_static:
            return f"static tree {'.'.join(map(str, self.parents))}"
        return f"top-k {self.topk} tree of {self.num_drafts} drafts, depth {self.depth}"
