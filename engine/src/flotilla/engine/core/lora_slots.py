"""Which LoRA adapter sits in which device slot: the scheduler's to decide, as it decides KV blocks.

A running request holds its adapter's slot; a slot whose adapter no running request uses is idle but keeps
its weights, so the adapter comes back without a copy. A request whose adapter is in no slot is admitted
only when a slot is idle, and takes the least recently used idle one: an adapter that running requests use
is never evicted. Plain Python, no torch: the model runner copies the weights into the slot the scheduler
names (ScheduledRequest.lora_slot).
"""

from __future__ import annotations

import itertools

NO_SLOT = -1  # the base model's rows


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.contents: list[str | None] = [None] * num_slots
        self.users = [0] * num_slots  # running requests per slot
        self.last_used = [0] * num_slots
        self._clock = itertools.count(1)

    def slot_of(self, name: str | None) -> int:
        if not name:
            return NO_SLOT
        try:
            return self.contents.index(name)
        except ValueError:
            return NO_SLOT

    def can_run(self, name: str | None) -> bool:
        """Whether a request for `name` could be admitted now, as far as slots go."""
        return not name or name in self.contents or 0 in self.users

    def acquire(self, name: str | None) -> int:
        """The slot a newly running request of `name` uses (the base: NO_SLOT)."""
        if not name:
            return NO_SLOT
        slot = self.slot_of(name)
        if slot == NO_SLOT:
            idle = [s for s in range(self.num_slots) if self.users[s] == 0]
            if not idle:
                raise RuntimeError(f"no idle LoRA slot for {name!r} (call can_run first)")
            slot = min(idle, key=lambda s: self.last_used[s])
            self.contents[slot] = name
        self.users[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot

    def release(self, name: str | None) -> None:
        """A running request of `name` stopped running (finished, aborted or preempted)."""
        slot = self.slot_of(name)
        if slot != NO_SLOT:
            assert self.users[slot] > 0, f"LoRA slot {slot} ({name!r}) released more often than acquired"
            self.users[slot] -= 1

    def forget(self, name: str) -> None:
        """The adapter was unloaded: its idle slot holds nothing any more."""
        slot = self.slot_of(name)
        if slot != NO_SLOT:
            assert self.users[slot] == 0, f"unloading {name!r}, which running requests use"
            self.contents[slot] = None

    def running_adapters(self) -> list[str]:
        return [name for name, users in zip(self.contents, self.users, strict=True) if name and users]
