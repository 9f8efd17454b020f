"""Several hosts (`--nnodes 2`), played on one host by two launch.py processes on 127.0.0.1: a
tensor-parallel group split across them serves the same greedy outputs as one node, and either
node going away takes the other down."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from inproc import build_tiny_checkpoint, with_tokenizer
from test_server import ROOT, Server

PROMPTS_SEED = 4


def free_port_range(n: int) -> int:
    """A base port with n free ports after it (the multi-node endpoints count up from it): below
    the kernel's ephemeral range (32768 up by default), where a connection made meanwhile could take
    one, and bound as ZMQ binds (SO_REUSEADDR: a port an earlier test left in TIME_WAIT is free)."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for base in range(20000, low - n, 97):
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("mn-llama"), seed=21)
    return with_tokenizer(path, default_model_dir)


def start_nodes(model_path) -> tuple[Server, subprocess.Popen]:
    addr = f"127.0.0.1:{free_port_range(8)}"
    common = ["--model-path", str(model_path), "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), *common, "--node-rank", "1", "--dtype",
                              "float32", "--kv-cache-gb", "0.2"],
                             cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node0 = Server(*common, "--node-rank", "0")
    return node0, node1


def greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    import httpx

    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
    return [o["output_ids"] for o in httpx.post(url + "/generate", json=body, timeout=300).json()]


def test_a_tensor_parallel_group_across_two_nodes_matches_one_node(tiny):
    g = torch.Generator().manual_seed(PROMPTS_SEED)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 12, 30, 8)]
    single = Server("--model-path", str(tiny))
    try:
        want = greedy(single.url, prompts)
    finally:
        single.stop()
    node0, node1 = start_nodes(tiny)
    try:
        assert greedy(node0.url, prompts) == want
        names = [" ".join(c.cmdline()) for c in psutil.Process(node1.pid).children(recursive=True)]
        assert len(names) == 1 and '"tp_rank":1' in names[0]  # node 1 runs only its worker
    finally:
        node0.stop()
        node1.wait(10)  # node 1 follows node 0 down


@pytest.mark.parametrize("victim", ["node 1", "node 0"])
def test_either_node_going_away_takes_the_other_down(tiny, victim):
    node0, node1 = start_nodes(tiny)
    node1_children = psutil.Process(node1.pid).children(recursive=True)
    node0_children = node0.children()
    try:
        start = time.monotonic()
        (psutil.Process(node1.pid) if victim == "node 1" else psutil.Process(node0.proc.pid)).kill()
        survivor = node0.proc if victim == "node 1" else node1
        survivor.wait(10)
        assert time.monotonic() - start < 5
        output = node0.read_output() if victim == "node 1" else survivor.stdout.read()  # (node 0's log is read as it comes)
        assert "disconnected" in output, output[-1500:]  # the survivor says why it went down
        time.sleep(0.3)
        left = [c for c in node0_children + node1_children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not left, left
    finally:
        for proc in (node0.proc, node1):
            if proc.poll() is None:
                proc.kill()
