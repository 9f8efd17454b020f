"""Load, hostile input, overload and security against one live server (real processes, sockets
and clients): a short soak, hand-written hostile requests, schemathesis fuzzing of every route
in the OpenAPI schema, garbage ZMQ frames on every socket, a request-queue burst, a client that
never reads, the API key on every route, the bind address and the ipc folder. The server's KV
pool is small on purpose, so the soak also retracts. Long forms: tests/test_soak.py and
`python -m pytest -m reliability`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest
import zmq

from soak import leaks, soak, wait_idle
from test_faults import ipc_directory
from test_server import ROOT, Server

KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 1 << 20
CONTEXT = 160


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-queued-requests", "48", "--max-request-bytes", str(BODY_LIMIT),
               "--context-length", str(CONTEXT), "--kv-cache-gb", "0.05", "--max-running-requests", "32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def assert_healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


def assert_idle_and_clean(http: httpx.Client) -> None:
    async def stats():
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=AUTH, timeout=60) as client:
            return await wait_idle(client)

    assert leaks(asyncio.run(stats())) == []


# ---- soak ---------------------------------------------------------------------------------------

def test_short_soak_loses_and_leaks_nothing(server, http):
    report, outcomes = asyncio.run(soak(server.url, server.proc.pid, n=120, concurrency=32, seed=1, max_tokens=16,
                                        greedy_prompts=6, api_key=KEY))
    print(report.summary())
    assert report.lost == [] and report.greedy_mismatches == []
    assert report.completed + report.left + report.aborted == report.requests
    assert report.left > 0 and report.completed > 60 and report.greedy_checked > 15
    assert_idle_and_clean(http)


def test_a_kv_pool_far_too_small_retracts_and_every_request_finishes(server, http):
    import random

    before = http.get("/get_server_info").json()["stats"]["num_retractions"]
    total = http.get("/get_server_info").json()["max_total_tokens"]
    # 100-token prompts (distinct: nothing to share) and 40 new tokens: all admitted with 70% of
    # their outputs reserved, then their outputs outgrow the pool
    prompt_len, new = 100, 40
    n = total // (prompt_len + 28)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(prompt_len)] for _ in range(n)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=600) as client:
            return await asyncio.gather(*(client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": new, "ignore_eos": True}}) for ids in prompts))

    outs = [r.json() for r in asyncio.run(run())]
    assert all(o["meta_info"]["completion_tokens"] == new for o in outs), [o["meta_info"] for o in outs][:3]
    assert http.get("/get_server_info").json()["stats"]["num_retractions"] > before
    assert any(o["meta_info"]["retractions"] for o in outs)
    assert_idle_and_clean(http)


# ---- hostile input ------------------------------------------------------------------------------

def _raw(text: str) -> bytes:
    return text.encode()


HOSTILE = [
    # (id, path, body: dict or raw bytes, status, what the error must mention)
    ("malformed json", "/generate", b'{"text": "hi", ', 400, "JSON"),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400, "object"),
    ("nested too deeply", "/generate", b"[" * 50000 + b"]" * 50000, 400, "JSON"),
    ("invalid utf-8", "/generate", b'{"text": "\xff\xfe\xfd"}', 400, "JSON"),
    ("lone surrogate", "/generate", b'{"text": "a\\ud800b"}', 400, "text"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages[0].content"),
    ("text of a wrong type", "/generate", {"text": 5}, 400, "text"),
    ("sampling_params a string", "/generate", {"text": "hi", "sampling_params": "greedy"}, 400, "sampling_params"),
    ("temperature a string", "/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400,
     "temperature"),
    ("priority a string", "/generate", {"text": "hi", "priority": "high"}, 400, "priority"),
    ("priority beyond 64 bits", "/generate", {"text": "hi", "priority": 2**70}, 400, "priority"),
    ("rid a list for one prompt", "/generate", {"text": "hi", "rid": ["a"]}, 400, "rid"),
    ("ragged input_ids", "/generate", {"input_ids": [[1, 2], 3]}, 400, "input_ids"),
    ("prompt a number", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("max_tokens a string", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("n a string", "/v1/completions", {"prompt": "hi", "n": "2"}, 400, "'n'"),
    ("prompt beyond the context", "/generate", {"text": "hello " * 400}, 400, "context"),
    ("input_ids beyond the context", "/generate", {"input_ids": [1] * (CONTEXT + 5)}, 400, "input_ids"),
    ("chat beyond the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello " * 400}]}, 400, "messages"),
    ("text far beyond any context", "/generate", {"text": "x" * 900_000}, 400, "text"),
    ("token id out of vocabulary", "/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("negative token id", "/generate", {"input_ids": [5, -1]}, 400, "input_ids"),
    ("huge token id in a prompt", "/v1/completions", {"prompt": [[10**30]], "echo": True}, 400, "prompt"),
    ("stop token out of vocabulary", "/generate",
     {"text": "hi", "sampling_params": {"stop_token_ids": [10**9]}}, 400, "token id"),
    ("logit bias out of vocabulary", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400,
     "token id"),
    ("NaN temperature", "/generate", _raw('{"text": "hi", "sampling_params": {"temperature": NaN}}'), 400,
     "temperature"),
    ("infinite top_p", "/generate", _raw('{"text": "hi", "sampling_params": {"top_p": Infinity}}'), 400, "top_p"),
    ("infinite repetition penalty", "/v1/completions",
     _raw('{"prompt": "hi", "repetition_penalty": Infinity}'), 400, "repetition_penalty"),
    ("-inf frequency penalty", "/v1/chat/completions",
     _raw('{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -Infinity}'), 400,
     "frequency_penalty"),
    ("NaN logit bias", "/generate", _raw('{"text": "hi", "sampling_params": {"logit_bias": {"5": NaN}}}'), 400,
     "logit_bias"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("negative max_new_tokens", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -5}}, 400,
     "max_new_tokens"),
    ("top_k zero", "/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, 400, "top_k"),
    ("min_p above one", "/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("a 1 MB stop string", "/generate", {"text": "hi", "sampling_params": {"stop": ["s" * 1_000_000]}}, 400,
     "stop"),
    ("thousands of stop strings", "/v1/completions", {"prompt": "hi", "stop": [f"w{i}" for i in range(5000)]}, 400,
     "stop"),
    ("thousands of stop regexes", "/generate",
     {"text": "hi", "sampling_params": {"stop_regex": [f"w{i}" for i in range(5000)]}}, 400, "stop_regex"),
    ("invalid regex", "/generate", {"text": "hi", "sampling_params": {"stop_regex": "(unclosed"}}, 400,
     "stop_regex"),
    ("n = 10,000", "/v1/completions", {"prompt": "hi", "n": 10_000}, 400, "'n'"),
    ("max_tokens = 10^9", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("max_new_tokens = 10^9", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}, 400,
     "max_new_tokens"),
    ("max_new_tokens beyond 64 bits", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}},
     400, "max_new_tokens"),
    ("top_logprobs = 10^6", "/generate", {"text": "hi", "sampling_params": {"logprobs": True, "top_logprobs": 10**6}},
     400, "top_logprobs"),
    ("logprobs = 10^6", "/v1/completions", {"prompt": "hi", "logprobs": 10**6}, 400, "logprobs"),
    ("5,000 prompts", "/generate", {"text": ["a"] * 5000}, 400, "prompts"),
    ("5,000 choices", "/v1/completions", {"prompt": ["a"] * 2500, "n": 2}, 400, "prompt"),
    ("streamed request with a bad value", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": -3}, 400, "temperature"),
    ("unknown sampling field", "/generate", {"text": "hi", "sampling_params": {"temprature": 0}}, 400, "temprature"),
    ("abort without rid", "/abort_request", {"rid": 5}, 400, "rid"),
    ("body over the limit", "/generate", b'{"text": "' + b"a" * (BODY_LIMIT + 10) + b'"}', 413,
     "--max-request-bytes"),
]


@pytest.mark.parametrize("path,body,status,mention", [case[1:] for case in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_request_is_a_4xx_json_error_naming_the_field(http, path, body, status, mention):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text[:500]
    message = r.json()["error"]["message"]
    assert mention in message, message[:500]


def test_hostile_requests_leave_the_server_healthy_and_clean(http):
    # (runs after the parametrized cases above, in file order)
    assert http.get("/nope").status_code == 404 and "error" in http.get("/nope").json()
    r = http.get("/generate")
    assert r.status_code == 405 and "error" in r.json()
    assert_healthy(http)
    assert_idle_and_clean(http)


def test_a_chunked_body_over_the_limit_is_413(http):
    def chunks():
        for _ in range(40):
            yield b"x" * 32768  # 1.25 MiB in all, no Content-Length

    r = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max-request-bytes" in r.json()["error"]["message"]


def test_a_backtracking_stop_regex_takes_bounded_time(http):
    # every way to split the output is tried before the \x00 fails to match: exponential in its
    # length without the time limit, which ends the request with why
    r = http.post("/generate", json={"text": "Count: a a a a a a a a a", "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "ignore_eos": True, "stop_regex": [r"(.+)+\x00"]}})
    assert r.status_code == 200
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] in ("abort", "length"), reason
    if reason["type"] == "abort":
        assert "stop_regex" in reason["message"]
    assert_healthy(http)


def test_stop_checker_ends_a_catastrophic_regex_with_why():
    from ipc.messages import FinishReason, SamplingParams
    from scheduler_proc.process import StopChecker
    from scheduler_proc.req import Req

    class Chars:  # one character per token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    req = Req("r", [1], SamplingParams(stop_regex=[r"^(a|aa)+$"]), arrival=0.0)
    req.output_ids = [ord("a")] * 60 + [ord("b")]
    start = time.monotonic()
    out = StopChecker(Chars())(req, len(req.output_ids))
    assert time.monotonic() - start < 5  # (unbounded without the limit: 2^60 ways to split)
    assert isinstance(out, FinishReason) and out.type == "abort" and "stop_regex" in out.message


# ---- fuzzing ------------------------------------------------------------------------------------

SMALL_GENERATION = {"max_tokens": 4, "max_new_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2}


def _keep_generation_small(body):
    """Fuzzed values of the generation sizes are capped so a case takes milliseconds; their
    hostile extremes are the hand-written cases above."""
    if not isinstance(body, dict):
        return body
    if "prompt" in body or "messages" in body:  # (unset, they default to 16 tokens or the whole context)
        body.setdefault("max_tokens", 4)
    elif "input" in body:  # (/v1/responses; /v1/embeddings ignores it)
        body.setdefault("max_output_tokens", 4)
    else:
        body.setdefault("sampling_params", {})
        if isinstance(body["sampling_params"], dict):
            body["sampling_params"].setdefault("max_new_tokens", 4)
    for fields in (body, body.get("sampling_params")):
        if isinstance(fields, dict):
            for key, cap in SMALL_GENERATION.items():
                if isinstance(fields.get(key), int) and not isinstance(fields[key], bool) and fields[key] > cap:
                    fields[key] = cap
    for key in ("prompt", "text", "input", "documents", "text_1", "text_2"):
        if isinstance(body.get(key), list) and len(body[key]) > 4:
            body[key] = body[key][:4]
    return body


def test_schemathesis_fuzzing_of_every_route_gives_no_server_error(server, http):
    fuzz_every_route(server, http, examples=25)


@pytest.mark.reliability
def test_long_schemathesis_fuzzing(server, http):
    fuzz_every_route(server, http, examples=int(os.environ.get("LOOM_FUZZ_EXAMPLES", "400")))


def fuzz_every_route(server, http, examples: int) -> None:
    """Cases generated from /openapi.json for every route, valid (positive) and schema-violating
    (negative), `examples` of each per route: none may be a server error, every error is JSON."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    calls: dict[str, int] = {}
    failures: list[str] = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(mode))
                def fuzz(case):
                    body = _keep_generation_small(case.body) if isinstance(case.body, dict) else case.body
                    kwargs = {} if case.method == "GET" or not isinstance(body, (dict, list, str, int, float, bool))\
                        else {"json": body}
                    r = client.request(case.method, case.formatted_path, params=case.query, **kwargs)
                    calls[operation.label] = calls.get(operation.label, 0) + 1
                    ok = r.status_code < 500 and (r.headers.get("content-type", "").startswith(
                        ("application/json", "text/event-stream", "text/plain")))
                    if r.status_code >= 400:
                        ok = ok and "error" in r.json()
                    if not ok:
                        failures.append(f"{operation.label} {json.dumps(body)[:300]} -> {r.status_code} "
                                        f"{r.text[:300]}")

                try:
                    fuzz()
                except Unsatisfiable:  # no schema-violating input exists (a route without parameters)
                    assert mode == GenerationMode.NEGATIVE, operation.label
    print(f"schemathesis: {sum(calls.values())} cases over {len(calls)} routes: {calls}")
    assert not failures, failures[:5]
    assert len(calls) >= 10
    assert_healthy(http)
    assert_idle_and_clean(http)


# ---- garbage on the ZMQ sockets -----------------------------------------------------------------

def test_garbage_zmq_frames_on_every_socket_are_dropped_and_logged(server, http):
    from ipc.messages import GenerateReq, ProcReady, SamplingParams

    directory = ipc_directory(server)
    valid = msgspec.msgpack.encode(GenerateReq("x", [1, 2, 3], SamplingParams()))
    frames = [b"\x00garbage\xff", valid[: len(valid) // 2], msgspec.msgpack.encode(ProcReady("nobody")),
              os.urandom(8 << 20)]
    # every socket a process binds (pulls from): scheduler requests and results, detokenizer,
    # tokenizer, launcher
    endpoints = [name for name in os.listdir(directory) if not name.startswith("worker_in")]
    assert {"scheduler_in-0", "scheduler_results-0", "detokenizer_in", "tokenizer_in", "launcher"} <= set(endpoints)
    ctx = zmq.Context()
    try:
        for name in endpoints:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(f"ipc://{directory}/{name}")
            if name == "scheduler_in-0":  # a wrong message type on this socket: ProcReady is not ToScheduler
                frames_here = frames
            else:  # GenerateReq is no message for the other sockets
                frames_here = [*frames, valid]
            for frame in frames_here:
                push.send(frame)
            push.send_multipart([b"two", b"frames"])
            push.close()
        # the public ZMQ frontend answers a malformed message with an error
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{server.zmq_port}")
        dealer.send(b"\x93not a client message")
        assert dealer.poll(10_000), "no answer from the ZMQ frontend"
        assert b"malformed" in dealer.recv()
        dealer.close()
    finally:
        ctx.term()
    assert_healthy(http)  # (a step runs, so the scheduler reads what waits on its results socket)
    time.sleep(0.5)
    log = server.read_output()
    for name in ("scheduler_in-0", "scheduler_results-0", "detokenizer_in", "launcher"):
        assert re.search(rf"dropped .* on ipc://\S*/{name}\b", log), f"nothing dropped on {name}"
    assert "dropped a malformed frame from the detokenizer" in log
    assert "dropped a malformed client message" in log
    assert server.proc.poll() is None
    assert_idle_and_clean(http)


# ---- overload -----------------------------------------------------------------------------------

def test_a_burst_beyond_max_queued_requests_gets_503_at_once(server):
    async def run():
        finished = []

        async def one(client, i):
            r = await client.post("/v1/completions", json={"prompt": f"Count to {i}", "max_tokens": 4,
                                                           "ignore_eos": True})
            finished.append((time.monotonic(), r.status_code))

        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300,
                                     limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(one(client, i) for i in range(70)))
        return finished

    finished = asyncio.run(run())
    refused = [t for t, code in finished if code == 503]
    served = [t for t, code in finished if code == 200]
    assert len(refused) >= 70 - 48 and len(served) + len(refused) == 70
    assert max(refused) < min(served)  # refused at once: before any admitted request finished


def test_a_client_that_never_reads_does_not_stall_the_others(server, http):
    # a stream whose events grow (cumulative logprobs) until the socket buffers are full
    body = json.dumps({"text": "Tell me everything.", "stream": True, "sampling_params": {
        "max_new_tokens": 100, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}}).encode()
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        time.sleep(1.0)
        start = time.monotonic()
        outs = [http.post("/generate", json={"text": f"Say {i}", "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}}).json() for i in range(4)]
        assert all(o["meta_info"]["completion_tokens"] == 4 for o in outs)
        assert time.monotonic() - start < 120
    finally:
        stalled.close()  # the server notices the disconnect and aborts what is left
    assert_idle_and_clean(http)


# ---- security -----------------------------------------------------------------------------------

def test_the_api_key_guards_every_route_but_health(server, http):
    paths = http.get("/openapi.json").json()["paths"]
    routes = [(method.upper(), path) for path, item in paths.items() for method in item]
    routes += [("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"), ("GET", "/no-such-route")]
    assert len(routes) >= 14
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            if path == "/health":
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert "API key" in r.json()["error"]["message"]


def test_key_comparison_is_of_fixed_length_digests():
    from tokenizer_proc import http_server

    assert http_server._key_matches("Bearer k3y", "k3y")
    assert not http_server._key_matches("Bearer k3", "k3y") and not http_server._key_matches("", "k3y")
    assert not http_server._key_matches("Bearer k3y\udcff", "k3y")  # (undecodable header bytes)
    source = Path(http_server.__file__).read_text()
    assert "hmac.compare_digest(digest(given), digest(" in source


def test_binds_only_127_0_0_1_by_default(server):
    import launch

    assert launch.ServerArgs().host == "127.0.0.1"
    listening = []
    for proc in [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]:
        listening += [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert {a.port for a in listening} >= {server.port, server.zmq_port}
    assert {a.ip for a in listening} == {"127.0.0.1"}, listening


def test_tcp_endpoints_for_several_hosts_bind_only_the_address_given():
    from ipc.sockets import Endpoints, Sender

    port = _free_port_pair()
    endpoints = Endpoints.create(("127.0.0.1", port), dp_size=1, group_size=1)
    ctx = zmq.Context()
    try:
        sender = Sender(ctx, zmq.PUSH, endpoints.worker_in_of(0, 0), bind=True)
        bound = sender.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        assert bound == endpoints.worker_in_of(0, 0) and bound.startswith("tcp://127.0.0.1:")
        listening = [c.laddr for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == int(bound.rsplit(":", 1)[1])]
        assert [a.ip for a in listening] == ["127.0.0.1"]
        sender.socket.close()
    finally:
        ctx.term()
        os.rmdir(endpoints.directory)


def _free_port_pair() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1] - 1


def test_the_ipc_folder_is_private(server):
    directory = ipc_directory(server)
    st = os.stat(directory)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()
    assert re.fullmatch(rf"loom-{server.proc.pid}-\w+", os.path.basename(directory))


def test_stale_ipc_folders_of_dead_launchers_are_swept(tmp_path):
    from ipc.sockets import sweep_stale_directories

    dead = psutil.Popen(["true"])
    dead.wait()
    stale, live, other = (tmp_path / f"loom-{dead.pid}-abc", tmp_path / f"loom-{os.getpid()}-abc",
                          tmp_path / "loom-notapid")
    for d in (stale, live, other):
        d.mkdir()
    assert sweep_stale_directories(str(tmp_path)) == [str(stale)]
    assert live.exists() and other.exists() and not stale.exists()


MESSAGE_PATHS = ["ipc", "tokenizer_proc", "scheduler_proc", "detokenizer_proc", "worker_proc/process.py", "launch.py"]
UNSAFE = re.compile(r"\b(import|from)\s+(pickle|cPickle|dill|marshal|shelve)\b|"
                    r"\b(pickle|cPickle|dill|marshal|shelve)\.\w+|\b(recv_pyobj|send_pyobj|torch\.load)\b|"
                    r"(?<![\w.])(eval|exec)\s*\(")


def test_no_pickle_or_eval_on_any_message_path():
    found = []
    for entry in MESSAGE_PATHS:
        path = ROOT / entry
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            for n, line in enumerate(file.read_text().splitlines(), 1):
                if UNSAFE.search(line.split("#", 1)[0]):
                    found.append(f"{file.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found
    for bad in ("msg = socket.recv_pyobj()", "eval (text)", "import pickle", "pickle.loads(frame)"):
        assert UNSAFE.search(bad), bad  # the pattern bites
