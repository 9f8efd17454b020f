"""The DP controller's dispatch without processes: each --load-balance-method over synthetic load
reports, and where requests, prefill groups, aborts and stats queries go."""

from __future__ import annotations

from collections import Counter

import pytest

from ipc.messages import AbortReq, GenerateReq, GenerateReqs, LoadReport, SamplingParams, StatsReq
from scheduler_proc.dp_controller import DPController
from scheduler_proc.load_balancer import LOAD_BALANCE_METHODS, LoadBalancer


def req(rid: str, prompt_len: int = 8, group: str | None = None, rank: int | None = None) -> GenerateReq:
    return GenerateReq(rid, list(range(prompt_len)), SamplingParams(), prefill_group=group, routed_dp_rank=rank)


def picks(balancer: LoadBalancer, n: int, prompt_len: int = 8, start: int = 0) -> list[int]:
    out = []
    for i in range(start, start + n):
        r = req(str(i), prompt_len)
        rank = balancer.pick(r)
        balancer.on_sent(rank, r)
        out.append(rank)
    return out


def test_every_method_is_registered_and_an_unknown_one_refused():
    assert LOAD_BALANCE_METHODS.names() == ["lor", "random", "round_robin", "total_requests", "total_tokens"]
    with pytest.raises(ValueError, match="unknown load balance method 'fastest'"):
        LoadBalancer("fastest", 2)


def test_round_robin_cycles():
    assert picks(LoadBalancer("round_robin", 3), 7) == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("method", ["total_requests", "total_tokens", "lor"])
def test_a_burst_between_reports_spreads_evenly(method):
    """No report arrives during a burst: what the controller sent since counts, so ranks stay within one."""
    counts = Counter(picks(LoadBalancer(method, 2), 64))
    assert abs(counts[0] - counts[1]) <= 1 and sum(counts.values()) == 64


def test_total_requests_follows_the_reports_and_what_was_sent_since():
    lb = LoadBalancer("total_requests", 2)
    picks(lb, 4)  # 2 each
    # rank 0 got both of its requests and still runs them; rank 1 finished its two
    lb.on_report(LoadReport(0, received=2, running=2, waiting=0, tokens=20))
    lb.on_report(LoadReport(1, received=2, running=0, waiting=0, tokens=0, finished=["1", "3"]))
    assert [lb.loads[r].requests() for r in (0, 1)] == [2, 0]
    assert picks(lb, 2, start=4) == [1, 1]  # rank 1 until it holds as many
    assert picks(lb, 2, start=6) == [0, 1]
    # a report that predates some sends keeps counting them
    lb.on_report(LoadReport(1, received=3, running=1, waiting=0, tokens=9))
    assert lb.loads[1].requests() == 1 + (lb.loads[1].sent - 3)


def test_total_tokens_weighs_prompt_lengths():
    lb = LoadBalancer("total_tokens", 2)
    long = req("long", prompt_len=500)
    lb.on_sent(lb.pick(long), long)  # rank 0
    assert picks(lb, 5, prompt_len=50) == [1] * 5  # 250 tokens on rank 1 still under 500
    lb.on_report(LoadReport(0, received=1, running=0, waiting=0, tokens=0, finished=["long"]))
    assert picks(lb, 1, prompt_len=50, start=10) == [0]


def test_lor_counts_outstanding_requests_not_tokens():
    lb = LoadBalancer("lor", 2)
    big = req("big", prompt_len=5000)
    lb.on_sent(0, big)
    assert picks(lb, 1) == [1]  # rank 1 has none outstanding
    assert picks(lb, 1, start=1) == [0]  # one each: the lower rank


def test_random_is_seeded_and_reaches_every_rank():
    a, b = picks(LoadBalancer("random", 3, seed=5), 60), picks(LoadBalancer("random", 3, seed=5), 60)
    assert a == b and set(a) == {0, 1, 2}


def test_routed_dp_rank_wins_over_the_method():
    lb = LoadBalancer("round_robin", 4)
    assert [lb.pick(req(str(i), rank=2)) for i in range(3)] == [2, 2, 2]


class Inbox(list):
    def send(self, msg):
        self.append(msg)


def controller(dp_size: int = 2, method: str = "round_robin") -> DPController:
    return DPController(LoadBalancer(method, dp_size), [Inbox() for _ in range(dp_size)])


def test_a_frame_is_split_per_rank_and_a_prefill_group_stays_together():
    c = controller()
    c.handle(GenerateReqs([req("a"), req("b"), req("c1", group="g"), req("c2", group="g"), req("d")]))
    rank0, rank1 = c.ranks
    assert [[r.rid for r in m.reqs] for m in rank0] == [["a", "c1", "c2"]]
    assert [[r.rid for r in m.reqs] for m in rank1] == [["b", "d"]]


def test_aborts_go_to_the_rank_that_holds_the_request_stats_to_all():
    c = controller()
    c.handle(req("x"))
    c.handle(req("y"))  # rank 1
    c.handle(AbortReq("y"))
    assert [type(m).__name__ for m in c.ranks[1]] == ["GenerateReq", "AbortReq"] and len(c.ranks[0]) == 1
    c.handle(AbortReq(""))  # abort all
    c.handle(StatsReq("q"))
    assert all(isinstance(inbox[-2], AbortReq) and isinstance(inbox[-1], StatsReq) for inbox in c.ranks)
    # once rank 0 reports x finished, an abort of x (unknown now) goes to every rank
    c.handle(LoadReport(0, received=1, running=0, waiting=0, tokens=0, finished=["x"]))
    c.handle(AbortReq("x"))
    assert all(isinstance(inbox[-1], AbortReq) for inbox in c.ranks)
    assert c.owner == {"y": 1}
