"""The harness state a verdict depends on, sealed before the backend is imported and checked after
every case: a backend that changes it (by accident: a global it shares with the harness, a
monkeypatch meant for its own tests, torch's default dtype) gets an ERROR naming what changed,
and the harness puts the state back before the next case.

Sealed: every module of the harness packages loaded before the backend (and those loaded later,
from when they first appear): each module-level name's object, each function's code, defaults
and closure, each class's own attributes, and the value of plain data (numbers, strings, and
containers of them: the comparison tolerances, the oracle's constants); and the torch settings
that change what the harness computes. Objects of other types are sealed by identity.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

HARNESS_PACKAGES = ("conformance", "reference_engine", "host_syncs", "backends.base", "backends.registry")
# pytest's side of the plugin: pytest itself sets attributes on its item classes as items are made.
NOT_SEALED = ("conformance.pytest_plugin",)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_CONTAINERS = (tuple, list, dict, set, frozenset)
_MAX_DEPTH = 4

# Module-level objects the harness itself changes while it runs: caches, not rules.
MUTABLE_BY_DESIGN: frozenset[str] = frozenset()


def _torch_settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """torch settings that change what the harness draws, computes and compares: name -> (get, set)."""
    settings = {
        "torch default dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "torch float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    }
    if hasattr(torch, "get_default_device"):
        settings["torch default device"] = (torch.get_default_device, torch.set_default_device)
    return settings


def _fingerprint(value: Any, depth: int = 0) -> Any:
    """Equal for equal plain data; the identity of anything else."""
    if isinstance(value, _PLAIN) and type(value) in _PLAIN:
        return (type(value).__name__, repr(value))
    if type(value) in _CONTAINERS and depth < _MAX_DEPTH:
        items = value.items() if isinstance(value, dict) else value
        if isinstance(value, (set, frozenset)):
            return (type(value).__name__, tuple(sorted(repr(_fingerprint(item, depth + 1)) for item in items)))
        if isinstance(value, dict):
            return ("dict", tuple((_fingerprint(k, depth + 1), _fingerprint(v, depth + 1)) for k, v in items))
        return (type(value).__name__, tuple(_fingerprint(item, depth + 1) for item in items))
    return ("id", id(value))


def _is_plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN) and type(value) in _PLAIN:
        return True
    if type(value) in _CONTAINERS and depth < _MAX_DEPTH:
        items = list(value.items()) if isinstance(value, dict) else list(value)
        flat = [part for item in items for part in (item if isinstance(value, dict) else (item,))]
        return all(_is_plain(part, depth + 1) for part in flat)
    return False


@dataclass
class _Entry:
    """One sealed place: how to read it now, its fingerprint then, and how to put it back."""

    where: str
    read: Callable[[], Any]
    fingerprint: Any
    restore: Callable[[], None]
    keep: Any = None  # holds the sealed object, so that its id cannot be reused


def _attribute_entries(owner: Any, name: str, where: str) -> list[_Entry]:
    value = vars(owner)[name]  # a class's raw attribute: getattr would bind a classmethod anew each time
    saved = copy.deepcopy(value) if _is_plain(value) else None

    def read(owner=owner, name=name):
        return _fingerprint(vars(owner).get(name, _MISSING))

    def restore(owner=owner, name=name, original=value, saved=saved):
        """The original object back under its name, and a container's contents back in place (every
        other name the harness has for it sees them too)."""
        if vars(owner).get(name, _MISSING) is not original:
            setattr(owner, name, original)
        if isinstance(original, dict):
            original.clear()
            original.update(copy.deepcopy(saved))
        elif isinstance(original, (list, set)):
            original.clear()
            (original.extend if isinstance(original, list) else original.update)(copy.deepcopy(saved))

    entries = [_Entry(where, read, _fingerprint(value), restore, keep=value)]
    function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
    if isinstance(function, types.FunctionType):
        for part in ("__code__", "__defaults__", "__kwdefaults__"):
            original = getattr(function, part)
            entries.append(
                _Entry(
                    f"{where}.{part}",
                    lambda f=function, p=part: ("id", id(getattr(f, p))),
                    ("id", id(original)),
                    lambda f=function, p=part, o=original: setattr(f, p, o),
                    keep=original,
                )
            )
    return entries


_MISSING = object()


@dataclass
class Seal:
    """``Seal.take()`` before the backend is imported; ``changes()`` after each case names what
    differs (and puts it back)."""

    entries: list[_Entry] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)
    class_names: dict[str, frozenset[str]] = field(default_factory=dict)

    @staticmethod
    def take() -> "Seal":
        seal = Seal()
        for name, (get, set_) in _torch_settings().items():
            original = get()
            seal.entries.append(
                _Entry(
                    name,
                    lambda get=get: _fingerprint(get()),
                    _fingerprint(original),
                    lambda set_=set_, original=original: set_(original),
                )
            )
        seal._add_new_modules()
        return seal

    def _add_new_modules(self) -> None:
        for module_name, module in list(sys.modules.items()):
            if module_name in self.modules or module is None or not _is_harness(module_name):
                continue
            self.modules.add(module_name)
            for name in list(vars(module)):
                if name.startswith("__") or f"{module_name}.{name}" in MUTABLE_BY_DESIGN:
                    continue
                value = vars(module)[name]
                where = f"{module_name}.{name}"
                self.entries += _attribute_entries(module, name, where)
                if isinstance(value, type) and value.__module__ == module_name:
                    self._seal_class(value, where)

    def _seal_class(self, cls: type, where: str) -> None:
        own = frozenset(name for name in vars(cls) if not name.startswith("__") or name in ("__init__", "__call__"))
        self.class_names[where] = own
        for name in own:
            self.entries += _attribute_entries(cls, name, f"{where}.{name}")

    def changes(self) -> list[str]:
        """What differs from the seal, each put back as it was; then modules new since the last
        call are sealed too."""
        changed: dict[int, list[str]] = {}  # one line per object, however many names the harness has for it
        for entry in self.entries:
            if entry.read() != entry.fingerprint:
                where = entry.where
                try:
                    entry.restore()
                except Exception as error:  # noqa: BLE001 - say so; the change itself is reported either way
                    where += f" (could not be put back: {type(error).__name__})"
                shared = type(entry.keep) in _CONTAINERS or not _is_plain(entry.keep)  # small ints are shared by chance
                changed.setdefault(id(entry.keep) if shared else id(entry), []).append(where)
        lines = [
            names[0] + (f" (and {len(names) - 1} other name(s) for it)" if len(names) > 1 else "")
            for names in changed.values()
        ]
        lines += self._added_class_attributes()
        self._add_new_modules()
        return lines

    def _added_class_attributes(self) -> list[str]:
        """An attribute added to a harness class shadows what it inherited (a method replaced on a
        subclass): removed, and reported."""
        added = []
        for where, own in self.class_names.items():
            module_name, _, qualified = where.rpartition(".")
            cls = getattr(sys.modules.get(module_name), qualified, None)
            if not isinstance(cls, type):
                continue
            for name in set(vars(cls)) - own:
                if name.startswith("__") and name not in ("__init__", "__call__"):
                    continue
                added.append(f"{where}.{name} (added)")
                delattr(cls, name)
        return added


def _is_harness(module_name: str) -> bool:
    if module_name in NOT_SEALED:
        return False
    return any(module_name == package or module_name.startswith(package + ".") for package in HARNESS_PACKAGES)
