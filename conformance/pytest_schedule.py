"""pytest-xdist's ``--dist loadgroup`` scheduling, told which conformance items belong together.

xdist keeps the items of one group on one worker; it reads an item's group from an ``@group``
suffix it appends to the node id on the worker. Under pytest 9 that append is lost (node ids are
no longer the ``_nodeid`` attribute xdist rewrites), and a conformance item's id ends in a case
id that holds ``@seed`` itself. So the controller's scheduler takes a conformance item's group
from the run's plan instead, by its name; every other item (the author's own tests, with their
``xdist_group`` marks) is grouped as xdist groups it.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

from conformance.pytest_results import item_name


def conformance_groups(groups: dict[str, str]) -> type[LoadGroupScheduling]:
    """The scheduler class for a run whose conformance items (by name) form ``groups``."""

    class ConformanceGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = groups.get(item_name(nodeid))
            return f"conformance:{group}" if group is not None else super()._split_scope(nodeid)

    return ConformanceGroupScheduling
