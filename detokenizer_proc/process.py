"""The detokenizer process: token ids from the scheduler -> text deltas for the tokenizer
process. State per request lives only until that request's final delta."""

from __future__ import annotations

import logging

import zmq

from detokenizer_proc.decoder import load_decoder
from detokenizer_proc.incremental import IncrementalDetokenizer
from ipc.messages import BatchTextOut, BatchTokenOut, StatsResp, TextDelta, ToDetokenizer
from ipc.proc import ChildConfig, run_child
from ipc.sockets import Receiver, Sender

log = logging.getLogger("loom.detokenizer")


class Detokenizer:
    def __init__(self, decoder):
        self.decoder = decoder
        self.streams: dict[str, IncrementalDetokenizer] = {}

    def process(self, batch: BatchTokenOut) -> BatchTextOut:
        items = []
        for d in batch.items:
            stream = self.streams.get(d.rid)
            if stream is None:
                stream = IncrementalDetokenizer(self.decoder, skip_special_tokens=d.skip_special_tokens, stop=d.stop)
                self.streams[d.rid] = stream
            finished = d.finish is not None
            matched = d.finish.matched if finished and isinstance(d.finish.matched, str) else None
            text = stream.add(d.new_ids, finished=finished, matched_stop=matched)
            if finished:
                del self.streams[d.rid]
            items.append(TextDelta(rid=d.rid, text=text, new_ids=d.new_ids, prompt_tokens=d.prompt_tokens,
                                   completion_tokens=d.completion_tokens, finish=d.finish,
                                   retractions=d.retractions, logprobs=d.logprobs,
                                   cached_tokens=d.cached_tokens, prompt_logprobs=d.prompt_logprobs,
                                   embedding=d.embedding))
        return BatchTextOut(items)


def main(config: ChildConfig, report_ready) -> None:
    ctx = zmq.Context()
    inbox = Receiver(ctx, zmq.PULL, config.endpoints.detokenizer_in, ToDetokenizer)
    outbox = Sender(ctx, zmq.PUSH, config.endpoints.tokenizer_in)
    detok = Detokenizer(load_decoder(config.model_dir))
    report_ready({})
    while True:
        msg = inbox.recv()
        if msg is None:  # a frame the receiver dropped (logged there)
            continue
        if isinstance(msg, BatchTokenOut):
            outbox.send(detok.process(msg))
        else:  # answers to the tokenizer's queries; stats gain this process's request table
            if isinstance(msg, StatsResp):
                msg.stats["num_detokenizer_streams"] = len(detok.streams)
            outbox.send(msg)


if __name__ == "__main__":
    run_child(main)
