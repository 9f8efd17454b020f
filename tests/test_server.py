"""launch.py as a real server: HTTP /generate (JSON and SSE), /health, the ZMQ client, the
same greedy text as the Engine (SIGTERM and dead children: tests/test_faults.py)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports (each socket held until all are picked: one closed at once may be
    handed out again)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Server:
    def __init__(self, *extra: str):
        self.port, self.zmq_port = free_ports(2)
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--port", str(self.port), "--zmq-port", str(self.zmq_port),
             "--dtype", "float32", "--kv-cache-gb", "0.5", "--max-running-requests", "16", *extra],
            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.output: list[str] = []
        # read the log as it comes: a full pipe would block the server's next log line
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        deadline = time.time() + 300
        while time.time() < deadline:
            assert self.proc.poll() is None, "server died at start-up:\n" + self.read_output()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:  # /health needs no key
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise TimeoutError("server not healthy in 300 s")

    def read_output(self) -> str:
        """The log so far (all of it once the server has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(5)
        return "".join(self.output)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                for c in self.children():
                    c.kill()
                self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def test_health_and_server_info(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    info = httpx.get(server.url + "/get_server_info").json()
    assert info["dtype"] == "float32" and info["max_total_tokens"] > 0
    assert info["stats"]["kv_slots_locked"] == 0
    assert info["zmq_endpoint"] == f"tcp://127.0.0.1:{server.zmq_port}"


def test_same_greedy_text_through_engine_http_and_zmq(server, engine):
    from ipc.client import LoomClient

    prompt = chat(engine.tokenizer, "Name three colours of the rainbow.")
    params = {"temperature": 0, "max_new_tokens": 40}
    via_engine = engine.generate(prompt, params)
    via_http = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": params},
                          timeout=120).json()
    with LoomClient(f"tcp://127.0.0.1:{server.zmq_port}") as client:
        via_zmq = client.generate(prompt, params)
        streamed = list(client.generate(prompt, params, stream=True))
    assert via_engine["text"] == via_http["text"] == via_zmq["text"] == streamed[-1]["text"]
    assert via_engine["output_ids"] == via_http["output_ids"] == via_zmq["output_ids"]
    assert len(streamed) > 1 and all(streamed[i]["text"].startswith(streamed[i - 1]["text"])
                                     for i in range(1, len(streamed)))


def test_http_streaming_sse_and_batch(server, engine):
    prompt = chat(engine.tokenizer, "What is the capital of France?")
    events = []
    with httpx.stream("POST", server.url + "/generate", timeout=120, json={
            "text": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["text"] == "The capital of France is Paris."
    batch = httpx.post(server.url + "/generate", timeout=120, json={
        "text": [prompt, "Hello"], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["text"] == "The capital of France"


def test_http_errors_are_400_and_server_keeps_serving(server):
    r = httpx.post(server.url + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"sampling_params": {}})
    assert r.status_code == 400
    r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


def test_disconnecting_stream_clients_are_aborted_and_nothing_is_left(server):
    import asyncio
    import random

    rng = random.Random(0)

    async def client(i: int, session: httpx.AsyncClient) -> bool:
        leave_after = rng.randint(1, 12) if i % 2 else None
        if i % 4 < 2:  # the native route, then the OpenAI one (its single-choice stream has no queue)
            route, body = "/generate", {"text": f"Tell me story number {i}.", "stream": True,
                                        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        else:
            route, body = "/v1/completions", {"prompt": f"Tell me story number {i}.", "stream": True, "max_tokens": 24,
                                              "temperature": 0, "ignore_eos": True}
        async with session.stream("POST", server.url + route, json=body) as r:
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if line == "data: [DONE]":
                        return True
                    if leave_after is not None and events >= leave_after:
                        return False  # closing the response drops the connection
        return True

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as session:
            return await asyncio.gather(*(client(i, session) for i in range(50)))

    done = asyncio.run(run())
    assert sum(done) == 25  # the other half walked away
    deadline = time.time() + 10
    while time.time() < deadline:
        stats = httpx.get(server.url + "/get_server_info").json()["stats"]
        if stats["num_running"] == 0 and stats["num_tokenizer_requests"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_tokenizer_requests"] == 0 and stats["num_detokenizer_streams"] == 0
    assert stats["kv_slots_total"] - stats["kv_slots_free"] == stats["kv_slots_evictable"]  # all cached, none locked
    assert stats["kv_slots_locked"] == 0 and stats["req_slots_free"] == stats["req_slots_total"]
    assert stats["idle_check_failures"] == 0
    assert httpx.post(server.url + "/flush_cache").json() == {"flushed": True}
    stats = httpx.get(server.url + "/get_server_info").json()["stats"]
    assert stats["kv_slots_free"] == stats["kv_slots_total"]


def test_metrics_health_generate_abort_and_flush(server):
    assert httpx.get(server.url + "/health_generate", timeout=60).json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("loom_time_to_first_token_seconds_bucket", "loom_inter_token_latency_seconds_count",
                 "loom_e2e_request_latency_seconds_sum", "loom_generation_tokens_total", "loom_num_running_reqs",
                 "loom_kv_cache_usage", "loom_busy_fraction", "loom_step_seconds"):
        assert name in text, name
    assert httpx.post(server.url + "/abort_request", json={}).status_code == 400
    assert httpx.post(server.url + "/abort_request", json={"rid": "nope"}).json() == {"aborted": "nope"}
    assert httpx.post(server.url + "/flush_cache").status_code == 200


def test_native_streaming_incremental(server):
    body = {"text": "Once upon a time", "stream": True, "incremental": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    pieces, ids = [], []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out = json.loads(line[6:])
                pieces.append(out["text"])
                ids += out["output_ids"]
    full = httpx.post(server.url + "/generate", timeout=120, json={**body, "stream": False}).json()
    assert "".join(pieces) == full["text"] and ids == full["output_ids"] and len(pieces) > 1


def test_sglang_logprob_fields_of_the_native_route(server, smollm2_tokenizer):
    """return_logprob / top_logprobs_num / logprob_start_len, as SGLang's /generate takes them:
    the output's logprobs, and the prompt's from logprob_start_len on (streamed or not)."""
    text = "The capital of France is"
    ids = smollm2_tokenizer.encode(text)
    body = {"text": text, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 2,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    out = httpx.post(server.url + "/generate", timeout=120, json=body).json()
    meta = out["meta_info"]
    assert [tid for _, tid in meta["input_token_logprobs"]] == ids[2:]
    assert all(lp < 0 for lp, _ in meta["input_token_logprobs"]) and len(meta["input_top_logprobs"][0]) == 2
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == 3
    whole = httpx.post(server.url + "/generate", timeout=120, json={**body, "logprob_start_len": 0}).json()
    assert whole["meta_info"]["input_token_logprobs"][0][0] is None
    assert whole["meta_info"]["input_token_logprobs"][2:] == meta["input_token_logprobs"]
    events = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
    plain = httpx.post(server.url + "/generate", timeout=120, json={**body, "return_logprob": False}).json()
    assert "input_token_logprobs" not in plain["meta_info"] and plain["meta_info"]["output_token_logprobs"] == []
    r = httpx.post(server.url + "/generate", timeout=120, json={**body, "top_logprobs_num": "2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num"


def test_eos_ids_read_before_the_tokenizer_loads_are_the_tokenizers(default_model_dir, smollm2_tokenizer, tmp_path):
    """The processes start with the eos ids the tokenizer's files name (the tokenizer loads
    meanwhile); where the files do not say it plainly, the tokenizer decides first."""
    import shutil

    import launch

    assert launch._eos_token_ids(default_model_dir) == launch._eos_token_ids(default_model_dir, smollm2_tokenizer)
    copy = tmp_path / "model"
    shutil.copytree(default_model_dir, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}}))
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(copy)
    assert other.eos_token_id != smollm2_tokenizer.eos_token_id
    assert launch._eos_token_ids(copy) == launch._eos_token_ids(copy, other)
    (copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert launch._eos_token_ids(copy) is None
    (copy / "special_tokens_map.json").unlink()
    (copy / "tokenizer.json").unlink()
    assert launch._eos_token_ids(copy) is None


def test_the_zmq_port_must_differ_from_the_http_port():
    import launch

    with pytest.raises(ValueError, match="zmq_port=8123: the HTTP server's --port"):
        launch.ServerArgs(port=8123, zmq_port=8123)
