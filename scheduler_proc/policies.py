"""Waiting-queue orders (`--schedule-policy`), each a small class picked by name from a registry.
A policy reorders the waiting queue in place before admission; the head is considered first."""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING, Iterable

from scheduler_proc.registry import Registry

if TYPE_CHECKING:
    from scheduler_proc.req import Req

QUEUE_POLICIES = Registry("schedule policy")  # --schedule-policy


class QueuePolicy:
    name = ""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def order(self, waiting: deque["Req"], running: Iterable["Req"]) -> None:
        """Reorder `waiting` in place."""


def _resort(waiting: deque["Req"], key) -> None:
    items = sorted(waiting, key=key)
    waiting.clear()
    waiting.extend(items)


@QUEUE_POLICIES.register("fcfs")
class FirstComeFirstServed(QueuePolicy):
    """Arrival order. A retracted request keeps its arrival time, so it goes back to the front."""

    def order(self, waiting, running):
        _resort(waiting, lambda r: r.arrival)


@QUEUE_POLICIES.register("lof")
class LongestOutputFirst(QueuePolicy):
    """Largest max_new_tokens first; arrival order among equals."""

    def order(self, waiting, running):
        _resort(waiting, lambda r: (-r.sampling.max_new_tokens, r.arrival))


@QUEUE_POLICIES.register("random")
class RandomOrder(QueuePolicy):
    """A seeded shuffle of the queue every step."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.rng = random.Random(seed)

    def order(self, waiting, running):
        items = list(waiting)
        self.rng.shuffle(items)
        waiting.clear()
        waiting.extend(items)


@QUEUE_POLICIES.register("routing-key")
class RoutingKeyGroups(QueuePolicy):
    """Requests sharing a client-given `routing_key` stay together: keys already running come
    first (their requests share context and cache), then groups by their earliest arrival;
    arrival order within a group. Requests without a key form singleton groups."""

    def order(self, waiting, running):
        running_keys = {r.routing_key for r in running if r.routing_key is not None}
        first_arrival: dict[str, float] = {}
        for r in waiting:
            if r.routing_key is not None:
                first_arrival[r.routing_key] = min(first_arrival.get(r.routing_key, r.arrival), r.arrival)

        def key(r: "Req"):
            if r.routing_key is None:
                return (1, r.arrival, r.arrival)
            hot = 0 if r.routing_key in running_keys else 1
            return (hot, first_arrival[r.routing_key], r.arrival)

        _resort(waiting, key)


def apply_priority(waiting: deque["Req"]) -> None:
    """Priority scheduling on top of any policy: higher `priority` first; the policy's order
    (a stable sort keeps it) within a level."""
    _resort(waiting, lambda r: -r.priority)
