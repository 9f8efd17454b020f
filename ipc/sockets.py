"""ZMQ endpoints and typed send/receive helpers. Endpoints are ipc:// files in a private
0700 temp dir, so only this user's processes on this host can connect; with several hosts
(--nnodes) the sockets between a scheduler and its workers are tcp://, on the address given."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from typing import Any

import msgspec
import zmq

log = logging.getLogger("loom.ipc")

_DIRECTORY = re.compile(r"loom-(\d+)-[\w]+")  # loom-<pid of the launcher>-<random>


def sweep_stale_directories(parent: str | None = None) -> list[str]:
    """Removes this user's ipc folders whose launcher is gone: a process killed by SIGKILL runs
    no clean-up, so the next start does it. Returns the folders removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _DIRECTORY.fullmatch(name)
        if not match:
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode) or _alive(int(match[1])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Endpoints(msgspec.Struct):
    """Where each process listens. Per data-parallel rank (scheduler_in, scheduler_results) and per
    worker of a data-parallel rank (worker_in), these are bases: see the *_of methods."""

    scheduler_in: str  # tokenizer or DP controller -> scheduler
    worker_in: str  # scheduler -> worker
    scheduler_results: str  # worker -> scheduler
    detokenizer_in: str  # scheduler -> detokenizer
    tokenizer_in: str  # detokenizer -> tokenizer
    controller_in: str  # tokenizer and schedulers' load reports -> DP controller (when --dp-size > 1)
    launcher: str  # every child -> launcher (ready / failed)
    # several hosts: worker_in / scheduler_results are tcp://host:port, ports counted up from
    # tcp_port (after the dp ranks' torch.distributed stores: see dist_init_addr_of)
    tcp_host: str = ""
    tcp_port: int = 0
    dp_size: int = 1
    group_size: int = 1  # workers per data-parallel rank: tp x pp

    @classmethod
    def create(cls, tcp: tuple[str, int] | None = None, dp_size: int = 1, group_size: int = 1) -> "Endpoints":
        sweep_stale_directories()
        base = tempfile.mkdtemp(prefix=f"loom-{os.getpid()}-")  # mkdtemp makes it 0700
        names = [n for n in cls.__struct_fields__ if n not in ("tcp_host", "tcp_port", "dp_size", "group_size")]
        host, port = tcp or ("", 0)
        return cls(**{name: f"ipc://{base}/{name}" for name in names}, tcp_host=host, tcp_port=port,
                   dp_size=dp_size, group_size=group_size)

    def dist_init_addr_of(self, dp_rank: int) -> str:
        """Where data-parallel rank dp_rank's tensor-parallel group meets (several hosts only)."""
        return f"{self.tcp_host}:{self.tcp_port + dp_rank}"

    def requests_in(self, dp_size: int) -> str:
        """Where the tokenizer sends requests: the DP controller, or the one scheduler."""
        return self.controller_in if dp_size > 1 else self.scheduler_in_of(0)

    def scheduler_in_of(self, dp_rank: int) -> str:
        return f"{self.scheduler_in}-{dp_rank}"

    def scheduler_results_of(self, dp_rank: int) -> str:
        if self.tcp_host:
            return self._tcp(self.dp_size + self.dp_size * self.group_size + dp_rank)
        return f"{self.scheduler_results}-{dp_rank}"

    def worker_in_of(self, dp_rank: int, index: int) -> str:
        """The scheduler -> worker socket of one worker (index: pp rank x tp size + tp rank) of one
        data-parallel rank."""
        if self.tcp_host:
            return self._tcp(self.dp_size + dp_rank * self.group_size + index)
        return f"{self.worker_in}-{dp_rank}-{index}"

    def _tcp(self, offset: int) -> str:
        return f"tcp://{self.tcp_host}:{self.tcp_port + offset}"

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
    """A socket that yields typed messages: every frame is decoded as `schema` (a tagged union of
    Structs) and nothing else; a frame that does not decode (malformed, truncated, of another
    type, or a multi-part message) is dropped with a log line, so a stray or hostile peer cannot
    take the process down."""

    def __init__(self, ctx: zmq.Context, kind: int, addr: str, schema: Any, bind: bool = True):
        self.socket = ctx.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(addr)
        self.address = addr
        self._decoder = msgspec.msgpack.Decoder(schema)
        self.dropped = 0

    def recv(self, flags: int = 0) -> Any | None:
        """The next message, or None when the frame received was dropped."""
        frames = self.socket.recv_multipart(flags, copy=False)
        if len(frames) != 1:
            return self._drop(f"a message of {len(frames)} frames (one expected)")
        try:
            return self._decoder.decode(frames[0].buffer)
        except msgspec.DecodeError as e:  # (ValidationError is one)
            return self._drop(f"{len(frames[0].buffer)} bytes that do not decode: {e}")

    def _drop(self, what: str) -> None:
        self.dropped += 1
        log.error("dropped %s on %s", what, self.address)
        return None

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms))


class PeerWatch:
    """Notices that the peer of a connected socket went away: a process killed on another host
    closes its TCP connections, which ZMQ reports as the disconnect of an established session
    (ZMQ would silently reconnect, and a PUSH/PULL pair would wait forever). Connection attempts
    before the peer is up report other events."""

    def __init__(self, socket: zmq.Socket):
        self.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def lost(self) -> bool:
        """Reads the pending events; True if a connected peer has disconnected."""
        from zmq.utils.monitor import recv_monitor_message

        lost = False
        while self.monitor.poll(0):
            lost |= recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        return lost
