"""The scheduling policy: which waiting request is admitted next, and the order of the running batch
(served first to preempted first).

- `fcfs`: arrival order; a request's priority is ignored.
- `priority`: lower priority values first, arrival order among equals.
- `fair`: priority first; within a priority, the backlogged tenant with the lowest virtual token counter
  (fair_share.py) is admitted next, and when KV blocks run out the victim comes from the tenant furthest
  ahead. Within a tenant, arrival order.

Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flotilla.contract import SCHEDULING_FAIR, SCHEDULING_FCFS, SCHEDULING_POLICIES
from flotilla.engine.core.fair_share import FairShareLedger
from flotilla.engine.core.request import Request


class SchedulingPolicy:
    def __init__(self, name: str, ledger: FairShareLedger) -> None:
        if name not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}"
            )
        self.name = name
        self.ledger = ledger

    @property
    def reorders_running(self) -> bool:
        """True when the running order changes as tenants are served (the batch is re-sorted each step)."""
        return self.name == SCHEDULING_FAIR

    def queue_key(self) -> Callable[[Request], tuple]:
        """The waiting queue's stable order (the fair policy picks within it by tenant)."""
        if self.name == SCHEDULING_FCFS:
            return _arrival
        return _priority_then_arrival

    def running_key(self) -> Callable[[Request], tuple]:
        if self.name != SCHEDULING_FAIR:
            return self.queue_key()
        counter = self.ledger.counter
        return lambda r: (r.priority, counter(r.tenant), r.arrival_index)

    def pick(self, waiting: Sequence[Request]) -> int:
        """Index of the waiting request to admit next (`waiting` is sorted by queue_key)."""
        if self.name != SCHEDULING_FAIR or len(waiting) < 2:
            return 0
        top = waiting[0].priority
        best, best_counter, seen = 0, self.ledger.counter(waiting[0].tenant), {waiting[0].tenant}
        for index, request in enumerate(waiting):
            if request.priority != top or len(seen) == self.ledger.num_active:
                break  # sorted: the rest have a lower priority, or every tenant's first was seen
            if request.tenant in seen:
                continue  # not this tenant's first waiting request
            seen.add(request.tenant)
            counter = self.ledger.counter(request.tenant)
            if counter < best_counter:
                best, best_counter = index, counter
        return best


def _arrival(request: Request) -> tuple:
    return (request.arrival_index,)


def _priority_then_arrival(request: Request) -> tuple:
    return (request.priority, request.arrival_index)
