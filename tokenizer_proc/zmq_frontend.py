"""The server's ZMQ endpoint for `ipc.client.LoomClient`: a ROUTER socket speaking
ClientGenerate / ClientAbort in, ClientOutput out (msgspec, no pickle)."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from ipc.messages import ClientAbort, ClientGenerate, ClientOutput, FromClient
from tokenizer_proc.manager import TokenizerManager

log = logging.getLogger("loom.zmq")


class ZmqFrontend:
    """A message that does not decode as FromClient (malformed, truncated, several frames, or over
    `max_bytes`) is answered with an error and logged; nothing else is decoded."""

    def __init__(self, manager: TokenizerManager, address: str, max_bytes: int = 32 * 1024 * 1024):
        self.manager = manager
        self.max_bytes = max_bytes
        self.socket = manager.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromClient)
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}

    def start(self) -> None:
        asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            identity, *frames = await self.socket.recv_multipart()
            if len(frames) != 1 or len(frames[0]) > self.max_bytes:
                what = (f"{len(frames)} frames (one expected)" if len(frames) != 1 else
                        f"{len(frames[0])} bytes (the limit is {self.max_bytes}, --max-request-bytes)")
                log.error("dropped a client message of %s", what)
                await self._send(identity, ClientOutput("", "", [], {}, True, error=f"refused a message of {what}"))
                continue
            try:
                msg = self.decoder.decode(frames[0])
            except msgspec.DecodeError as e:
                log.error("dropped a malformed client message (%d bytes): %s", len(frames[0]), e)
                await self._send(identity, ClientOutput("", "", [], {}, True, error=f"malformed message: {e}"))
                continue
            key = (identity, msg.rid)
            if isinstance(msg, ClientAbort):
                task = self.tasks.pop(key, None)
                if task:
                    task.cancel()
                continue
            task = asyncio.get_running_loop().create_task(self._serve(identity, msg))
            self.tasks[key] = task
            task.add_done_callback(lambda _t, key=key: self.tasks.pop(key, None))

    async def _serve(self, identity: bytes, req: ClientGenerate) -> None:
        gen = self.manager.generate(text=req.text, input_ids=req.input_ids, sampling=req.sampling,
                                    rid=req.rid or None, stream=req.stream, priority=req.priority,
                                    routing_key=req.routing_key, routed_dp_rank=req.routed_dp_rank)
        try:
            async for out in gen:
                finished = out["meta_info"]["finish_reason"] is not None
                await self._send(identity, ClientOutput(req.rid, out["text"], out["output_ids"], out["meta_info"],
                                                        finished))
        except Exception as e:  # a bad request answers with an error; the server keeps going
            await self._send(identity, ClientOutput(req.rid, "", [], {}, True, error=str(e)))
        finally:
            await gen.aclose()

    async def _send(self, identity: bytes, out: ClientOutput) -> None:
        await self.socket.send_multipart([identity, self.encoder.encode(out)])
