"""Waiting-queue orders, each a small class picked by name from a registry."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from scheduler_proc.req import Req

_QUEUE_POLICIES: dict[str, type["QueuePolicy"]] = {}


def register_queue_policy(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        _QUEUE_POLICIES[name] = cls
        cls.name = name
        return cls

    return wrap


def make_queue_policy(name: str) -> "QueuePolicy":
    try:
        return _QUEUE_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {sorted(_QUEUE_POLICIES)}") from None


def queue_policy_names() -> list[str]:
    return sorted(_QUEUE_POLICIES)


class QueuePolicy:
    name = ""

    def order(self, waiting: deque["Req"]) -> None:
        """Reorder the waiting queue in place; the head is admitted first."""


@register_queue_policy("fcfs")
class FirstComeFirstServed(QueuePolicy):
    # Arrival order is the queue order; retracted requests go back to the head.
    pass
