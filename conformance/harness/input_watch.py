"""Inputs must come back as they went in: a backend that scales the query in place, applies rope
to the key it was handed, clamps ``seq_lens`` or rewrites the block table corrupts the engine's
next use of them (the next layer's query, the next step's lengths) while its own output is right.

``InputWatch`` keeps a copy of every tensor the backend is handed and, after each call (``build``,
``write_kv``, ``forward``), a fingerprint of each, made on the device in stream order: nothing is
read on the host between the calls, so a watched step still runs as an engine's does (queued
behind a busy stream, or with the next step built while it is in flight). ``changes()``, after the
step has run, compares the fingerprints and, for a changed tensor, finds its first changed element
against the copy. Host tensors (the host lengths) are compared directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The elements as integers of their width, flattened: NaN equal to itself, -0 unequal to 0."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(width).reshape(-1)


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-element int64 digest on the tensor's device: the sum of its bit patterns and their sum
    weighted by position, so a change, a swap or a shift of elements changes it (int64 wraps alike
    on every device)."""
    bits = _bits(tensor).long()
    positions = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
    return torch.stack([bits.sum(), (bits * positions).sum()])


@dataclass
class InputWatch:
    tensors: dict[str, torch.Tensor]
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    before: dict[str, torch.Tensor] = field(default_factory=dict)
    after: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor | None]) -> "InputWatch":
        watch = cls({name: tensor for name, tensor in tensors.items() if tensor is not None and tensor.numel()})
        for name, tensor in watch.tensors.items():
            watch.copies[name] = tensor.clone()
            watch.before[name] = fingerprint(tensor)
        return watch

    def called(self, call: str) -> None:
        """Fingerprint every watched tensor after ``call`` returned (queued, not waited for)."""
        self.after.append((call, {name: fingerprint(tensor) for name, tensor in self.tensors.items()}))

    def changes(self) -> list[str]:
        """Per changed tensor: the first call after which it differed, and its first changed element."""
        found = []
        for name, tensor in self.tensors.items():
            call = next((call for call, prints in self.after if not torch.equal(prints[name], self.before[name])), None)
            if call is None:
                continue
            now, then = _bits(tensor), _bits(self.copies[name])
            changed = (now != then).nonzero()
            where = (
                "then put back by the end of the step"
                if not changed.numel()
                else self._element(name, int(changed[0]), tensor)
            )
            found.append(f"{call} changed {name} ({where})")
        return found

    def _element(self, name: str, flat: int, tensor: torch.Tensor) -> str:
        index, rest = [], flat
        for size in reversed(tensor.shape):  # divmod, not torch.unravel_index (its first call imports sympy)
            rest, position = divmod(rest, size)
            index.insert(0, position)
        was, now = self.copies[name].reshape(-1)[flat], tensor.contiguous().reshape(-1)[flat]
        return f"first at [{', '.join(map(str, index))}]: {_value(was)} → {_value(now)}"


def _value(element: torch.Tensor) -> str:
    return f"{element.double().item():.6g}" if element.is_floating_point() else str(element.item())
