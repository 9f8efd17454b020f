"""What every child process does first: die with its parent, ignore SIGINT and SIGTERM (a
terminal's Ctrl-C or a service manager signals the whole process group; the launcher drains the
requests in flight, then ends the children), read its config, and report ready or failed."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from typing import Callable

import msgspec
import zmq

from ipc.messages import ProcFailed, ProcReady
from ipc.sockets import Endpoints, Sender

PR_SET_PDEATHSIG = 1


class ChildConfig(msgspec.Struct):
    name: str
    endpoints: Endpoints
    model_dir: str
    server_args: dict  # the launcher's ServerArgs as plain fields
    dp_rank: int = 0  # the data-parallel rank a scheduler or worker serves
    tp_rank: int = 0  # a worker's rank in its tensor-parallel group
    pp_rank: int = 0  # a worker's pipeline stage


def die_with_parent() -> None:
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the launcher's watchdog still cleans up
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def run_child(main: Callable[[ChildConfig, Callable[[dict], None]], None]) -> None:
    """Entry point of `python -m <pkg>.process CONFIG_JSON`. `main(config, report_ready)`."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = msgspec.json.decode(sys.argv[1], type=ChildConfig)
    level = config.server_args.get("log_level", "info").upper()
    logging.basicConfig(level=level, format=f"[%(asctime)s {config.name}] %(levelname)s %(message)s")
    ctx = zmq.Context()
    launcher = Sender(ctx, zmq.PUSH, config.endpoints.launcher)

    def report_ready(info: dict) -> None:
        launcher.send(ProcReady(config.name, info))

    try:
        main(config, report_ready)
    except Exception as e:  # report, then die: the launcher's watchdog takes the tree down
        traceback.print_exc()
        launcher.send(ProcFailed(config.name, f"{type(e).__name__}: {e}"))
        launcher.socket.close(linger=1000)
        os._exit(1)
    os._exit(0)
