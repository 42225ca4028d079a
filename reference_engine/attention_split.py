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
from typing import Any

import torch

from backends import registry
from backends.base import AttentionBackend, AttentionSpec, BackendLimits, Capabilities, CommonAttentionMetadata
from backends.utils import sub_batch

AUTO = "auto"


def serves_every_batch(capabilities: Capabilities) -> bool:
    return capabilities.max_query_len is None and not capabilities.uniform_query_len


def companion_candidates(spec: AttentionSpec, device: torch.device) -> list[str]:
    """The built-ins tried, in order, as the companion: Triton where it compiles (no host lengths,
    graph-safe), else the plain-PyTorch backend (any layout, any device)."""
    return (["triton"] if device.type == "cuda" and spec.kind == "mha" else []) + ["torch_naive"]


def resolve_companion(backend_cls: type[AttentionBackend], spec: AttentionSpec, device: torch.device,
                      requested: str | None = AUTO) -> type[AttentionBackend] | None:
    """The companion class for ``backend_cls`` (None: the backend serves every batch itself).
    ``requested``: a backend name or ``auto``. ValueError, one line, when none can serve."""
    if serves_every_batch(backend_cls.capabilities):
        return None
    names = companion_candidates(spec, device) if requested in (None, AUTO) else [requested]
    reasons = []
    for name in names:
        try:
            companion = registry.load(name)
        except registry.BackendLookupError as error:
            raise ValueError(f"prefill backend: {error}") from None
        reason = companion.unsupported_reason(spec, device)
        if not reason and not serves_every_batch(companion.capabilities):
            reason = "does not serve every query length itself"
        if not reason:
            return companion
        reasons.append(f"{name}: {reason}")
    raise ValueError(f"{backend_cls.name or backend_cls.__name__} serves only some batches and no prefill backend "
                     f"can serve the rest ({'; '.join(reasons)})")


@dataclass(frozen=True)
class Part:
    """Requests [first, last) of a step, served by one backend."""

    first: int
    last: int
    by_companion: bool


def plan_parts(query_lens: list[int], capabilities: Capabilities) -> list[Part]:
    """Runs of consecutive requests each one backend serves: the backend under test takes a request
    whose query length it accepts (and, when it takes only uniform batches, a run of one length)."""
    limit = capabilities.max_query_len
    parts: list[Part] = []
    for index, length in enumerate(query_lens):
        by_companion = limit is not None and length > limit
        previous = parts[-1] if parts else None
        joins = previous is not None and previous.by_companion == by_companion and (
            by_companion or not capabilities.uniform_query_len or query_lens[previous.first] == length)
        if joins:
            parts[-1] = dataclasses.replace(previous, last=index + 1)
        else:
            parts.append(Part(index, index + 1, by_companion))
    return parts


@dataclass
class SplitMetadata:
    """One step's parts: (part, its token range, the serving backend's metadata)."""

    calls: list[tuple[Part, int, int, Any]]


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
        return ", ".join(f"{name} served {self.batches[name]} batches ({self.tokens[name]} tokens)" for name in self.batches)

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
        self.labels = {id(backend): backend.name or type(backend).__name__, id(companion): companion.name or type(companion).__name__}
        self.name = "+".join(self.labels.values())
        # Steps the engine captures or drafts in are uniform: one part, the backend under test's.
        self.capabilities = dataclasses.replace(backend.capabilities, max_query_len=None, uniform_query_len=False)
        self.routing = Routing(dict.fromkeys(self.labels.values(), 0), dict.fromkeys(self.labels.values(), 0))  # in this order

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.backend.kv_cache_shape(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.allocate_kv_cache(num_blocks), self.companion.allocate_kv_cache(num_blocks)

    def write_kv(self, kv_cache, key, value, slot_mapping, **layer) -> None:
        self.backend.write_kv(kv_cache[0], key, value, slot_mapping, **layer)
        self.companion.write_kv(kv_cache[1], key, value, slot_mapping, **layer)

    def read_kv(self, kv_cache, slot_mapping):
        return self.backend.read_kv(kv_cache[0], slot_mapping)

    def _serving(self, part: Part) -> AttentionBackend:
        return self.companion if part.by_companion else self.backend

    def _build(self, common: CommonAttentionMetadata, build_name: str) -> SplitMetadata:
        parts = plan_parts(common.query_lens_cpu.tolist(), self.backend.capabilities)
        starts = common.query_start_loc_cpu.tolist()
        calls = []
        for part in parts:
            serving = self._serving(part)
            whole = len(parts) == 1  # the step as it is: persistent tensors, graph padding rows and all
            batch = common if whole else sub_batch(common, part.first, part.last)
            token_start, token_end = starts[part.first], starts[part.last]
            calls.append((part, token_start, token_end, getattr(serving, build_name)(batch)))
            self.routing.add(self.labels[id(serving)], token_end - token_start)
        return SplitMetadata(calls)

    def build(self, common: CommonAttentionMetadata) -> SplitMetadata:
        return self._build(common, "build")

    def build_for_capture(self, common: CommonAttentionMetadata) -> SplitMetadata:
        return self._build(common, "build_for_capture")

    def update_for_draft_step(self, metadata: SplitMetadata, common: CommonAttentionMetadata) -> SplitMetadata:
        # Draft steps are uniform (one token per request): one part, served by the backend under test.
        (part, start, end, inner), = metadata.calls
        return SplitMetadata([(part, start, end, self._serving(part).update_for_draft_step(inner, common))])

    def forward(self, query, kv_cache, metadata: SplitMetadata, out, **layer) -> None:
        if len(metadata.calls) == 1:
            part, _, _, inner = metadata.calls[0]
            self._serving(part).forward(query, kv_cache[int(part.by_companion)], inner, out, **layer)
            return
        for part, start, end, inner in metadata.calls:
            self._serving(part).forward(query[start:end], kv_cache[int(part.by_companion)], inner, out[start:end], **layer)


def attention_for(backend_cls: type[AttentionBackend], spec: AttentionSpec, limits: BackendLimits, device: torch.device,
                  prefill_backend: str | None = AUTO) -> AttentionBackend:
    """The backend the engine calls: ``backend_cls`` alone when it serves every batch, else split
    with its companion (``prefill_backend``: a name, or ``auto``)."""
    backend = backend_cls(spec, limits, device)
    companion = resolve_companion(backend_cls, spec, device, prefill_backend)
    return backend if companion is None else SplitAttention(backend, companion(spec, limits, device))
