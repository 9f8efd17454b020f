"""TokenizerManager against a bare socket standing in for the scheduler: requests made in one
event-loop turn (the n choices of a prompt) travel in one frame, and an abort never overtakes the
request it aborts."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from ipc.messages import AbortReq, GenerateReq, GenerateReqs, ToScheduler
from ipc.sockets import Endpoints
from tokenizer_proc.manager import TokenizerManager


class FakeScheduler:
    def __init__(self):
        self.endpoints = Endpoints.create()
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.endpoints.requests_in(1))
        self.decoder = msgspec.msgpack.Decoder(ToScheduler)

    def receive(self, timeout_ms: int = 5000):
        assert self.socket.poll(timeout_ms), "nothing reached the scheduler"
        return self.decoder.decode(self.socket.recv())

    def receive_all(self) -> list:
        frames = []
        while self.socket.poll(500):
            frames.append(self.decoder.decode(self.socket.recv()))
        return frames


@pytest.fixture
def scheduler():
    s = FakeScheduler()
    yield s
    s.socket.close()
    s.ctx.term()


def manager_for(scheduler: FakeScheduler) -> TokenizerManager:
    manager = TokenizerManager(scheduler.endpoints, tokenizer=[None] * 100, context_len=64)
    manager.start()
    return manager


def test_requests_made_together_go_in_one_frame(scheduler):
    async def main():
        manager = manager_for(scheduler)
        tasks = [asyncio.create_task(manager.generate_final(input_ids=[5, 6, 7], sampling={"max_new_tokens": 4},
                                                            rid=f"c{k}", prefill_group="g")) for k in range(3)]
        await asyncio.sleep(0.05)
        frame = scheduler.receive()
        assert isinstance(frame, GenerateReqs)
        assert [(r.rid, r.prefill_group) for r in frame.reqs] == [("c0", "g"), ("c1", "g"), ("c2", "g")]
        single = asyncio.create_task(manager.generate_final(input_ids=[5], sampling={"max_new_tokens": 4}, rid="s"))
        await asyncio.sleep(0.05)
        assert isinstance(scheduler.receive(), GenerateReq)
        for t in [*tasks, single]:
            t.cancel()  # the consumers leave: each request is aborted
        await asyncio.gather(*tasks, single, return_exceptions=True)
        assert sorted(scheduler.receive().rid for _ in range(4)) == ["c0", "c1", "c2", "s"]
        await manager.close()

    asyncio.run(main())


def test_an_abort_does_not_overtake_the_request_it_aborts(scheduler):
    async def main():
        manager = manager_for(scheduler)
        gen = manager.generate(input_ids=[5, 6], sampling={"max_new_tokens": 4}, rid="a", stream=True)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request is made (queued for this turn's frame), not yet sent
        assert [r.rid for r in manager._unsent] == ["a"]
        await manager.abort("a")  # e.g. the client went away at once
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await gen.aclose()
        await asyncio.sleep(0.05)  # let the sends leave before the sockets close
        await manager.close()

    asyncio.run(main())
    # the second abort: the consumer left
    assert [type(f) for f in scheduler.receive_all()] == [GenerateReq, AbortReq, AbortReq]


def test_text_beyond_the_model_s_vocabulary_is_refused(scheduler):
    """A tokenizer with more tokens than the model embeds: text that tokenizes past the model's
    vocabulary, and token ids past it, are request errors, not a worker's index error."""
    from tokenizer_proc.manager import RequestError

    class Tokenizer(list):
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    manager = TokenizerManager(scheduler.endpoints, tokenizer=Tokenizer([None] * 200), context_len=64,
                               model_vocab_size=100)
    assert manager.tokenize("ABC", None) == [65, 66, 67]
    with pytest.raises(RequestError, match="prompt: the text has token 120, beyond the model's vocabulary of 100"):
        manager.tokenize("Ax", None, "prompt")
    with pytest.raises(RequestError, match=r"0\.\.99"):
        manager.tokenize(None, [5, 150])


def test_a_request_that_cannot_be_encoded_ends_with_an_error_and_spares_its_frame(scheduler):
    """Requests are checked before they are queued; should one still fail to encode, it ends with
    an error instead of hanging, and the requests sharing its frame still reach the scheduler."""
    from tokenizer_proc.manager import RequestError

    async def main():
        manager = manager_for(scheduler)
        with pytest.raises(RequestError, match="rid"):
            await manager.generate_final(input_ids=[5], sampling={"max_new_tokens": 4}, rid="\ud800")
        encode = manager.encoder.encode

        class PickyEncoder:
            def encode(self, msg):
                if any(r.rid == "bad" for r in (msg.reqs if isinstance(msg, GenerateReqs) else [msg])):
                    raise TypeError("cannot encode this one")
                return encode(msg)

        manager.encoder = PickyEncoder()
        tasks = [asyncio.create_task(manager.generate_final(input_ids=[5, 6], sampling={"max_new_tokens": 4},
                                                            rid=rid)) for rid in ("a", "bad", "b")]
        bad = await asyncio.wait_for(tasks[1], 5)
        assert bad["meta_info"]["finish_reason"]["type"] == "abort"
        assert "cannot encode this one" in bad["meta_info"]["finish_reason"]["message"]
        frame = scheduler.receive()
        assert isinstance(frame, GenerateReqs) and [r.rid for r in frame.reqs] == ["a", "b"]
        for t in (tasks[0], tasks[2]):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)
        await manager.close()

    asyncio.run(main())
