"""The data-parallel controller process (`--dp-size N > 1`): between the tokenizer and the N
scheduler processes (each with its own tensor-parallel workers and KV pool). It sends each
request to one rank (`load_balancer.py`: `--load-balance-method`, or the request's
`routed_dp_rank`), an abort to the rank that holds the request (to every rank for "abort all" or
an id it does not know), and a stats query to every rank. The ranks report their load back here;
all of them stream their tokens to the one detokenizer."""

from __future__ import annotations

import logging

import zmq

from ipc.messages import AbortReq, FlushCacheReq, GenerateReq, GenerateReqs, LoadReport, StatsReq, ToController
from ipc.proc import ChildConfig, run_child
from ipc.sockets import Receiver, Sender
from scheduler_proc.load_balancer import LoadBalancer

log = logging.getLogger("loom.dp_controller")


class DPController:
    """Routes what arrives to the ranks' senders (anything with `send(msg)`): the process wires it
    to sockets, the tests to lists."""

    def __init__(self, balancer: LoadBalancer, ranks: list):
        self.balancer = balancer
        self.ranks = ranks
        self.owner: dict[str, int] = {}  # request id -> its rank, until the rank reports it finished

    def handle(self, msg) -> None:
        if isinstance(msg, (GenerateReq, GenerateReqs)):
            self.dispatch([msg] if isinstance(msg, GenerateReq) else msg.reqs)
        elif isinstance(msg, AbortReq):
            rank = self.owner.get(msg.rid)
            for sender in self.ranks if rank is None else [self.ranks[rank]]:
                sender.send(msg)
        elif isinstance(msg, (StatsReq, FlushCacheReq)):
            for sender in self.ranks:
                sender.send(msg)
        elif isinstance(msg, LoadReport):  # (None, a frame the receiver dropped, matches nothing)
            self.balancer.on_report(msg)
            for rid in msg.finished:
                self.owner.pop(rid, None)

    def dispatch(self, reqs: list[GenerateReq]) -> None:
        """Requests that arrived in one frame: each gets a rank (a prefill group, the n choices of
        one prompt, stays together: it shares one prefill), and each rank gets its share in one
        frame, so it sees them together as before."""
        shares: dict[int, list[GenerateReq]] = {}
        group_rank: dict[str, int] = {}
        for req in reqs:
            rank = group_rank.get(req.prefill_group) if req.prefill_group is not None else None
            if rank is None:
                rank = self.balancer.pick(req)
                if req.prefill_group is not None:
                    group_rank[req.prefill_group] = rank
            shares.setdefault(rank, []).append(req)
            self.owner[req.rid] = rank
            self.balancer.on_sent(rank, req)
        for rank, share in shares.items():
            self.ranks[rank].send(share[0] if len(share) == 1 else GenerateReqs(share))


def main(config: ChildConfig, report_ready) -> None:
    args, ep = config.server_args, config.endpoints
    ctx = zmq.Context()
    inbox = Receiver(ctx, zmq.PULL, ep.controller_in, ToController)
    ranks = [Sender(ctx, zmq.PUSH, ep.scheduler_in_of(d)) for d in range(args["dp_size"])]
    controller = DPController(LoadBalancer(args["load_balance_method"], args["dp_size"]), ranks)
    report_ready({"dp_size": len(ranks), "load_balance_method": args["load_balance_method"]})
    while True:
        controller.handle(inbox.recv())


if __name__ == "__main__":
    run_child(main)
