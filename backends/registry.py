"""Backend names → classes: built-ins, the ``conformance.backends`` entry-point group, and
``pkg.module:Class`` given directly (a backend under development needs no packaging)."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from dataclasses import dataclass

from backends.base import AttentionBackend

ENTRY_POINT_GROUP = "conformance.backends"

# Built-ins import lazily: a vendor adapter's module may need a package that is not installed.
BUILTIN_BACKENDS: dict[str, str] = {
    "torch_naive": "backends.torch_naive:TorchNaiveBackend",
    "torch_indexer": "backends.torch_indexer:TorchIndexerBackend",
    "triton": "backends.triton.backend:TritonAttentionBackend",
    "triton_mla": "backends.triton.mla_backend:TritonMLABackend",
    "triton_indexer": "backends.triton.indexer:TritonIndexerBackend",
    "flashinfer": "backends.flashinfer.gqa:FlashInferBackend",
    "flashinfer_mla": "backends.flashinfer.mla:FlashInferMLABackend",
    "trtllm": "backends.flashinfer.trtllm:TrtllmBackend",
    "trtllm_mla": "backends.flashinfer.trtllm_mla:TrtllmMLABackend",
    "flashmla": "backends.flashmla:FlashMLABackend",
    "flashmla_sparse": "backends.flashmla_sparse:FlashMLASparseBackend",
    "deepgemm_indexer": "backends.deepgemm_indexer:DeepGEMMIndexerBackend",
    "flash_attn": "backends.flash_attn:FlashAttnBackend",
}


class BackendLookupError(LookupError):
    """A backend name that names nothing loadable; the message is one line for the user."""


class NoSuchBackendClass(BackendLookupError):
    """The module imports but has no such backend class: a typo on the command line."""


@dataclass(frozen=True)
class BackendRef:
    """Where a backend comes from, before it is imported."""

    name: str
    target: str  # "pkg.module:Class"
    origin: str  # "builtin", "entry point", or "module:Class"


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[BackendRef]:
    refs = [BackendRef(name, target, "builtin") for name, target in BUILTIN_BACKENDS.items()]
    refs += [
        BackendRef(name, target, "entry point")
        for name, target in sorted(_entry_points().items())
        if name not in BUILTIN_BACKENDS
    ]
    return refs


def resolve(name: str) -> BackendRef:
    if name in BUILTIN_BACKENDS:
        return BackendRef(name, BUILTIN_BACKENDS[name], "builtin")
    entry_points = _entry_points()
    if name in entry_points:
        return BackendRef(name, entry_points[name], "entry point")
    if ":" in name:
        return BackendRef(name, name, "module:Class")
    choices = ", ".join(ref.name for ref in known_backends())
    raise BackendLookupError(f"unknown backend {name!r} (known: {choices}; or give pkg.module:Class)")


def load(ref: BackendRef | str) -> type[AttentionBackend]:
    """Import the backend class. Raises BackendLookupError with a one-line reason."""
    if isinstance(ref, str):
        ref = resolve(ref)
    module_name, _, class_name = ref.target.partition(":")
    if not module_name or not class_name:
        raise BackendLookupError(f"{ref.target!r} is not of the form pkg.module:Class")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure of one backend is that backend's, not the command's
        where = f"entry point {ref.name!r} ({ref.target})" if ref.origin == "entry point" else f"backend {ref.name!r}"
        raise BackendLookupError(
            f"cannot import {module_name} for {where}: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        ) from error
    backend_cls = getattr(module, class_name, None)
    if backend_cls is None:
        raise NoSuchBackendClass(f"{module_name} has no {class_name}{_what_it_has(module, class_name)}")
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttentionBackend)):
        raise NoSuchBackendClass(f"{ref.target} is not an AttentionBackend subclass")
    return backend_cls


def _what_it_has(module, class_name: str) -> str:
    """The backend classes ``module`` does have, the closest first where one is close."""
    found = sorted(
        name
        for name, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, AttentionBackend) and value is not AttentionBackend
    )
    close = difflib.get_close_matches(class_name, found, n=1)
    if close:
        return f" (did you mean {module.__name__}:{close[0]}?)"
    return f" (its backend classes: {', '.join(found)})" if found else " (nor any AttentionBackend subclass)"
