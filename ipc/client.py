"""A ZMQ client for a running loom server (its endpoint is printed at start-up).

    from ipc.client import LoomClient
    with LoomClient("tcp://127.0.0.1:30001") as c:
        print(c.generate("Hello", {"max_new_tokens": 8, "temperature": 0})["text"])
        for chunk in c.generate("Hello", {"max_new_tokens": 8}, stream=True):
            print(chunk["text"])
"""

from __future__ import annotations

import uuid
from typing import Iterator

import msgspec
import zmq

from ipc.messages import ClientAbort, ClientGenerate, ClientOutput, SamplingParams


class LoomClientError(RuntimeError):
    pass


class LoomClient:
    def __init__(self, endpoint: str, timeout_s: float = 600.0):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientOutput)

    def generate(self, prompt: str | None = None, sampling_params: dict | SamplingParams | None = None, *,
                 input_ids: list[int] | None = None, stream: bool = False,
                 routed_dp_rank: int | None = None) -> dict | Iterator[dict]:
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else msgspec.convert(
            {k: v for k, v in (sampling_params or {}).items() if v is not None}, SamplingParams)
        req = ClientGenerate(rid=uuid.uuid4().hex, text=prompt, input_ids=input_ids, sampling=sp, stream=stream,
                             routed_dp_rank=routed_dp_rank)
        self.socket.send(self.encoder.encode(req))
        outputs = self._outputs(req.rid)
        if stream:
            return outputs
        last = None
        for last in outputs:
            pass
        return last

    def _outputs(self, rid: str) -> Iterator[dict]:
        done = False
        try:
            while not done:
                if not self.socket.poll(self.timeout_ms):
                    raise LoomClientError(f"no answer from the server in {self.timeout_ms / 1000:.0f} s")
                out = self.decoder.decode(self.socket.recv())
                if out.rid != rid:
                    continue  # a late answer to an earlier, abandoned request
                if out.error:
                    raise LoomClientError(out.error)
                done = out.finished
                yield {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}
        finally:
            if not done:  # the caller stopped iterating: tell the server to abort
                self.socket.send(self.encoder.encode(ClientAbort(rid)))

    def close(self) -> None:
        self.socket.close()
        self.ctx.term()

    def __enter__(self) -> "LoomClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
