"""The checks, by name, in the order a run performs them."""
from __future__ import annotations

from conformance.checks.base import Check
from conformance.checks.numerics import NumericsCheck

CHECKS: dict[str, type[Check]] = {
    NumericsCheck.name: NumericsCheck,
}

DEFAULT_CHECKS = list(CHECKS)


def make_check(name: str) -> Check:
    return CHECKS[name]()
