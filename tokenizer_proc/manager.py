"""TokenizerManager: the front door inside the main process. Tokenizes, validates, sends
requests to the scheduler, and turns the detokenizer's text deltas back into per-request
results and streams. Runs on one asyncio loop (the HTTP server's, or the Engine's thread)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import msgspec
import numpy as np
import regex
import zmq
import zmq.asyncio

from ipc.messages import (AbortReq, BatchTextOut, FinishReason, FlushCacheReq, FlushCacheResp, GenerateReq,
                          GenerateReqs, SamplingParams, StatsReq, StatsResp, ToTokenizer)
from ipc.sockets import Endpoints
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_body import invalid_text_path

log = logging.getLogger("loom.tokenizer")


class RequestError(ValueError):
    """A request a user got wrong: reported as HTTP 400 with this message."""


class UnavailableError(RuntimeError):
    """The server cannot take the request now (going down, or full): HTTP 503 at once."""


class QueueFullError(UnavailableError):
    """Too many requests in flight (`--max-queued-requests`): HTTP 503 at once."""


@dataclass(slots=True)
class ReqState:
    rid: str
    prompt_tokens: int
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    retractions: int = 0
    cached_tokens: int = 0  # prompt tokens shared from another request's prefill
    logprobs: list = field(default_factory=list)  # TokenLogprobs per output id, when asked
    prompt_ids: list[int] | None = None  # with prompt_logprobs
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs per prompt token after the first
    no_output: bool = False  # max_new_tokens 0 with prompt logprobs, or an embedding: the prompt runs, its one token is dropped
    embedding: bytes = b""  # float32, where sampling.embedding asked
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_at: float | None = None
    last_token_at: float | None = None


SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)

# Bounds on what one request may ask for: each is far above real use, and each keeps the work a
# request can cause per step (stop matching, logit bias rows) or in total small.
MAX_STOPS = 32  # stop strings, and separately stop regexes
MAX_STOP_CHARS = 256  # characters of one stop string or regex
MAX_STOP_TOKEN_IDS = 1024
MAX_GRAMMAR_AFTER = 16  # tokens of the tag a grammar starts after
MAX_LOGIT_BIAS = 1024  # entries
MAX_TOP_LOGPROBS = 20
MAX_ID_CHARS = 256  # a request id or routing key
INT64 = (-(2**63), 2**63 - 1)


def parse_sampling_params(raw: dict | SamplingParams | None) -> SamplingParams:
    """Build and validate sampling parameters; null fields take their defaults."""
    if isinstance(raw, SamplingParams):
        sp = raw
    else:
        if raw is not None and not isinstance(raw, dict):
            raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        unknown = set(raw) - SAMPLING_FIELDS
        if unknown:
            raise RequestError(f"sampling_params: unknown field(s) {sorted(unknown)}")
        for name in ("stop", "stop_regex"):
            if isinstance(raw.get(name), str):
                raw[name] = [raw[name]]
        if isinstance(raw.get("json_schema"), (dict, bool)):  # (the schema itself rather than its JSON text)
            raw["json_schema"] = json.dumps(raw["json_schema"])
        try:
            sp = msgspec.convert(raw, SamplingParams, strict=False)
        except msgspec.ValidationError as e:
            raise RequestError(f"sampling_params: {e}") from None
    # (the scheduler's messages carry 64-bit integers: a larger one would fail there, not here)
    for name in ("max_new_tokens", "min_new_tokens", "top_k", "seed", "top_logprobs", "stream_interval",
                 "prompt_logprobs"):
        value = getattr(sp, name)
        if value is not None and not INT64[0] <= value <= INT64[1]:
            raise RequestError(f"sampling_params: {name} must be a 64-bit integer, got {str(value)[:40]}")
    for name, ids in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", sp.logit_bias),
                      ("grammar_after", sp.grammar_after)):
        if not all(INT64[0] <= i <= INT64[1] for i in ids):
            raise RequestError(f"sampling_params: {name} takes 64-bit token ids")
    floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
    for name in floats:
        if not math.isfinite(getattr(sp, name)):
            raise RequestError(f"sampling_params: {name} must be a finite number, got {getattr(sp, name)}")
    checks = [
        (sp.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
        (sp.min_new_tokens >= 0, "min_new_tokens must be >= 0"),
        (sp.temperature >= 0, "temperature must be >= 0"),
        (0 < sp.top_p <= 1, "top_p must be in (0, 1]"),
        (sp.top_k == -1 or sp.top_k >= 1, "top_k must be -1 (off) or >= 1"),
        (0 <= sp.min_p <= 1, "min_p must be in [0, 1]"),
        (sp.repetition_penalty > 0, "repetition_penalty must be > 0"),
        (-2 <= sp.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
        (-2 <= sp.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
        (all(-100 <= b <= 100 for b in sp.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
        (len(sp.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries"),
        (all(isinstance(s, str) and s for s in sp.stop), "stop must be non-empty strings"),
        (len(sp.stop) <= MAX_STOPS, f"stop takes at most {MAX_STOPS} strings, got {len(sp.stop)}"),
        (all(len(s) <= MAX_STOP_CHARS for s in sp.stop), f"stop strings are at most {MAX_STOP_CHARS} characters"),
        (len(sp.stop_regex) <= MAX_STOPS, f"stop_regex takes at most {MAX_STOPS} patterns, got {len(sp.stop_regex)}"),
        (all(len(s) <= MAX_STOP_CHARS for s in sp.stop_regex),
         f"stop_regex patterns are at most {MAX_STOP_CHARS} characters"),
        (len(sp.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids"),
        (len(sp.grammar_after) <= MAX_GRAMMAR_AFTER, f"grammar_after takes at most {MAX_GRAMMAR_AFTER} ids"),
        (0 <= sp.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
        (sp.prompt_logprobs is None or 0 <= sp.prompt_logprobs <= MAX_TOP_LOGPROBS,
         f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
        (sp.stream_interval is None or sp.stream_interval >= 1, "stream_interval must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise RequestError(f"sampling_params: {message}")
    bad_text = invalid_text_path({"stop": sp.stop, "stop_regex": sp.stop_regex, "json_schema": sp.json_schema,
                                  "regex": sp.regex, "ebnf": sp.ebnf, "choice": sp.choice})  # (the Engine's requests skip HTTP's check)
    if bad_text is not None:
        raise RequestError(f"sampling_params: '{bad_text}' is not valid Unicode text (a lone surrogate)")
    for pattern in sp.stop_regex:
        try:
            regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as e:
            raise RequestError(f"sampling_params: stop_regex {pattern[:80]!r} is not a valid regular expression: "
                               f"{e}") from None
    if sp.has_grammar:
        from worker_proc.grammar import check_grammar

        problem = check_grammar(sp)
        if problem is not None:
            raise RequestError(f"sampling_params: {problem}")
    return sp


def combine_rank_stats(ranks: list[dict]) -> dict:
    """One view of the data-parallel ranks' stats: counts summed, the cache hit rate recomputed
    from the summed counts, other rates averaged; each rank's own under "dp_ranks"."""
    if len(ranks) == 1:
        return {**ranks[0], "dp_ranks": ranks}
    total: dict = {}
    for key in ranks[0]:
        values = [r[key] for r in ranks]
        total[key] = sum(values) / len(values) if isinstance(values[0], float) else sum(values)
    prompt = total["num_prompt_tokens"]
    total["cache_hit_rate"] = total["num_cached_prompt_tokens"] / prompt if prompt else 0.0
    total["step"] = max(r["step"] for r in ranks)
    total.pop("dp_rank")
    return {**total, "dp_ranks": ranks}


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("sending requests to the scheduler failed: %s", fut.exception())


class TokenizerManager:
    def __init__(self, endpoints: Endpoints, tokenizer: Any, context_len: int, max_queued: int | None = None,
                 dp_size: int = 1, diffusion: bool = False, model_vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.diffusion = diffusion  # a block-diffusion model (--dllm-algorithm): no per-token logprobs
        # ids the model can embed: a tokenizer may know more tokens than the model's embedding has rows
        self.vocab_size = min(len(tokenizer), model_vocab_size or len(tokenizer))
        self.context_len = context_len
        # no token is longer than the longest vocabulary entry (byte-level: a character per byte),
        # so a longer text cannot fit the context and is refused before it is tokenized
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
        self.max_prompt_chars = context_len * max(map(len, vocab)) if vocab else None
        self.max_queued = max_queued
        self.dp_size = dp_size
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)  # the scheduler, or the DP controller before the schedulers
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(endpoints.requests_in(dp_size))
        self.from_detokenizer = self.ctx.socket(zmq.PULL)
        self.from_detokenizer.setsockopt(zmq.LINGER, 0)
        self.from_detokenizer.bind(endpoints.tokenizer_in)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ToTokenizer)
        self.states: dict[str, ReqState] = {}
        self.metrics = Metrics()
        self.query_waiters: dict[str, tuple[asyncio.Future, list]] = {}  # query id -> (done, each rank's answer)
        self.dead: str | None = None  # set when the server is going down: new requests fail fast
        self._unsent: list[GenerateReq] = []  # requests made in this event-loop turn, sent together
        self._recv_task: asyncio.Task | None = None

    def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task:
            self._recv_task.cancel()
        self.to_scheduler.close()
        self.from_detokenizer.close()
        self.ctx.term()

    def fail_all(self, message: str) -> None:
        """The engine died: end every pending request with an error instead of hanging."""
        self.dead = message
        for state in self.states.values():
            if state.finish is None:
                state.finish = FinishReason("abort", message=message)
                state.event.set()

    def drain(self, grace_s: float) -> None:
        """Graceful shutdown: new requests are refused now; those in flight get grace_s seconds to
        finish, then end with an error (their streams get a last event)."""
        self.dead = self.dead or "the server is shutting down"
        asyncio.get_running_loop().call_later(grace_s, self.fail_all, self.dead)

    # ---- requests ----------------------------------------------------------------------

    def tokenize(self, text: str | None, input_ids: list[int] | None, field: str = "text") -> list[int]:
        """The prompt's token ids; `field` names the text's field in errors ("prompt", "messages")."""
        if input_ids is not None:
            if text is not None:
                raise RequestError("give either text or input_ids, not both")
            if not isinstance(input_ids, list):
                raise RequestError(f"input_ids must be a list of integers, got {type(input_ids).__name__}")
            if len(input_ids) >= self.context_len:
                raise RequestError(f"input_ids: the prompt has {len(input_ids)} tokens; the context length is "
                                   f"{self.context_len}")
            if not all(type(t) is int and 0 <= t < self.vocab_size for t in input_ids):
                raise RequestError(f"input_ids must be integers in 0..{self.vocab_size - 1}")
            return list(input_ids)
        if not isinstance(text, str):
            raise RequestError("text (a string) or input_ids (a list of integers) is required")
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise RequestError(f"{field}: {len(text)} characters cannot fit the context of {self.context_len} tokens")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=True) if text else []
        except (TypeError, ValueError) as e:  # e.g. a lone surrogate: not valid Unicode
            raise RequestError(f"{field} is not valid text ({type(e).__name__}: {str(e)[:100]})") from None
        return self.check_vocabulary(ids, field)

    def check_vocabulary(self, ids: list[int], field: str) -> list[int]:
        """Text whose tokens the model cannot embed (a tokenizer larger than the model) is refused."""
        if ids and max(ids) >= self.vocab_size:
            raise RequestError(f"{field}: the text has token {max(ids)}, beyond the model's vocabulary of "
                               f"{self.vocab_size} tokens")
        return ids

    def check_request(self, sampling: SamplingParams | dict | None, rid: str | None = None, priority: int = 0,
                      routing_key: str | None = None, routed_dp_rank: int | None = None) -> SamplingParams:
        """Everything about a request but its prompt, checked before anything starts: the
        sampling parameters (returned parsed) and the routing fields; RequestError names the
        field, UnavailableError when the server is going down."""
        if self.dead:
            raise UnavailableError(self.dead)
        if routed_dp_rank is not None and (isinstance(routed_dp_rank, bool) or not isinstance(routed_dp_rank, int)
                                           or not 0 <= routed_dp_rank < self.dp_size):
            raise RequestError(f"routed_dp_rank must be an integer in 0..{self.dp_size - 1} (this server has "
                               f"--dp-size {self.dp_size}), got {routed_dp_rank!r}")
        priority = priority or 0
        if type(priority) is not int or not INT64[0] <= priority <= INT64[1]:
            raise RequestError(f"priority must be a 64-bit integer, got {str(priority)[:40]}")
        for name, value in (("rid", rid), ("routing_key", routing_key)):
            if value is not None and (not isinstance(value, str) or len(value) > MAX_ID_CHARS
                                      or invalid_text_path(value) is not None):
                raise RequestError(f"{name} must be a string of at most {MAX_ID_CHARS} characters (valid Unicode)")
        sp = parse_sampling_params(sampling)
        bad = [t for t in [*sp.logit_bias, *sp.stop_token_ids, *sp.grammar_after] if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"sampling_params: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.diffusion and (sp.logprobs or sp.top_logprobs or sp.prompt_logprobs is not None):
            raise RequestError("sampling_params.logprobs: not available with --dllm-algorithm (a diffusion model "
                               "fills a block's positions over several rounds)")
        if self.diffusion and sp.embedding:
            raise RequestError("sampling_params.embedding: not available with --dllm-algorithm (a diffusion model's "
                               "steps return filled blocks, not hidden states)")
        if self.diffusion and sp.has_grammar:
            raise RequestError("sampling_params: structured output (json_schema, regex, ebnf, choice) is not "
                               "available with --dllm-algorithm (a diffusion model fills a block's positions at once)")
        if sp.max_new_tokens > self.context_len:  # more than any prompt leaves room for (less is cut at the context)
            raise RequestError(f"sampling_params: max_new_tokens={sp.max_new_tokens} exceeds the context length "
                               f"{self.context_len}")
        return sp

    async def generate(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        sampling: SamplingParams | dict | None = None,
        rid: str | None = None,
        stream: bool = False,
        priority: int = 0,
        routing_key: str | None = None,
        prefill_group: str | None = None,
        routed_dp_rank: int | None = None,
    ) -> AsyncIterator[dict]:
        """Yields result dicts: once at the end, or after every delta when streaming (text and
        output_ids cumulative). A consumer that stops early aborts the request. Requests with the
        same `prefill_group` and prompt share one prefill (the n choices of a prompt).
        `routed_dp_rank` pins the data-parallel rank that serves it."""
        sp = self.check_request(sampling, rid=rid, priority=priority, routing_key=routing_key,
                                routed_dp_rank=routed_dp_rank)
        ids = self.tokenize(text, input_ids)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.context_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context length is {self.context_len}")
        self.ensure_capacity(1)
        rid = rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError(f"request id {rid!r} is already in use")
        state = ReqState(rid, len(ids), time.perf_counter())
        if sp.prompt_logprobs is not None:
            state.prompt_ids = ids
            if sp.max_new_tokens == 0:  # (the prompt's logits are computed by a step that samples)
                state.no_output, sp = True, msgspec.structs.replace(sp, max_new_tokens=1, min_new_tokens=0)
        if sp.embedding:  # (a prompt-only request: the step that would sample its first token has the state)
            state.no_output, sp = True, msgspec.structs.replace(sp, max_new_tokens=1, min_new_tokens=0,
                                                                temperature=0.0, ignore_eos=True)
        if sp.max_new_tokens == 0:
            state.finish = FinishReason("length")
            yield self._result(state)
            return
        self.states[rid] = state
        try:
            self._send_soon(GenerateReq(rid, ids, sp, priority or 0, routing_key, prefill_group, routed_dp_rank))
            while True:
                await state.event.wait()
                state.event.clear()
                if state.finish is not None:
                    yield self._result(state)
                    return
                if stream:
                    yield self._result(state)
        finally:
            if self.states.pop(rid, None) is not None and state.finish is None and not self.dead:
                # the consumer went away before the end: free the request's KV now
                await self.abort(rid, "client disconnected")

    async def generate_final(self, **kwargs) -> dict:
        """`generate` without streaming: the final result dict."""
        last = None
        async for last in self.generate(**kwargs):
            pass
        return last

    def ensure_capacity(self, n: int) -> None:
        """Refuse at once (before any stream starts) when n more requests would pass the limit."""
        if self.max_queued is not None and len(self.states) + n > self.max_queued:
            raise QueueFullError(f"the server holds {len(self.states)} requests and its limit is {self.max_queued} "
                                 "(--max-queued-requests); retry later")

    def _send_soon(self, req: GenerateReq) -> None:
        """Queue a request for the scheduler; every request made in this event-loop turn goes in
        one frame, so the scheduler sees the n choices of a prompt together and none of them
        starts its own prefill before the others arrive."""
        self._unsent.append(req)
        if len(self._unsent) == 1:
            asyncio.get_running_loop().call_soon(self._flush_unsent)

    def _flush_unsent(self) -> None:
        reqs, self._unsent = self._unsent, []
        if not reqs or self.to_scheduler.closed:
            return
        try:
            frame = self.encoder.encode(reqs[0] if len(reqs) == 1 else GenerateReqs(reqs))
        except Exception:  # (checked requests encode: this is a safety net) one bad request must not sink the frame
            sendable = []
            for req in reqs:
                try:
                    self.encoder.encode(req)
                    sendable.append(req)
                except Exception as e:
                    log.error("request %s could not be encoded for the scheduler: %s", req.rid, e)
                    state = self.states.get(req.rid)
                    if state is not None and state.finish is None:
                        state.finish = FinishReason("abort", message=f"the request could not be sent to the "
                                                    f"scheduler ({type(e).__name__}: {str(e)[:100]})")
                        state.event.set()
            if not sendable:
                return
            frame = self.encoder.encode(sendable[0] if len(sendable) == 1 else GenerateReqs(sendable))
        self.to_scheduler.send(frame).add_done_callback(_log_send_error)

    async def abort(self, rid: str, message: str = "aborted by client") -> None:
        self._flush_unsent()  # the abort must not overtake the request it aborts
        await self.to_scheduler.send(self.encoder.encode(AbortReq(rid, message)))

    async def _ask(self, make_query, timeout: float = 10.0) -> list:
        """Sends a query to every scheduler (the DP controller fans it out) and returns each
        data-parallel rank's answer."""
        query_id = uuid.uuid4().hex
        answers: list = []
        fut = asyncio.get_running_loop().create_future()
        self.query_waiters[query_id] = (fut, answers)
        try:
            await self.to_scheduler.send(self.encoder.encode(make_query(query_id)))
            await asyncio.wait_for(fut, timeout)
        finally:
            self.query_waiters.pop(query_id, None)
        return answers

    async def get_stats(self) -> dict:
        """The schedulers' counters: summed over the data-parallel ranks, each rank's own under
        "dp_ranks"."""
        answers = [dict(a.stats) for a in await self._ask(StatsReq)]
        stats = combine_rank_stats(sorted(answers, key=lambda a: a["dp_rank"]))
        stats["num_tokenizer_requests"] = len(self.states)
        return stats

    async def flush_cache(self) -> str | None:
        """Empties every rank's prefix cache; the reason if a rank refused (requests running)."""
        refused = [a.refused for a in await self._ask(FlushCacheReq) if a.refused]
        return "; ".join(refused) or None

    def _result(self, state: ReqState) -> dict:
        now = time.perf_counter()
        finish = state.finish.to_dict() if state.finish is not None else None
        return {
            "text": state.text,
            "output_ids": list(state.output_ids),
            **({"embedding": np.frombuffer(state.embedding, dtype=np.float32).tolist()} if state.embedding else {}),
            "meta_info": {
                "id": state.rid,
                "prompt_tokens": state.prompt_tokens,
                "completion_tokens": len(state.output_ids),
                "finish_reason": finish,
                "retractions": state.retractions,
                "cached_tokens": state.cached_tokens,
                "e2e_latency": now - state.created,
                "ttft": (state.first_token_at - state.created) if state.first_token_at else None,
                # as SGLang: (logprob, token id) per output token, and the top alternatives
                "output_token_logprobs": [(lp.logprob, tid) for lp, tid in zip(state.logprobs, state.output_ids)],
                "output_top_logprobs": [[(v, t) for t, v in lp.top] for lp in state.logprobs],
                # with prompt_logprobs: the same per prompt token (the first has none: None)
                **({"input_token_logprobs": [(None, state.prompt_ids[0])] + [
                        (lp.logprob, tid) for lp, tid in zip(state.prompt_logprobs, state.prompt_ids[1:])],
                    "input_top_logprobs": [None] + [[(v, t) for t, v in lp.top] for lp in state.prompt_logprobs]}
                   if state.prompt_ids is not None else {}),
            },
        }

    # ---- outputs -----------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            frame = await self.from_detokenizer.recv(copy=False)
            try:
                msg = self.decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:
                log.error("dropped a malformed frame from the detokenizer: %s", e)
                continue
            if isinstance(msg, (StatsResp, FlushCacheResp)):
                fut, answers = self.query_waiters.get(msg.query_id, (None, []))
                answers.append(msg)
                if fut is not None and not fut.done() and len(answers) == self.dp_size:
                    fut.set_result(None)
                continue
            assert isinstance(msg, BatchTextOut)
            now = time.perf_counter()
            for d in msg.items:
                state = self.states.get(d.rid)
                if state is None:
                    continue  # its consumer left already
                self.metrics.on_tokens(now, state.created, state.first_token_at, state.last_token_at,
                                       len(d.new_ids))
                if d.new_ids:
                    state.first_token_at = state.first_token_at or now
                    state.last_token_at = now
                if d.prompt_logprobs:
                    state.prompt_logprobs = d.prompt_logprobs
                if d.embedding:
                    state.embedding = d.embedding
                if not state.no_output:
                    state.text += d.text
                    state.output_ids.extend(d.new_ids)
                    state.logprobs.extend(d.logprobs)
                state.retractions = d.retractions
                state.cached_tokens = d.cached_tokens
                if d.finish is not None:
                    state.finish = FinishReason("length") if state.no_output else d.finish
                    self.metrics.on_finish(now, state.created, state.prompt_tokens, d.finish.type, d.cached_tokens)
                state.event.set()
