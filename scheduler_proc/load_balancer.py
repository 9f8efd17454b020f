"""Which data-parallel rank a request goes to (`--load-balance-method`): small classes picked by
name from a registry, over what the controller knows of each rank's load. Pure: no socket, no
clock; the DP controller (`dp_controller.py`) and the tests drive it.

Each rank reports its load at a bounded rate (`LoadReport`: requests running and waiting, tokens
held, and how many requests it had received by then). Between reports the controller adds what
it has sent since (the requests a report does not yet include), so a burst spreads at once
instead of landing on the rank that looked idle at the last report.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ipc.messages import GenerateReq, LoadReport
from scheduler_proc.registry import Registry

LOAD_BALANCE_METHODS = Registry("load balance method")  # --load-balance-method


@dataclass(slots=True)
class RankLoad:
    """What the controller knows of one rank: its last report plus what was sent since."""

    requests_reported: int = 0  # running + waiting at the last report
    tokens_reported: int = 0  # KV tokens held + prompt tokens waiting at the last report
    received_reported: int = 0  # requests the rank had received by its last report
    finished: int = 0  # requests it has finished, by its reports
    sent: int = 0  # requests sent to it
    unreported: deque = field(default_factory=deque)  # (send number, prompt tokens) past its last report

    def requests(self) -> int:
        return self.requests_reported + self.sent - self.received_reported

    def tokens(self) -> int:
        return self.tokens_reported + sum(tokens for _, tokens in self.unreported)

    def outstanding(self) -> int:
        """Sent and not finished (Vidur's LOR counts this, from its own bookkeeping)."""
        return self.sent - self.finished


class LoadBalanceMethod:
    name = ""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def pick(self, loads: list[RankLoad], req: GenerateReq) -> int:
        raise NotImplementedError


def _least(loads: list[RankLoad], key: Callable[[RankLoad], int]) -> int:
    return min(range(len(loads)), key=lambda rank: (key(loads[rank]), rank))


@LOAD_BALANCE_METHODS.register("round_robin")
class RoundRobin(LoadBalanceMethod):
    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.next = 0

    def pick(self, loads, req):
        rank, self.next = self.next % len(loads), self.next + 1
        return rank


@LOAD_BALANCE_METHODS.register("total_requests")
class TotalRequests(LoadBalanceMethod):
    """The rank with the fewest requests running and waiting."""

    def pick(self, loads, req):
        return _least(loads, RankLoad.requests)


@LOAD_BALANCE_METHODS.register("total_tokens")
class TotalTokens(LoadBalanceMethod):
    """The rank holding the fewest tokens (KV in use and prompts waiting)."""

    def pick(self, loads, req):
        return _least(loads, RankLoad.tokens)


@LOAD_BALANCE_METHODS.register("lor")
class LeastOutstandingRequests(LoadBalanceMethod):
    """Vidur's LOR: the rank with the fewest requests sent to it and not yet finished."""

    def pick(self, loads, req):
        return _least(loads, RankLoad.outstanding)


@LOAD_BALANCE_METHODS.register("random")
class Random(LoadBalanceMethod):
    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.rng = random.Random(seed)

    def pick(self, loads, req):
        return self.rng.randrange(len(loads))


class LoadBalancer:
    """The controller's view of its ranks and its method; `routed_dp_rank` on a request wins."""

    def __init__(self, method: str, dp_size: int, seed: int = 0):
        self.method = LOAD_BALANCE_METHODS.make(method, seed)
        self.loads = [RankLoad() for _ in range(dp_size)]

    def pick(self, req: GenerateReq) -> int:
        if req.routed_dp_rank is not None:
            return req.routed_dp_rank
        return self.method.pick(self.loads, req)

    def on_sent(self, rank: int, req: GenerateReq) -> None:
        load = self.loads[rank]
        load.sent += 1
        load.unreported.append((load.sent, len(req.input_ids)))

    def on_report(self, report: LoadReport) -> None:
        load = self.loads[report.dp_rank]
        load.requests_reported, load.tokens_reported = report.running + report.waiting, report.tokens
        load.received_reported = report.received
        load.finished += len(report.finished)
        while load.unreported and load.unreported[0][0] <= report.received:
            load.unreported.popleft()
