"""pytest-xdist's ``--dist loadgroup`` scheduling, told which conformance items belong together.

xdist keeps the items of one group on one worker; it reads an item's group from an ``@group``
suffix it appends to the node id on the worker. Under pytest 9 that append is lost (node ids are
no longer the ``_nodeid`` attribute xdist rewrites), and a conformance item's id ends in a case
id that holds ``@seed`` itself. So the controller's scheduler takes a conformance item's group
from the run's plan instead, by its name; every other item (the author's own tests, with their
``xdist_group`` marks) is grouped as xdist groups it.

When a worker dies, xdist's group scheduling gives the rest of its group to another worker, but
the item it died in too, which then kills that worker as well, until xdist runs out of restarts
and every case left is "not run". Here the item a worker died in is reported once (CRASH) and not
run again; the rest of its group goes on elsewhere. As in a serial run, a backend whose workers
died more than ``MAX_CRASHES`` times runs no more of its groups (those already handed to a worker
finish): a backend that hangs in every case does not cost every case its time limit.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

from conformance.pytest_results import item_name
from conformance.run.isolation import MAX_CRASHES


def conformance_groups(groups: dict[str, tuple[str, str]]) -> type[LoadGroupScheduling]:
    """The scheduler class for a run whose conformance items (by name) form ``groups``: name ->
    (group, backend)."""
    crashes: dict[str, int] = {}

    def backend_of(unit: dict[str, bool]) -> str | None:
        return next((groups[name][1] for name in map(item_name, unit) if name in groups), None)

    class ConformanceGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = groups.get(item_name(nodeid))
            return f"conformance:{group[0]}" if group is not None else super()._split_scope(nodeid)

        def remove_node(self, node) -> str | None:
            """xdist's own, but the item the node died in is marked done, and only groups with
            items left go back in the queue (a group with none would be sent to a fresh worker as
            an empty batch, after which nothing asks for more work and the run waits forever)."""
            workload = self.assigned_work.pop(node)
            crashed = None
            for work_unit in workload.values():
                crashed = next((nodeid for nodeid, completed in work_unit.items() if not completed), None)
                if crashed is not None:
                    work_unit[crashed] = True  # xdist reports it crashed; a fresh worker takes the rest
                    break
            given_up = set()
            if crashed is not None and item_name(crashed) in groups:
                backend = groups[item_name(crashed)][1]
                crashes[backend] = crashes.get(backend, 0) + 1
                if crashes[backend] > MAX_CRASHES:
                    given_up.add(backend)
                    for scope in [scope for scope, unit in self.workqueue.items() if backend_of(unit) == backend]:
                        del self.workqueue[scope]
            self.workqueue.update(
                {
                    scope: unit
                    for scope, unit in workload.items()
                    if not all(unit.values()) and backend_of(unit) not in given_up
                }
            )
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return ConformanceGroupScheduling
