"""The drafters a configuration can name, by the spec's name (what precedes its first colon: the
class's ``name``); the class's ``parse`` reads the rest. A new drafter is its module and one entry
here."""

from __future__ import annotations

from reference_engine.drafters.base import Drafter
from reference_engine.drafters.eagle import EagleDrafter
from reference_engine.drafters.layer_skip import LayerSkipDrafter
from reference_engine.drafters.mtp import MtpDrafter
from reference_engine.drafters.ngram import NgramDrafter
from reference_engine.drafters.none import NoDrafter
from reference_engine.drafters.scripted import ScriptedDrafter

DRAFTERS: dict[str, type[Drafter]] = {
    drafter.name: drafter
    for drafter in (
        NoDrafter,
        EagleDrafter,
        MtpDrafter,
        ScriptedDrafter,
        NgramDrafter,
        LayerSkipDrafter,
    )
}


def drafter_names(drafting_only: bool = False) -> str:
    """The specs a configuration can give, for messages: "none, eagle, scripted:PATTERN, …"."""
    return ", ".join(cls.usage for cls in DRAFTERS.values() if cls.drafts or not drafting_only)


def parse_drafter(spec: str, num_target_layers: int) -> Drafter:
    """The drafter ``spec`` names (``NoDrafter`` for "none"), unbound."""
    name, colon, argument = spec.partition(":")
    drafter = DRAFTERS.get(name)
    if drafter is None:
        raise ValueError(f"unknown drafter {spec!r} ({drafter_names()})")
    return drafter.parse(argument if colon else None, num_target_layers)
