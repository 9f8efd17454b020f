"""ZMQ endpoints and typed send/receive helpers. Endpoints are ipc:// files in a private
0700 temp dir, so only this user's processes on this host can connect."""

from __future__ import annotations

import tempfile
from typing import Any

import msgspec
import zmq


class Endpoints(msgspec.Struct):
    """Where each process listens. Per data-parallel rank (scheduler_in, scheduler_results) and per
    (data-parallel, tensor-parallel) rank (worker_in), these are bases: see the *_of methods."""

    scheduler_in: str  # tokenizer or DP controller -> scheduler
    worker_in: str  # scheduler -> worker
    scheduler_results: str  # worker -> scheduler
    detokenizer_in: str  # scheduler -> detokenizer
    tokenizer_in: str  # detokenizer -> tokenizer
    controller_in: str  # tokenizer and schedulers' load reports -> DP controller (when --dp-size > 1)
    launcher: str  # every child -> launcher (ready / failed)

    @classmethod
    def create(cls) -> "Endpoints":
        base = tempfile.mkdtemp(prefix="loom-")  # mkdtemp makes it 0700
        return cls(**{name: f"ipc://{base}/{name}" for name in cls.__struct_fields__})

    def requests_in(self, dp_size: int) -> str:
        """Where the tokenizer sends requests: the DP controller, or the one scheduler."""
        return self.controller_in if dp_size > 1 else self.scheduler_in_of(0)

    def scheduler_in_of(self, dp_rank: int) -> str:
        return f"{self.scheduler_in}-{dp_rank}"

    def scheduler_results_of(self, dp_rank: int) -> str:
        return f"{self.scheduler_results}-{dp_rank}"

    def worker_in_of(self, dp_rank: int, tp_rank: int) -> str:
        """The scheduler -> worker socket of one tensor-parallel rank of one data-parallel rank."""
        return f"{self.worker_in}-{dp_rank}-{tp_rank}"

    @property
    def directory(self) -> str:
        return self.launcher.removeprefix("ipc://").rsplit("/", 1)[0]


class Sender:
    def __init__(self, ctx: zmq.Context, kind: int, addr: str, bind: bool = False):
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(addr)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: Any, flags: int = 0) -> None:
        self.socket.send(self._encoder.encode(msg), flags, copy=False)

    def send_encoded(self, frame: bytes) -> None:
        """A message encoded once (msgspec msgpack) for several sockets."""
        self.socket.send(frame, copy=False)


class Receiver:
    def __init__(self, ctx: zmq.Context, kind: int, addr: str, schema: Any, bind: bool = True):
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(addr)
        self._decoder = msgspec.msgpack.Decoder(schema)

    def recv(self, flags: int = 0) -> Any:
        return self._decoder.decode(self.socket.recv(flags, copy=False).buffer)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms))

    def decode(self, frame: bytes | memoryview) -> Any:
        return self._decoder.decode(frame)
