"""Reservations waiting for room in the embedding pool: first come, first served, each until its deadline.

Pure bookkeeping, like the store: the daemon adds a request's reservation that does not fit, offers the queue
the room each release, commit or expiry may have made (`serve`), and answers what `serve` grants and what
`expired` returns. Strictly in arrival order: a later small request never takes the room an earlier large one
is waiting for, so the large one is not starved.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from common.protocol import Message

T = TypeVar("T")  # what the daemon keeps of a reservation (who asked, for what)


@dataclass
class Waiting(Generic[T]):
    request_id: str
    what: T
    deadline: float
    why: str = ""  # why it did not fit at its last try (for the refusal at its deadline)
    answer: Message | None = None  # once granted or refused


class ReservationQueue(Generic[T]):
    def __init__(self) -> None:
        self.waiting: OrderedDict[str, Waiting[T]] = OrderedDict()  # by request id, oldest first

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, request_id: str, what: T, wait_s: float, why: str = "") -> None:
        """At the back; a request asking again (its fetcher resent the reservation) replaces its earlier
        reservation but keeps its place."""
        earlier = self.waiting.get(request_id)
        deadline = earlier.deadline if earlier is not None else time.monotonic() + wait_s
        self.waiting[request_id] = Waiting(request_id, what, deadline, why)

    def withdraw(self, request_id: str) -> Waiting[T] | None:
        """An aborted or ended request's reservation, out of the queue (None: it had none waiting)."""
        return self.waiting.pop(request_id, None)

    def serve(self, answer: Callable[[Waiting[T]], bool]) -> list[Waiting[T]]:
        """Offer the room to the oldest reservation, then the next, until one must go on waiting (``answer``
        False; True: it was granted or refused): the answered ones, out of the queue."""
        answered = []
        while self.waiting:
            head = next(iter(self.waiting.values()))
            if not answer(head):
                break
            answered.append(self.waiting.pop(head.request_id))
        return answered

    def expired(self) -> list[Waiting[T]]:
        """Reservations past their deadline, out of the queue."""
        now = time.monotonic()
        late = [w for w in self.waiting.values() if w.deadline <= now]
        for waiting in late:
            del self.waiting[waiting.request_id]
        return late
