"""The prefill/decode split: a backend that serves only some batches (decode-only, verify up to
q tokens, or uniform batches of one query length) runs under the engine beside a companion
backend that serves the rest, as serving engines pair a decode kernel (FlashMLA, TRT-LLM) with a
prefill kernel (vLLM's MLA backends, SGLang's ``forward_extend``/``forward_decode``).

Per step, on the host and from host values only (no sync), the batch is cut into runs of
consecutive requests (``plan_parts``): a run the backend under test can take goes to it, the rest
to the companion; for a backend that takes only uniform batches, every run has one query length.
A uniform step (decode, verify, draft steps: every step a CUDA graph serves) is one run, handed
to the backend whole, so graph capture and ``update_for_draft_step`` work on its own metadata.

The companion keeps a cache of its own that every ``write_kv`` fills as well (a mirror): it never
reads the backend's layout, so any backend can be paired with any companion, and the backend under
test still writes every token and reads every token it attends to from its own cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from backends import registry
from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionSpec,
    BackendLimits,
    Capabilities,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.utils import sub_batch

AUTO = "auto"


def serves_every_batch(capabilities: Capabilities) -> bool:
    return capabilities.max_query_len is None and not capabilities.uniform_query_len


# Per layer kind, the built-ins that serve it: Triton's (no host lengths, graph-safe) and the
# plain-PyTorch one (any layout, any device).
BUILTINS = {
    "mha": ("triton", "torch_naive"),
    "mla": ("triton_mla", "torch_naive"),
    "indexer": ("triton_indexer", "torch_indexer"),
}


def companion_candidates(spec: AttentionSpec, device: torch.device) -> list[str]:
    """The built-ins tried, in order, as the companion (or a sparse model's indexer): Triton's where
    it compiles, else the plain-PyTorch backend."""
    triton, plain = BUILTINS[spec.kind]
    return ([triton] if device.type == "cuda" else []) + [plain]


def resolve_companion(
    backend_cls: type[AttentionBackend], spec: AttentionSpec, device: torch.device, requested: str | None = AUTO
) -> type[AttentionBackend] | None:
    """The companion class for ``backend_cls`` (None: the backend serves every batch itself).
    ``requested``: a backend name or ``auto``. ValueError, one line, when none can serve."""
    if serves_every_batch(backend_cls.capabilities):
        return None
    names = companion_candidates(spec, device) if requested in (None, AUTO) else [requested]
    companion, reasons = first_claiming(names, spec, device, every_batch=True)
    if companion is None:
        raise ValueError(
            f"{backend_cls.name or backend_cls.__name__} serves only some batches and no prefill backend "
            f"can serve the rest ({reasons})"
        )
    return companion


def first_claiming(
    names: list[str], spec: AttentionSpec, device: torch.device, every_batch: bool
) -> tuple[type[AttentionBackend] | None, str]:
    """The first of ``names`` that claims ``spec`` here (and, with ``every_batch``, serves every
    query length itself), or None and why each one cannot."""
    reasons = []
    for name in names:
        try:
            candidate = registry.load(name)
        except registry.BackendLookupError as error:
            raise ValueError(f"prefill backend: {error}") from None
        reason = candidate.unsupported_reason(spec, device)
        if not reason and every_batch and not serves_every_batch(candidate.capabilities):
            reason = "does not serve every query length itself"
        if not reason:
            return candidate, ""
        reasons.append(f"{name}: {reason}")
    return None, "; ".join(reasons)


@dataclass(frozen=True)
class Part:
    """Requests [first, last) of a step, served by one backend."""

    first: int
    last: int
    by_companion: bool


def runs(keys: list) -> list[tuple[int, int, Any]]:
    """Runs of consecutive requests with equal keys: (first, last, key)."""
    found: list[tuple[int, int, Any]] = []
    for index, key in enumerate(keys):
        if found and found[-1][2] == key:
            found[-1] = (found[-1][0], index + 1, key)
        else:
            found.append((index, index + 1, key))
    return found


def plan_parts(query_lens: list[int], capabilities: Capabilities) -> list[Part]:
    """Runs of consecutive requests each one backend serves: the backend under test takes a request
    whose query length it accepts (and, when it takes only uniform batches, a run of one length)."""
    limit = capabilities.max_query_len

    def key(length: int) -> tuple[bool, int | None]:
        by_companion = limit is not None and length > limit
        return by_companion, length if capabilities.uniform_query_len and not by_companion else None

    # An empty request (vLLM's graph padding) joins the run before it, or the first one when it leads.
    real = [key(length) for length in query_lens if length]
    keys, previous = [], real[0] if real else key(0)
    for length in query_lens:
        previous = key(length) if length else previous
        keys.append(previous)
    return [Part(first, last, key[0]) for first, last, key in runs(keys)]


@dataclass(frozen=True)
class Call:
    """One backend's share of a step: tokens [start, end) and its metadata. ``whole``: the step as
    it is (persistent tensors, graph padding rows and all), so the call takes the whole tensors."""

    backend: AttentionBackend
    start: int
    end: int
    metadata: Any
    whole: bool

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.whole else tensor[self.start : self.end]


def build_calls(
    common: CommonAttentionMetadata,
    parts: list[tuple[int, int, AttentionBackend]],
    build_name: str,
    routing: "Routing",
    label: Callable[[AttentionBackend], str | None],
) -> list[Call]:
    """Each part's metadata from its backend (``build`` or ``build_for_capture``), the part cut out
    of the step as a batch of its own unless it is the whole step; ``routing`` counts its tokens
    under ``label(backend)`` (None: not counted here)."""
    starts = common.query_start_loc_cpu.tolist()
    calls = []
    for first, last, backend in parts:
        whole = len(parts) == 1
        batch = common if whole else sub_batch(common, first, last)
        start, end = starts[first], starts[last]
        calls.append(Call(backend, start, end, getattr(backend, build_name)(batch), whole))
        name = label(backend)
        if name is not None:
            routing.add(name, end - start)
    return calls


@dataclass
class Routing:
    """What each backend served, counted on the host as steps are built (reports show it)."""

    batches: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, tokens: int) -> None:
        self.batches[name] = self.batches.get(name, 0) + 1
        self.tokens[name] = self.tokens.get(name, 0) + tokens

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {name: {"batches": self.batches[name], "tokens": self.tokens[name]} for name in self.batches}

    def summary(self) -> str:
        return ", ".join(
            f"{name} served {self.batches[name]} batches ({self.tokens[name]} tokens)" for name in self.batches
        )

    @staticmethod
    def total(routings: "list[Routing]") -> "Routing":
        summed = Routing()
        for routing in routings:
            for name in routing.batches:
                summed.batches[name] = summed.batches.get(name, 0) + routing.batches[name]
                summed.tokens[name] = summed.tokens.get(name, 0) + routing.tokens[name]
        return summed


class SplitAttention(AttentionBackend):
    """The backend under test and its companion behind the one contract the engine calls. Its KV
    cache per layer is the pair (backend's cache, companion's mirror)."""

    def __init__(self, backend: AttentionBackend, companion: AttentionBackend) -> None:
        super().__init__(backend.spec, backend.limits, backend.device)
        self.backend, self.companion = backend, companion
        self.labels = {
            id(backend): backend.name or type(backend).__name__,
            id(companion): companion.name or type(companion).__name__,
        }
        self.name = "+".join(self.labels.values())
        # Steps the engine captures or drafts in are uniform: one part, the backend under test's.
        self.capabilities = dataclasses.replace(backend.capabilities, max_query_len=None, uniform_query_len=False)
        self.routing = Routing(
            dict.fromkeys(self.labels.values(), 0), dict.fromkeys(self.labels.values(), 0)
        )  # in this order

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.backend.kv_cache_shape(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.allocate_kv_cache(num_blocks), self.companion.allocate_kv_cache(num_blocks)

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        self.backend.write_kv(kv_cache[0], key, value, slot_mapping, layer=layer)
        self.companion.write_kv(kv_cache[1], key, value, slot_mapping, layer=layer)

    def read_kv(self, kv_cache, slot_mapping):
        return self.backend.read_kv(kv_cache[0], slot_mapping)

    def _serving(self, part: Part) -> AttentionBackend:
        return self.companion if part.by_companion else self.backend

    def _cache(self, kv_cache, call: Call):
        return kv_cache[int(call.backend is self.companion)]

    def _build(self, common: CommonAttentionMetadata, build_name: str) -> list[Call]:
        parts = plan_parts(common.query_lens_cpu.tolist(), self.backend.capabilities)
        return build_calls(
            common,
            [(part.first, part.last, self._serving(part)) for part in parts],
            build_name,
            self.routing,
            lambda backend: self.labels[id(backend)],
        )

    def build(self, common: CommonAttentionMetadata) -> list[Call]:
        return self._build(common, "build")

    def build_for_capture(self, common: CommonAttentionMetadata) -> list[Call]:
        return self._build(common, "build_for_capture")

    def update_for_draft_step(self, metadata: list[Call], common: CommonAttentionMetadata) -> list[Call]:
        # Draft steps are uniform (one token per request): one call, served by the backend under test.
        (call,) = metadata
        return [dataclasses.replace(call, metadata=call.backend.update_for_draft_step(call.metadata, common))]

    def forward(self, query, kv_cache, metadata: list[Call], out, layer: LayerParameters = PLAIN_LAYER) -> None:
        for call in metadata:
            call.backend.forward(
                call.rows(query),
                self._cache(kv_cache, call),
                call.metadata,
                call.rows(out),
                layer=layer.rows_of(call.rows),
            )


def attention_for(
    backend_cls: type[AttentionBackend],
    spec: AttentionSpec,
    limits: BackendLimits,
    device: torch.device,
    prefill_backend: str | None = AUTO,
) -> AttentionBackend:
    """The backend the engine calls: ``backend_cls`` alone when it serves every batch, else split
    with its companion (``prefill_backend``: a name, or ``auto``)."""
    backend = backend_cls(spec, limits, device)
    companion = resolve_companion(backend_cls, spec, device, prefill_backend)
    return backend if companion is None else SplitAttention(backend, companion(spec, limits, device))
