"""Faults through real processes: SIGTERM drains and exits cleanly; SIGKILL of any child takes
the server down at once, naming the dead process; a stalled worker (SIGSTOP) is caught by the
watchdog. Every way out leaves no child, no ipc folder and no shared memory behind.

CI kills the worker, the scheduler and the detokenizer; `python -m pytest -m reliability
tests/test_faults.py` also kills the DP controller and each kind of rank of a --dp-size 2
--tp-size 2 server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from test_server import Server


def child_named(s: Server, name: str) -> psutil.Process:
    return next(c for c in s.children() if f'"name":"{name}"' in " ".join(c.cmdline()))


def ipc_directory(s: Server) -> str:
    cmd = " ".join(s.children()[0].cmdline())
    return json.loads(cmd[cmd.index("{"):])["endpoints"]["launcher"].removeprefix("ipc://").rsplit("/", 1)[0]


def shared_memory() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def assert_nothing_left(children: list[psutil.Process], directory: str, shm_before: set[str]) -> None:
    time.sleep(0.2)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    assert not os.path.exists(directory), f"{directory} left behind"
    assert not shared_memory() - shm_before, shared_memory() - shm_before


def stream_in_background(s: Server, events: list, max_new_tokens: int, openai: bool = False) -> threading.Thread:
    """A streamed request (native, or OpenAI completions) whose events land in `events` ("[DONE]"
    last when the stream ended well)."""
    def run():
        route, body = "/generate", {"text": "Tell me a long story.", "stream": True, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        if openai:
            route, body = "/v1/completions", {"prompt": "Tell me a long story.", "stream": True, "temperature": 0,
                                              "max_tokens": max_new_tokens, "ignore_eos": True}
        try:
            with httpx.stream("POST", s.url + route, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
        except httpx.HTTPError as e:
            events.append(f"error: {type(e).__name__}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigterm_drains_in_flight_requests_and_leaves_nothing():
    shm = shared_memory()
    s = Server("--graceful-shutdown-timeout", "1.5")
    children, directory = s.children(), ipc_directory(s)
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    short, long_, long_openai = [], [], []  # one finishes within the grace period, the others are cut by it
    threads = [stream_in_background(s, short, 4), stream_in_background(s, long_, 4000),
               stream_in_background(s, long_openai, 4000, openai=True)]
    wait_for(lambda: short and long_ and long_openai)
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(5) == 0
    assert time.monotonic() - start < 5
    for t in threads:
        t.join(5)
    assert short[-1] == "[DONE]" and json.loads(short[-2])["meta_info"]["finish_reason"]["type"] == "length"
    assert long_[-1] == "[DONE]", long_[-3:]
    reason = json.loads(long_[-2])["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "shutting down" in reason["message"]
    assert long_openai[-1] == "[DONE]" and json.loads(long_openai[-2])["choices"][0]["finish_reason"] == "abort"
    assert "SIGTERM" in s.read_output()
    assert_nothing_left(children, directory, shm)


def kill_and_expect_shutdown(server_args: tuple[str, ...], name: str) -> None:
    """Starts a server, SIGKILLs its `name` child: the server exits non-zero within 5 s, names
    the process, and leaves no child, ipc folder or shared memory behind."""
    shm = shared_memory()
    s = Server(*server_args)
    children, directory = s.children(), ipc_directory(s)
    victim = child_named(s, name)
    start = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    code = s.proc.wait(10)
    assert code != 0 and time.monotonic() - start < 5
    output = s.read_output()
    assert f"the {name} process" in output and "SIGKILL" in output, output[-2000:]
    assert_nothing_left(children, directory, shm)


@pytest.mark.parametrize("name", ["worker", "scheduler", "detokenizer"])
def test_killing_a_child_takes_the_server_down_cleanly(name):
    kill_and_expect_shutdown((), name)


@pytest.mark.reliability
@pytest.mark.parametrize("name", ["dp_controller", "scheduler_dp1", "worker_dp0_tp1", "worker_dp1_tp0", "detokenizer"])
def test_killing_any_child_of_a_data_and_tensor_parallel_server(name):
    kill_and_expect_shutdown(("--dp-size", "2", "--tp-size", "3", "--kv-cache-gb", "0.2"), name)


def test_a_stalled_worker_is_caught_by_the_watchdog():
    shm = shared_memory()
    watchdog = 5  # seconds: far above a warm step (a first step on a busy machine can take seconds)
    s = Server("--watchdog-timeout", str(watchdog))
    children, directory = s.children(), ipc_directory(s)
    worker = child_named(s, "worker")
    warm = httpx.post(s.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert warm.status_code == 200
    events: list = []
    stream_in_background(s, events, 4000)
    wait_for(lambda: events)
    assert not events[0].startswith("error")
    worker.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    code = s.proc.wait(watchdog + 10)
    assert code != 0 and time.monotonic() - start < watchdog + 5
    output = s.read_output()
    assert "the scheduler process" in output and "watchdog" in output and "stalled" in output, output[-2000:]
    assert_nothing_left(children, directory, shm)


@pytest.mark.parametrize("ending", ["launcher.shutdown()", "pass", "raise RuntimeError('boom')", "sys.exit(3)"])
def test_the_ipc_folder_goes_at_every_exit_of_the_launcher(ending):
    """Engine.shutdown (an explicit shutdown), a normal exit, an uncaught exception and sys.exit
    all remove it (the signals are test_sigterm_... above)."""
    import subprocess
    import sys

    from test_server import ROOT

    code = ("import sys, launch\nfrom pathlib import Path\n"
            "launcher = launch.Launcher(launch.ServerArgs(), Path('.'), {})\n"
            "print(launcher.endpoints.directory, flush=True)\n" + ending + "\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    directory = out.stdout.split()[0]
    assert os.path.basename(directory).startswith("loom-")
    assert not os.path.exists(directory), (ending, out.stderr[-500:])
