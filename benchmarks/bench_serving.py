"""Online serving benchmark: streams requests to a RUNNING server and measures TTFT, TPOT, ITL,
end-to-end latency and throughput (modelled on SGLang's / vLLM's bench_serving).

Backends:
  loom    the native streaming `POST /generate` (SSE, cumulative `output_ids`); prompts are sent
          as `input_ids`, so lengths are exact; greedy, EOS ignored.
  openai  `POST /v1/completions` with "stream": true, the prompt as a list of token ids,
          `max_tokens` and `ignore_eos` (a vLLM / SGLang / llama.cpp extension), so the same
          workload can be run against llama.cpp, vLLM or SGLang servers.

Datasets (prompts are token ids from the server's tokenizer):
  random        random regular-vocabulary tokens; input / output lengths uniform in
                [len * --random-range-ratio, len].
  sharegpt      --dataset-path FILE (ShareGPT JSON): the first human turn is the prompt, the
                token count of the gpt reply the output length (too short / too long are skipped).
  head-of-line  prompts cycling through lengths --prompt-repeats x --hol-short-len (default
                512,1,1,1 x 1: one 512-token prompt, then three 1-token prompts, ...), each
                generating --random-output-len tokens: how much one long prefill delays the short
                requests queued behind it (TTFT is also broken down by prompt length). The long
                prompt must fit the model's context.
  generated-shared-prefix  (SGLang's) --gsp-num-groups groups of --gsp-prompts-per-group
                requests; a group's requests share a random --gsp-system-prompt-len system prompt
                and each adds a random --gsp-question-len question, --gsp-output-len outputs; the
                groups interleaved (shuffled with --seed).
  multi-turn    a chat replay: --num-prompts conversations of --mt-turns turns, each turn a
                random --mt-user-len user message after the whole conversation so far (every
                earlier turn and the server's own replies, as token ids), --mt-output-len replies;
                a conversation's turns go one after another, the conversations at once (or
                --max-concurrency at a time). TTFT is also reported per turn. Backend loom only.

Arrivals: all at once (--request-rate inf, the default) or Poisson with that mean rate (seeded);
--max-concurrency caps the requests in flight.

    python launch.py --port 30000 &                                   # a server to measure
    python benchmarks/bench_serving.py --num-prompts 128 --random-input-len 512 --random-output-len 128
    python benchmarks/bench_serving.py --request-rate 4 --max-concurrency 16 --label "rate 4"
    python benchmarks/bench_serving.py --dataset head-of-line --prompt-repeats 512,1,1,1 \\
        --random-output-len 32 --num-prompts 128
    python benchmarks/bench_serving.py --dataset sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json
    python benchmarks/bench_serving.py --backend openai --base-url http://127.0.0.1:8080 \\
        --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct --model smollm2     # llama.cpp / vLLM / SGLang

From another script (e.g. to compare two server configurations side by side):

    from benchmarks.bench_serving import parse_args, run_benchmark
    a = run_benchmark(parse_args(["--port", "30000", "--label", "fcfs"]))
    b = run_benchmark({"port": 30010, "label": "lpm"})    # a dict overrides the CLI defaults

The report starts with the CPU, its flags and probes of its GEMM and GEMV limits
(benchmarks/probes.py), measured before any request is sent: this client runs on the server's
machine here, so they describe the server's limits too (--no-probe to skip, e.g. against a
remote server).

Everything (figures, per-request details, CPU, probes and server description, arguments) goes to
--output-file (default: benchmarks/results/bench_serving_<timestamp>.json), with a plot of the
TTFT and end-to-end latency CDFs next to it (same name, .png) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (Request, cpu_info, default_result_path, fixed_length_requests,  # noqa: E402
                               format_table, random_requests, regular_token_ids, write_json)
from benchmarks.probes import PROBE_DTYPES, describe_machine, header_lines, probe_machine  # noqa: E402

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600, sock_connect=30)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=15)


# ---- arguments --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--backend", default="loom", choices=["loom", "openai"],
                   help="loom: native streaming /generate; openai: /v1/completions (default: %(default)s)")
    s.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (default: from --host/--port)")
    s.add_argument("--host", default="127.0.0.1", help="server host (default: %(default)s)")
    s.add_argument("--port", type=int, default=30000, help="server port (default: %(default)s)")
    s.add_argument("--model", default=None,
                   help="openai: the `model` field (default: the first of GET /v1/models)")
    s.add_argument("--tokenizer", default=None,
                   help="tokenizer name or folder (default: the server's model_path from /get_server_info, "
                        "then --model)")
    s.add_argument("--extra-request-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body (sampling_params for loom)")
    s.add_argument("--prompt-as-text", action="store_true",
                   help="openai: send each prompt as its decoded text, for servers that take no token ids "
                        "(e.g. llama-cpp-python's); the server's count of prompt tokens may then differ a little")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", default="random",
                   choices=["random", "sharegpt", "head-of-line", "generated-shared-prefix", "multi-turn"],
                   help="(default: %(default)s)")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    d.add_argument("--num-prompts", type=int, default=128, help="requests (default: %(default)s)")
    d.add_argument("--random-input-len", type=int, default=512,
                   help="random: longest prompt, tokens (default: %(default)s)")
    d.add_argument("--random-output-len", type=int, default=128,
                   help="random: longest output; head-of-line: every output, tokens (default: %(default)s)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len * ratio, len] (default: %(default)s)")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: use this output length instead of the reply's")
    d.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="sharegpt: skip prompt + output longer than this (default: the server's context "
                        "length, else 2048; prompts over 1024 tokens are skipped too)")
    d.add_argument("--prompt-repeats", default="512,1,1,1",
                   help="head-of-line: the cycle of prompt lengths, in multiples of --hol-short-len "
                        "(default: %(default)s)")
    d.add_argument("--hol-short-len", type=int, default=1,
                   help="head-of-line: the short prompt's length, tokens (default: %(default)s)")
    d.add_argument("--gsp-num-groups", type=int, default=8, help="generated-shared-prefix (default: %(default)s)")
    d.add_argument("--gsp-prompts-per-group", type=int, default=8, help="(default: %(default)s)")
    d.add_argument("--gsp-system-prompt-len", type=int, default=1000, help="tokens (default: %(default)s)")
    d.add_argument("--gsp-question-len", type=int, default=32, help="tokens (default: %(default)s)")
    d.add_argument("--gsp-output-len", type=int, default=64, help="tokens (default: %(default)s)")
    d.add_argument("--mt-turns", type=int, default=4, help="multi-turn: turns per conversation (default: %(default)s)")
    d.add_argument("--mt-user-len", type=int, default=64, help="tokens per user message (default: %(default)s)")
    d.add_argument("--mt-output-len", type=int, default=64, help="tokens per reply (default: %(default)s)")
    d.add_argument("--seed", type=int, default=1, help="seed for prompts, lengths and arrivals (default: %(default)s)")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests/s of Poisson arrivals; inf sends all at once (default: %(default)s)")
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    t.add_argument("--warmup-requests", type=int, default=1,
                   help="short requests sent (and checked) before timing starts (default: %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--output-file", type=Path, default=None,
                   help="result JSON (default: benchmarks/results/bench_serving_<timestamp>.json)")
    o.add_argument("--no-output-file", action="store_true", help="do not write a result file")
    o.add_argument("--label", default="", help="free text stored in the result file")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    o.add_argument("--no-probe", action="store_true",
                   help="skip the CPU probes (they measure this machine: the server's only when it runs here)")
    o.add_argument("--no-kernel-probe", action="store_true",
                   help="probe GEMV with torch only, not loom's kernel (which may compile the first time)")
    o.add_argument("--no-plot", action="store_true", help="no latency CDF plot next to the result file")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _as_namespace(args: argparse.Namespace | Mapping[str, Any]) -> argparse.Namespace:
    """A Namespace as is; a mapping (keys as attribute names) on top of the CLI defaults."""
    if isinstance(args, argparse.Namespace):
        return args
    ns = parse_args([])
    unknown = set(args) - set(vars(ns))
    if unknown:
        raise ValueError(f"unknown benchmark options: {sorted(unknown)}")
    for k, v in args.items():
        setattr(ns, k, v)
    return ns


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


# ---- server -----------------------------------------------------------------------------------

async def _get_json(session: aiohttp.ClientSession, url: str) -> Any | None:
    try:
        async with session.get(url, timeout=INFO_TIMEOUT) as r:
            if r.status != 200:
                return None
            return await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def fetch_server_info(url: str) -> dict[str, Any] | None:
    """GET /get_server_info (loom, SGLang); None where the server has no such route."""
    async with aiohttp.ClientSession() as session:
        info = await _get_json(session, f"{url}/get_server_info")
    return info if isinstance(info, dict) else None


async def fetch_model_name(url: str) -> str | None:
    """The first model id of GET /v1/models (OpenAI-compatible servers)."""
    async with aiohttp.ClientSession() as session:
        models = await _get_json(session, f"{url}/v1/models")
    try:
        return str(models["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        return None


def load_tokenizer(args: argparse.Namespace, server_info: dict[str, Any] | None) -> tuple[Any, str]:
    from transformers import AutoTokenizer

    candidates = [args.tokenizer] if args.tokenizer else [
        (server_info or {}).get("tokenizer_path"), (server_info or {}).get("model_path"), args.model]
    candidates = [c for c in candidates if c]
    if not candidates:
        raise SystemExit(f"no tokenizer: pass --tokenizer (no model_path from {base_url(args)}/get_server_info)")
    errors = []
    for path in candidates:
        try:
            return AutoTokenizer.from_pretrained(path), str(path)
        except Exception as e:  # try the next candidate; report all if none loads
            errors.append(f"{path}: {type(e).__name__}: {e}")
    raise SystemExit("could not load a tokenizer:\n  " + "\n  ".join(errors))


# ---- datasets ---------------------------------------------------------------------------------

def parse_repeats(text: str) -> list[int]:
    try:
        repeats = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-repeats wants comma-separated integers, got {text!r}") from None
    if not repeats or any(r < 1 for r in repeats):
        raise SystemExit(f"--prompt-repeats wants positive integers, got {text!r}")
    return repeats


def sharegpt_requests(tokenizer: Any, path: str, num_prompts: int, seed: int, fixed_output_len: int | None,
                      context_len: int) -> list[Request]:
    """SGLang's / vLLM's ShareGPT sampling: shuffled conversations, prompt = first human turn,
    output length = the gpt reply's token count; skip prompts or outputs under 2 tokens, prompts
    over 1024 tokens and prompt + output over context_len."""
    data = json.loads(Path(path).read_text())
    pairs = []
    for entry in data:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            pairs.append((conv[0]["value"], conv[1]["value"]))
    random.Random(seed).shuffle(pairs)

    requests: list[Request] = []
    for prompt, completion in pairs:
        if len(requests) == num_prompts:
            break
        ids = tokenizer.encode(prompt)
        out_len = fixed_output_len if fixed_output_len is not None else len(tokenizer.encode(completion,
                                                                                          add_special_tokens=False))
        if len(ids) < 2 or out_len < 2:
            continue
        if len(ids) > 1024 or len(ids) + out_len > context_len:
            continue
        requests.append(Request(ids, out_len))
    if len(requests) < num_prompts:
        print(f"WARNING: {path} gave only {len(requests)} usable conversations of {num_prompts} asked",
              file=sys.stderr)
    return requests


def shared_prefix_requests(tokenizer: Any, groups: int, per_group: int, system_len: int, question_len: int,
                           output_len: int, seed: int) -> list[Request]:
    """SGLang's generated-shared-prefix workload: per group one random system prompt, per request
    one random question after it; the groups interleaved (a seeded shuffle)."""
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    systems = [rng.choice(vocab, size=system_len).tolist() for _ in range(groups)]
    requests = [Request(systems[g] + rng.choice(vocab, size=question_len).tolist(), output_len)
                for g in range(groups) for _ in range(per_group)]
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


@dataclass
class Conversation:
    """A multi-turn replay: the user messages (token ids); each turn's prompt is the whole
    conversation so far, the server's replies included."""

    user_turns: list[list[int]]
    output_len: int


def multi_turn_conversations(tokenizer: Any, num: int, turns: int, user_len: int, output_len: int,
                             seed: int) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    return [Conversation([rng.choice(vocab, size=user_len).tolist() for _ in range(turns)], output_len)
            for _ in range(num)]


def build_requests(args: argparse.Namespace, tokenizer: Any, context_len: int | None) -> list[Request]:
    """The workload's requests (for multi-turn: every conversation's first turn)."""
    n = args.num_prompts
    if args.dataset == "generated-shared-prefix":
        return shared_prefix_requests(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                      args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                      args.seed)
    if args.dataset == "multi-turn":
        return [Request(c.user_turns[0], c.output_len) for c in multi_turn_conversations(
            tokenizer, n, args.mt_turns, args.mt_user_len, args.mt_output_len, args.seed)]
    if args.dataset == "random":
        def span(length: int) -> tuple[int, int]:
            return max(1, int(length * args.random_range_ratio)), length
        return random_requests(tokenizer, n, span(args.random_input_len), span(args.random_output_len), args.seed)
    if args.dataset == "head-of-line":
        cycle = [r * args.hol_short_len for r in parse_repeats(args.prompt_repeats)]
        input_lens = [cycle[i % len(cycle)] for i in range(n)]
        return fixed_length_requests(tokenizer, input_lens, [args.random_output_len] * n, args.seed)
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path")
    return sharegpt_requests(tokenizer, args.dataset_path, n, args.seed, args.sharegpt_output_len,
                             args.sharegpt_context_len or context_len or 2048)


# ---- one request ------------------------------------------------------------------------------

@dataclass
class RequestResult:
    input_len: int
    expected_output_len: int
    success: bool = False
    output_len: int = 0
    ttft: float | None = None  # seconds to the first token
    latency: float | None = None  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between tokens
    start: float = 0.0  # when it was sent, seconds after the benchmark started
    error: str | None = None
    turn: int | None = None  # multi-turn: which turn of its conversation
    output_ids: list[int] = field(default_factory=list)  # loom backend: the reply's token ids


async def sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, payload) of each `data:` line. Reads raw chunks: the lines of cumulative
    streams grow past aiohttp's readline limit."""
    buf = bytearray()
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        while (nl := buf.find(b"\n")) >= 0:
            line = bytes(buf[:nl]).rstrip(b"\r")
            del buf[:nl + 1]
            if line.startswith(b"data:"):
                yield now, line[5:].strip().decode()
    if buf.strip().startswith(b"data:"):
        yield time.perf_counter(), bytes(buf).strip()[5:].strip().decode()


class _Timing:
    """TTFT and ITLs from (time, tokens so far) observations; a gap that brings k new tokens
    counts as k ITLs of gap / k each (SGLang's convention for chunked streams)."""

    def __init__(self, result: RequestResult, sent: float):
        self.result, self.sent, self.last_time, self.tokens = result, sent, sent, 0

    def observe(self, now: float, tokens: int) -> None:
        new = tokens - self.tokens
        if new <= 0:
            return
        if self.result.ttft is None:
            self.result.ttft = now - self.sent
        else:
            self.result.itl.extend([(now - self.last_time) / new] * new)
        self.last_time, self.tokens = now, tokens


def _error_text(payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err if err is not None else payload)


async def request_loom(session: aiohttp.ClientSession, url: str, req: Request, extra: dict[str, Any],
                       result: RequestResult) -> None:
    extra = dict(extra)
    sampling = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
                **extra.pop("sampling_params", {})}
    body = {"input_ids": req.input_ids, "sampling_params": sampling, "stream": True, **extra}
    sent = time.perf_counter()
    timing = _Timing(result, sent)
    done, finish = False, None
    async with session.post(f"{url}/generate", json=body) as r:
        if r.status != 200:
            result.error = f"HTTP {r.status}: {(await r.text())[:500]}"
            return
        async for now, data in sse_data(r):
            if data == "[DONE]":
                done = True
                break
            out = json.loads(data)
            if "error" in out:
                result.error = _error_text(out)
                return
            meta = out.get("meta_info") or {}
            result.output_ids = out.get("output_ids") or result.output_ids
            timing.observe(now, len(out.get("output_ids") or []) or int(meta.get("completion_tokens") or 0))
            finish = meta.get("finish_reason") or finish
    result.latency = time.perf_counter() - sent
    result.output_len = timing.tokens
    if isinstance(finish, dict) and finish.get("type") == "abort":
        result.error = f"aborted: {finish.get('message') or finish}"
    elif not done:
        result.error = "the stream ended without [DONE]"
    elif timing.tokens == 0:
        result.error = "no tokens generated"
    else:
        result.success = True


async def request_openai(session: aiohttp.ClientSession, url: str, req: Request, extra: dict[str, Any],
                         result: RequestResult, model: str | None) -> None:
    body: dict[str, Any] = {"prompt": req.text if req.text is not None else req.input_ids, "max_tokens": req.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                            **({"model": model} if model else {}), **extra}
    sent = time.perf_counter()
    timing = _Timing(result, sent)
    chunks, usage_tokens = 0, None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            result.error = f"HTTP {r.status}: {(await r.text())[:500]}"
            return
        async for now, data in sse_data(r):
            if data == "[DONE]":
                break
            out = json.loads(data)
            if "error" in out:
                result.error = _error_text(out)
                return
            if isinstance(out.get("usage"), dict) and out["usage"].get("completion_tokens") is not None:
                usage_tokens = int(out["usage"]["completion_tokens"])
            for choice in out.get("choices") or []:
                # One chunk per token (vLLM, SGLang, llama.cpp); a closing chunk with no text and a
                # finish_reason (llama.cpp) carries no token.
                if choice.get("text") or choice.get("finish_reason") is None:
                    chunks += 1
                    timing.observe(now, chunks)
    result.latency = time.perf_counter() - sent
    result.output_len = usage_tokens if usage_tokens is not None else chunks
    if result.output_len == 0:
        result.error = "no tokens generated"
    else:
        result.success = True


RequestFn = Callable[[aiohttp.ClientSession, Request, RequestResult], Awaitable[None]]


def make_request_fn(args: argparse.Namespace, url: str, model: str | None) -> RequestFn:
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if not isinstance(extra, dict):
        raise SystemExit("--extra-request-body must be a JSON object")

    async def call(session: aiohttp.ClientSession, req: Request, result: RequestResult) -> None:
        try:
            if args.backend == "loom":
                await request_loom(session, url, req, extra, result)
            else:
                await request_openai(session, url, req, extra, result, model)
        except Exception as e:  # a failed request is a figure, not the end of the benchmark
            result.error = f"{type(e).__name__}: {e}" if str(e) else "".join(traceback.format_exception_only(e))
            result.success = False
    return call


# ---- traffic ----------------------------------------------------------------------------------

def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start): all 0 for an infinite rate, else a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise SystemExit("--request-rate must be positive (or inf)")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def run_requests(call: RequestFn, requests: list[Request], args: argparse.Namespace,
                       ) -> tuple[list[RequestResult], float]:
    results = [RequestResult(r.input_len, r.output_len) for r in requests]
    offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc="requests", unit="req")

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=HTTP_TIMEOUT) as session:
        start = time.perf_counter()

        async def one(i: int) -> None:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is not None:
                await semaphore.acquire()
            try:
                results[i].start = time.perf_counter() - start
                await call(session, requests[i], results[i])
            finally:
                if semaphore is not None:
                    semaphore.release()
                if bar is not None:
                    bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, duration


async def run_conversations(call: RequestFn, conversations: list[Conversation], args: argparse.Namespace,
                            ) -> tuple[list[RequestResult], float]:
    """The multi-turn replay: each conversation's turns in order, every prompt the conversation so
    far (its earlier prompts and the replies the server gave)."""
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=HTTP_TIMEOUT) as session:
        start = time.perf_counter()

        async def converse(conv: Conversation) -> None:
            if semaphore is not None:
                await semaphore.acquire()
            try:
                history: list[int] = []
                for turn, user in enumerate(conv.user_turns):
                    req = Request(history + user, conv.output_len)
                    result = RequestResult(req.input_len, req.output_len, turn=turn)
                    results.append(result)
                    result.start = time.perf_counter() - start
                    await call(session, req, result)
                    if not result.success:
                        return
                    history = req.input_ids + result.output_ids
            finally:
                if semaphore is not None:
                    semaphore.release()

        await asyncio.gather(*(converse(c) for c in conversations))
        duration = time.perf_counter() - start
    return results, duration


def ttft_by_turn(results: list[RequestResult]) -> list[dict[str, Any]]:
    turns = sorted({r.turn for r in results if r.turn is not None})
    return [{"turn": t, "completed": sum(r.turn == t and r.success for r in results),
             "ttft_ms": stats_ms([r.ttft for r in results if r.turn == t and r.ttft is not None])} for t in turns]


async def warm_up(call: RequestFn, requests: list[Request], count: int) -> None:
    """A few short requests first; the first failure stops the benchmark with the server's answer."""
    if count <= 0 or not requests:
        return
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        for i in range(count):
            req = requests[i % len(requests)]
            req = replace(req, output_len=min(req.output_len, 8))
            result = RequestResult(req.input_len, req.output_len)
            await call(session, req, result)
            if not result.success:
                raise SystemExit(f"warm-up request failed: {result.error}")


# ---- figures ----------------------------------------------------------------------------------

def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    """mean / median / std / p95 / p99 in milliseconds (None when there are no values)."""
    if not values:
        return {"mean": None, "median": None, "std": None, "p95": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std()),
            "p95": float(np.percentile(arr, 95)), "p99": float(np.percentile(arr, 99))}


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok
             if r.output_len > 1 and r.latency is not None and r.ttft is not None]
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_output_tokens_expected": sum(r.expected_output_len for r in ok),
        "output_len_mismatches": sum(r.output_len != r.expected_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in ok if r.latency is not None) / duration,
    }
    for name, values in (("ttft", [r.ttft for r in ok if r.ttft is not None]), ("tpot", tpots),
                         ("itl", [x for r in ok for x in r.itl]),
                         ("e2e_latency", [r.latency for r in ok if r.latency is not None])):
        for stat, value in stats_ms(values).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def by_input_len(results: list[RequestResult]) -> list[dict[str, Any]]:
    """TTFT / E2E per distinct prompt length (head-of-line: long vs short prompts)."""
    rows = []
    for n in sorted({r.input_len for r in results}, reverse=True):
        group = [r for r in results if r.input_len == n and r.success]
        ttft = stats_ms([r.ttft for r in group if r.ttft is not None])
        e2e = stats_ms([r.latency for r in group if r.latency is not None])
        rows.append({"input_len": n, "completed": len(group),
                     "failed": sum(r.input_len == n and not r.success for r in results),
                     "ttft_ms": ttft, "e2e_latency_ms": e2e})
    return rows


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def format_report(result: dict[str, Any]) -> str:
    m = result

    def row(label: str, value: Any, digits: int = 2) -> str:
        return f"{label:<40} {_fmt(value, digits):>12}"

    lines = [
        "{s:{c}^54}".format(s=" Serving Benchmark Result ", c="="),
        row("Backend:", m["backend"]),
        row("Dataset:", m["dataset"]),
        row("Traffic request rate:", m["request_rate"]),
        row("Max request concurrency:", m["max_concurrency"] if m["max_concurrency"] else "not set"),
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Benchmark duration (s):", m["duration_s"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Input token throughput (tok/s):", m["input_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_throughput"]),
        row("Concurrency:", m["concurrency"]),
    ]
    for title, key, name in (("Time to First Token", "ttft", "TTFT"),
                             ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                             ("Inter-Token Latency", "itl", "ITL"),
                             ("End-to-End Latency", "e2e_latency", "E2E Latency")):
        lines.append("{s:{c}^54}".format(s=f" {title} ", c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p95", "P95"), ("p99", "P99")):
            lines.append(row(f"{label} {name} (ms):", m[f"{stat}_{key}_ms"]))
    lines.append("=" * 54)
    return "\n".join(lines)


def format_by_input_len(rows: list[dict[str, Any]]) -> str:
    table = [[r["input_len"], r["completed"], _fmt(r["ttft_ms"]["mean"]), _fmt(r["ttft_ms"]["median"]),
              _fmt(r["ttft_ms"]["p99"]), _fmt(r["e2e_latency_ms"]["mean"]), _fmt(r["e2e_latency_ms"]["p99"])]
             for r in rows]
    return format_table(["input len", "ok", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "E2E mean ms",
                         "E2E p99 ms"], table)


def _server_lines(info: dict[str, Any] | None) -> list[str]:
    if not info:
        return ["server     (no /get_server_info)"]
    keys = ("model_path", "dtype", "dtype_reason", "device", "threads", "kernel_isa", "quantization", "max_total_tokens",
            "max_context_len", "kv_slots", "max_running_requests", "max_prefill_tokens", "schedule_policy")
    items = [f"{k}={info[k]}" for k in keys if info.get(k) is not None]
    return [f"server     {', '.join(items[:4])}", f"           {', '.join(items[4:])}"] if len(items) > 4 \
        else [f"server     {', '.join(items)}"]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# ---- entry points -----------------------------------------------------------------------------

async def async_run_benchmark(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    args = _as_namespace(args)
    url = base_url(args)
    cpu = cpu_info()
    server_info = await fetch_server_info(url)
    model = args.model
    if args.backend == "openai" and model is None:
        model = await fetch_model_name(url) or (server_info or {}).get("model_path")
    tokenizer, tokenizer_name = load_tokenizer(args, server_info)
    context_len = (server_info or {}).get("max_context_len") or (server_info or {}).get("context_length")

    info_no_stats = {k: v for k, v in (server_info or {}).items() if k != "stats"} or None
    # The server is idle until the warm-up below, so the probes have the cores to themselves.
    machine = describe_machine() if args.no_probe else probe_machine(PROBE_DTYPES, kernel=not args.no_kernel_probe)
    server_dtype = (server_info or {}).get("dtype")
    sides = {"server": f"{server_dtype}  ({(server_info or {}).get('dtype_reason', '')})"} if server_dtype else {}
    print("\n".join(header_lines(machine, sides, [
        f"client     CPU, torch and probes above: this client's machine; "
        f"server worker threads: {(server_info or {}).get('threads', '?')}",
        *_server_lines(server_info),
        f"target     {args.backend} at {url}" + (f", model {model}" if args.backend == "openai" else ""),
        f"tokenizer  {tokenizer_name}",
    ])), flush=True)

    requests = build_requests(args, tokenizer, context_len)
    if args.prompt_as_text:
        requests = [replace(r, text=tokenizer.decode(r.input_ids)) for r in requests]
    if not requests:
        raise SystemExit("no requests to send")
    if context_len:
        over = [r for r in requests if r.input_len + r.output_len > context_len]
        if over and args.dataset != "sharegpt":
            worst = max(over, key=lambda r: r.input_len + r.output_len)
            hint = ("--prompt-repeats / --hol-short-len" if args.dataset == "head-of-line"
                    else "--random-input-len / --random-output-len")
            raise SystemExit(f"{len(over)} requests need more than the server's context length {context_len} "
                             f"(e.g. {worst.input_len} prompt + {worst.output_len} output tokens); "
                             f"lower {hint}")
    in_lens = [r.input_len for r in requests]
    out_lens = [r.output_len for r in requests]
    print(f"workload: {args.dataset}, {len(requests)} requests, seed {args.seed}, "
          f"{sum(in_lens)} input tokens ({min(in_lens)}-{max(in_lens)}), "
          f"{sum(out_lens)} output tokens ({min(out_lens)}-{max(out_lens)}), "
          f"rate {_fmt(args.request_rate)}, max concurrency {args.max_concurrency or 'not set'}", flush=True)

    call = make_request_fn(args, url, model)
    await warm_up(call, requests, args.warmup_requests)
    if args.dataset == "multi-turn":
        if args.backend != "loom":
            raise SystemExit("--dataset multi-turn replays token ids: use --backend loom")
        conversations = multi_turn_conversations(tokenizer, args.num_prompts, args.mt_turns, args.mt_user_len,
                                                 args.mt_output_len, args.seed)
        results, duration = await run_conversations(call, conversations, args)
    else:
        results, duration = await run_requests(call, requests, args)

    metrics = compute_metrics(results, duration)
    result: dict[str, Any] = {
        "benchmark": "bench_serving",
        "label": args.label,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "backend": args.backend,
        "base_url": url,
        "model": model,
        "tokenizer": tokenizer_name,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        **metrics,
        "by_input_len": by_input_len(results),
        "ttft_by_turn": ttft_by_turn(results),
        "cpu": cpu,
        "machine": machine,
        "client": {"python": sys.version.split()[0], "aiohttp": aiohttp.__version__, "torch": _version("torch")},
        "server_info": info_no_stats,
        "server_stats_before": (server_info or {}).get("stats"),
        "server_stats_after": ((await fetch_server_info(url)) or {}).get("stats"),
        "args": {k: (str(v) if isinstance(v, Path) or (isinstance(v, float) and math.isinf(v)) else v)
                 for k, v in vars(args).items()},
        "requests": {
            "input_lens": [r.input_len for r in results],
            "expected_output_lens": [r.expected_output_len for r in results],
            "output_lens": [r.output_len for r in results],
            "start_s": [r.start for r in results],
            "ttfts_s": [r.ttft for r in results],
            "e2e_latencies_s": [r.latency for r in results],
            "itls_s": [r.itl for r in results],
            "errors": [r.error for r in results],
        },
    }

    print(format_report({**result, "request_rate": args.request_rate}))
    if args.dataset == "head-of-line":
        print("by prompt length:")
        print(format_by_input_len(result["by_input_len"]))
    if result["ttft_by_turn"]:
        print("TTFT by turn: " + ", ".join(f"turn {t['turn'] + 1} p50 {_fmt(t['ttft_ms']['median'])} ms"
                                           for t in result["ttft_by_turn"]))
    errors = [r.error for r in results if r.error]
    if errors:
        print(f"WARNING: {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    if metrics["output_len_mismatches"]:
        print(f"WARNING: {metrics['output_len_mismatches']} requests did not generate their output length",
              file=sys.stderr)
    if not args.no_output_file:
        path = write_json(args.output_file or default_result_path("bench_serving"), result)
        result["output_file"] = str(path)
        print(f"results: {path}")
        if not args.no_plot:
            from benchmarks.plots import plot_latency_cdf

            title = f"{args.backend} {args.dataset}, {len(requests)} requests, rate {_fmt(args.request_rate)}"
            plot_latency_cdf(result["requests"]["ttfts_s"], result["requests"]["e2e_latencies_s"],
                             path.with_suffix(".png"), f"{title} {args.label}".strip())
    return result


def run_benchmark(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """Run one benchmark against a running server; returns the result dict (also written to
    --output-file unless no_output_file). Call async_run_benchmark from inside an event loop."""
    return asyncio.run(async_run_benchmark(args))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
