"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models,
/v1/responses (responses_api.py, over the chat route), and vLLM's /tokenize, /detokenize, /score
and /rerank (embedding similarity).

Requests are read leniently, as the OpenAI spec allows (null for any optional field, chat content
as a string or a list of parts) plus the extras vLLM / SGLang clients send (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, regex stops);
fields with no effect here (user, routing fields) are ignored. A wrong value is a 400 that names
the field. Chat requests with `tools` get function calling (tool_calls.py): the tools in the prompt,
the calls parsed out of the reply (tool_choice auto), or a reply started as a call and held to its
grammar (required, or a named function). Structured output (response_format and the extras) goes
to the worker as a grammar in the sampling parameters (worker_proc/grammar.py). With
--reasoning-parser, a reasoning model's thinking comes back as `reasoning_content` beside the
answer (reasoning.py), and `chat_template_kwargs` reach the template (Qwen3's enable_thinking)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from typing import Any, AsyncIterator

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ipc.messages import STRUCTURED_OUTPUT_FIELDS, SamplingParams
from tokenizer_proc.api_schema import (CHAT_COMPLETION, COMPLETION, DETOKENIZE, EMBEDDING, RERANK, RESPONSE, SCORE,
                                       TOKENIZE, request_body)
from tokenizer_proc.manager import RequestError, TokenizerManager, UnavailableError
from tokenizer_proc.request_body import BodyError, read_json_object
from tokenizer_proc.reasoning import REASONING_FORMATS, ReasoningFormat, ReasoningStream
from tokenizer_proc.tool_calls import (TOOL_CALL_FORMATS, ToolCallFormat, ToolCallStream, format_for_template,
                                       json_object, renders_tools, template_messages)

MAX_CHOICES = 4096  # prompts x n in one request
STREAM_BUFFER = 64  # chunks a stream holds for a client that reads slowly; its producers then wait
_JSON = msgspec.json.Encoder()  # (a stream's chunks: several times faster than json.dumps)


def sse_data(obj: Any) -> bytes:
    """One server-sent event carrying obj as JSON."""
    return b"data: " + _JSON.encode(obj) + b"\n\n"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status)


def _field(body: dict, name: str, kinds: type | tuple, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kinds is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and kinds in (int, float, (int, float))):
        want = getattr(kinds, "__name__", None) or " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {want}, got {json.dumps(value)[:60]}", name)
    return value


def _sampling_param(message: str) -> str | None:
    """The OpenAI field a sampling check's message ("sampling_params: top_p must be ...") names."""
    if not message.startswith("sampling_params: "):
        return None
    name = message.removeprefix("sampling_params: ").split(" ", 1)[0]
    if name not in SamplingParams.__struct_fields__:
        return None
    return {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(name, name)


def _sampling(body: dict, max_tokens_names: tuple[str, ...]) -> dict:
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _field(body, name, int, max_tokens)
    stop = _field(body, "stop", (str, list), [])
    if isinstance(stop, str):
        stop = [stop]
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    logit_bias = _field(body, "logit_bias", dict, {})
    try:
        logit_bias = {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError):
        raise ApiError(400, "'logit_bias' maps token ids to numbers", "logit_bias") from None
    sampling = {
        "max_new_tokens": max_tokens,
        "temperature": _field(body, "temperature", float),
        "top_p": _field(body, "top_p", float),
        "top_k": _field(body, "top_k", int),
        "min_p": _field(body, "min_p", float),
        "seed": _field(body, "seed", int),
        "stop": stop,
        "stop_regex": _field(body, "stop_regex", (str, list)),
        "stop_token_ids": _field(body, "stop_token_ids", list),
        "ignore_eos": _field(body, "ignore_eos", bool),
        "skip_special_tokens": _field(body, "skip_special_tokens", bool),
        "min_new_tokens": _field(body, "min_tokens", int),
        "presence_penalty": _field(body, "presence_penalty", float),
        "frequency_penalty": _field(body, "frequency_penalty", float),
        "repetition_penalty": _field(body, "repetition_penalty", float),
        "logit_bias": logit_bias,
        "stream_interval": _field(body, "stream_interval", int),
        **_structured_output(body),
    }
    return {k: v for k, v in sampling.items() if v is not None}


def _structured_output(body: dict) -> dict:
    """The sampling fields of the structured output a request asks for: OpenAI's response_format,
    or the extras vLLM clients send (guided_json, guided_regex, guided_choice, guided_grammar,
    structured_outputs) and SGLang's (json_schema, regex, ebnf); checked here, so that an error
    names the field the request used."""
    asked: dict[str, dict] = {}  # the request's field -> sampling fields
    fmt = _field(body, "response_format", dict)
    if fmt is not None and fmt.get("type") not in (None, "text"):
        spec = fmt.get("json_schema")
        if fmt["type"] == "json_object" or (fmt["type"] == "json_schema" and isinstance(spec, dict)
                                            and spec.get("schema") is None):
            asked["response_format"] = {"json_object": True}
        elif fmt["type"] == "json_schema" and isinstance(spec, dict) and isinstance(spec["schema"], (dict, bool)):
            asked["response_format"] = {"json_schema": json.dumps(spec["schema"])}
        else:
            raise ApiError(400, "'response_format' must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                                "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}", "response_format")
    extras = body.get("structured_outputs")
    if extras is not None and not isinstance(extras, dict):
        raise ApiError(400, "'structured_outputs' must be an object (json, regex, choice, grammar or json_object)",
                       "structured_outputs")
    sources = [(name, field, body.get(name)) for name, field in (
        ("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
        ("guided_grammar", "ebnf"), ("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "ebnf"))]
    sources += [(f"structured_outputs.{key}", field, (extras or {}).get(key)) for key, field in (
        ("json", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "ebnf"),
        ("json_object", "json_object"))]
    for name, field, value in sources:
        if value is None or value is False:
            continue
        if field == "json_schema" and isinstance(value, (dict, bool)):
            value = json.dumps(value)
        kinds = {"choice": list, "json_object": bool}.get(field, str)
        if not isinstance(value, kinds) or (field == "choice" and not all(isinstance(c, str) for c in value)):
            want = {"choice": "a list of strings", "json_object": "a boolean"}.get(field, "a string")
            raise ApiError(400, f"'{name}' must be {want}", name)
        asked[name] = {field: value}
    if not asked:
        return {}
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(asked)}: a request takes one kind of structured output", next(iter(asked)))
    from worker_proc.grammar import check_grammar

    [(name, fields)] = asked.items()
    problem = check_grammar(SamplingParams(**fields))
    if problem is not None:
        raise ApiError(400, f"'{name}': {problem}", name)
    return fields


class OpenAIServing:
    def __init__(self, manager: TokenizerManager, model_name: str, context_len: int, tool_call_parser: str = "auto",
                 reasoning_parser: str | None = None, sampling_defaults: dict | None = None):
        self.manager = manager
        self.model_name = model_name
        self.context_len = context_len
        self.created = int(time.time())
        self.tool_call_parser = tool_call_parser
        self._tool_format: ToolCallFormat | None = None
        self.reasoning = REASONING_FORMATS.make(reasoning_parser) if reasoning_parser else None
        # the model's generation_config.json sampling (--generation-config auto): what a request leaves unset
        self.sampling_defaults = dict(sampling_defaults or {})
        # the end tag's tokens, after which the answer's grammar starts
        self.reasoning_end_ids = manager.tokenizer.encode(self.reasoning.end, add_special_tokens=False) \
            if self.reasoning else []

    @property
    def tool_format(self) -> ToolCallFormat:
        """--tool-call-parser's format (auto: the one the chat template teaches)."""
        if self._tool_format is None:
            name = self.tool_call_parser
            if name == "auto":
                name = format_for_template(getattr(self.manager.tokenizer, "chat_template", None))
            self._tool_format = TOOL_CALL_FORMATS.make(name)
        return self._tool_format

    def check_model(self, body: dict) -> str:
        model = _field(body, "model", str, self.model_name)
        if model != self.model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found")
        return model

    def check_common(self, body: dict) -> tuple[int, bool, bool]:
        n = _field(body, "n", int, 1)
        if n < 1 or n > 64:
            raise ApiError(400, f"'n' must be between 1 and 64, got {n}", "n")
        best_of = _field(body, "best_of", int)
        if best_of is not None and best_of != n:
            raise ApiError(400, "'best_of' other than n is not supported", "best_of")
        stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, {})
        include_usage = bool(options.get("include_usage")) if stream else False
        return n, stream, include_usage

    def check_length(self, prompt_len: int, sampling: dict) -> None:
        max_new = sampling.get("max_new_tokens")
        if max_new is not None and prompt_len + max_new > self.context_len:
            raise ApiError(400, f"This model's maximum context length is {self.context_len} tokens. However, you "
                                f"requested {prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} for "
                                f"the completion). Please reduce the prompt or max_tokens.", "max_tokens")
        if max_new is None:  # as vLLM: the rest of the context
            sampling["max_new_tokens"] = self.context_len - prompt_len

    # ---- completions --------------------------------------------------------------------

    async def completions(self, body: dict):
        model = self.check_model(body)
        n, stream, include_usage = self.check_common(body)
        routed = _field(body, "routed_dp_rank", int)  # (an SGLang extra: the data-parallel rank to use)
        sampling = {**self.sampling_defaults, **_sampling(body, ("max_tokens",))}
        sampling.setdefault("max_new_tokens", 16)  # the OpenAI default for completions
        echo = _field(body, "echo", bool, False)
        top = _field(body, "logprobs", int)
        if top is not None:
            if not 0 <= top <= 20:
                raise ApiError(400, "'logprobs' must be between 0 and 20", "logprobs")
            sampling.update(logprobs=True, top_logprobs=top)
            if echo:  # the prompt's tokens get theirs too (lm-eval's loglikelihood requests)
                if stream:
                    raise ApiError(400, "echo with logprobs is answered whole: not with stream", "stream")
                sampling["prompt_logprobs"] = top
        prompt_top = _prompt_logprobs_field(body, stream)
        if prompt_top is not None:
            sampling["prompt_logprobs"] = max(prompt_top, sampling.get("prompt_logprobs", 0))
        if body.get("suffix") is not None:
            raise ApiError(400, "'suffix' is not supported", "suffix")
        prompts = self._prompts(body.get("prompt"))
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={n} choices: at most {MAX_CHOICES} in one request",
                           "prompt")
        try:
            encoded = [self.manager.tokenize(p, None, "prompt") if isinstance(p, str)
                       else self.manager.tokenize(None, p, "prompt") for p in prompts]
        except RequestError as e:
            raise ApiError(400, f"prompt: {e}", "prompt") from None
        for ids in encoded:
            if not ids:
                raise ApiError(400, "the prompt is empty", "prompt")
            self.check_length(len(ids), dict(sampling))
        texts = [p if isinstance(p, str) else self.manager.tokenizer.decode(p) for p in prompts] if echo else []
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = [(i * n + k, ids, self._choice_sampling(sampling, k), self._prefill_group(rid, i, n))
                for i, ids in enumerate(encoded) for k in range(n)]
        self.manager.ensure_capacity(len(jobs))
        if stream:
            return self._stream(rid, "text_completion", model, jobs, sum(map(len, encoded)), include_usage, routed,
                                lambda idx, delta, finish, lps: {"index": idx, "text": delta,
                                                                 "logprobs": self._completion_logprobs(lps),
                                                                 "finish_reason": finish},
                                prefix={idx: texts[idx // n] for idx, *_ in jobs} if echo else None)
        outs = await self._run_all(jobs, routed)
        choices = [{"index": idx, "text": (texts[idx // n] if echo else "") + out["text"],
                    "logprobs": self._completion_logprobs(
                        None if top is None else (_prompt_token_logprobs(out, top) if echo else []) + _token_logprobs(out)),
                    "finish_reason": _finish(out),
                    **({"prompt_logprobs": self._vllm_prompt_logprobs(out, prompt_top)} if prompt_top is not None else {})}
                   for idx, out in outs]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": self._usage(sum(map(len, encoded)), self._by_prompt(jobs, outs))}

    @staticmethod
    def _prompts(prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return list(prompt)
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [prompt]
            if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
                return list(prompt)
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                            "of token ids", "prompt")

    # ---- chat ---------------------------------------------------------------------------

    async def chat(self, body: dict):
        model = self.check_model(body)
        n, stream, include_usage = self.check_common(body)
        routed = _field(body, "routed_dp_rank", int)  # (an SGLang extra: the data-parallel rank to use)
        sampling = {**self.sampling_defaults, **_sampling(body, ("max_tokens", "max_completion_tokens"))}
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, 0)
        if not 0 <= top <= 20:
            raise ApiError(400, "'top_logprobs' must be between 0 and 20", "top_logprobs")
        if top and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if want:
            sampling.update(logprobs=True, top_logprobs=top)
        prompt_top = _prompt_logprobs_field(body, stream)
        if prompt_top is not None:
            sampling["prompt_logprobs"] = prompt_top
        prompt, calls, thinking = self._chat_prompt(body, sampling)
        reasoning = (self.reasoning, thinking, _field(body, "include_reasoning", bool, True)) \
            if self.reasoning and _field(body, "separate_reasoning", bool, True) else None
        ids = self.manager.check_vocabulary(self.manager.tokenizer.encode(prompt, add_special_tokens=False), "messages")
        if len(ids) >= self.context_len:
            raise ApiError(400, f"messages: the prompt has {len(ids)} tokens; the context length is "
                                f"{self.context_len}", "messages")
        self.check_length(len(ids), sampling)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = [(k, ids, self._choice_sampling(sampling, k), self._prefill_group(rid, 0, n)) for k in range(n)]
        self.manager.ensure_capacity(len(jobs))
        if stream:
            return self._stream(rid, "chat.completion.chunk", model, jobs, len(ids), include_usage, routed,
                                lambda idx, delta, finish, lps: {"index": idx, "delta": delta,
                                                                 "logprobs": self._chat_logprobs(lps),
                                                                 "finish_reason": finish},
                                chat=True, calls=calls, reasoning=reasoning)
        outs = await self._run_all(jobs, routed)
        choices = [{"index": idx, **_chat_reply(out, calls, reasoning),
                    "logprobs": self._chat_logprobs(_token_logprobs(out) if want else None)} for idx, out in outs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": self._usage(len(ids), self._by_prompt(jobs, outs), reasoning),
                **({"prompt_logprobs": self._vllm_prompt_logprobs(outs[0][1], prompt_top)}
                   if prompt_top is not None else {})}

    def _chat_prompt(self, body: dict, sampling: dict | None) -> tuple[str, tuple | None, bool]:
        """The chat request's prompt text; (format, forced reply start, parallel, function names)
        where tool calls are to be parsed out of the reply (None: not); and whether the reply
        starts inside a reasoning model's thinking. A reply that must be a call gets the call's
        grammar in `sampling` (unless the request asks for another); a grammar after thinking
        starts at its end."""
        tools = _tools(body)
        tool_choice = _tool_choice(body, tools)
        parallel = _field(body, "parallel_tool_calls", bool, True)
        messages = _field(body, "messages", list)
        if not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        conversation = [_chat_message(m, i) for i, m in enumerate(messages)]
        chars = sum(len(m["content"]) for m in conversation) + len(json.dumps(tools or []))
        if self.manager.max_prompt_chars is not None and chars > self.manager.max_prompt_chars:
            raise ApiError(400, f"messages: {chars} characters cannot fit the context of {self.context_len} tokens",
                           "messages")
        fmt = self.tool_format
        template = getattr(self.manager.tokenizer, "chat_template", None)
        with_tools = renders_tools(template)
        extra = _template_kwargs(body)
        # (vLLM's extra: the reply continues the last message, an assistant's start of it)
        continued = _field(body, "continue_final_message", bool, False)
        add_prompt = _field(body, "add_generation_prompt", bool, not continued)
        if continued and (add_prompt or conversation[-1]["role"] != "assistant"):
            raise ApiError(400, "'continue_final_message' continues a last assistant message, without "
                                "add_generation_prompt", "continue_final_message")
        try:
            prompt = self.manager.tokenizer.apply_chat_template(
                template_messages(conversation, tools, fmt, with_tools), tokenize=False,
                add_generation_prompt=add_prompt, continue_final_message=continued,
                **({"tools": tools} if tools and with_tools else {}), **extra)
        except Exception as e:  # a template that rejects the roles or order
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
        # the reply's start when a call is required: of the function named (or the one tool), or
        # the model names it
        names = frozenset(t["function"]["name"] for t in tools or [])
        several = tool_choice == "required" and parallel  # (calls after the first: a named function's is one)
        if tool_choice == "required" and len(names) == 1:
            tool_choice = next(iter(names))
        forced = fmt.forced_prefix(None if tool_choice == "required" else tool_choice) \
            if tools and tool_choice not in ("auto", "none") else ""
        prompt += forced
        if forced and sampling is not None and not any(name in sampling for name in STRUCTURED_OUTPUT_FIELDS):
            grammar = fmt.call_grammar(tools, None if tool_choice == "required" else tool_choice, several)
            if grammar is not None:
                sampling["ebnf"] = grammar
        calls = (fmt, forced, parallel, names) if tools and tool_choice != "none" else None
        thinking = self.reasoning is not None and not forced and self.reasoning.thinking_at_start(prompt)
        if thinking and sampling is not None and any(name in sampling for name in STRUCTURED_OUTPUT_FIELDS):
            sampling["grammar_after"] = self.reasoning_end_ids
        return prompt, calls, thinking

    # ---- embeddings -----------------------------------------------------------------------

    async def embeddings(self, body: dict) -> dict:
        """OpenAI's /v1/embeddings: each input's embedding, the model's final hidden state (after
        its last norm) at the input's last token, L2-normalized (as decoder embedding models such
        as Qwen3-Embedding are used); `dimensions` keeps the first ones (Matryoshka), then
        normalizes; `encoding_format` float or base64 (little-endian float32, which the OpenAI
        client asks for by default)."""
        model = self.check_model(body)
        inputs = _embedding_inputs(body.get("input"), "input")
        encoding = _field(body, "encoding_format", str, "float")
        if encoding not in ("float", "base64"):
            raise ApiError(400, f"'encoding_format' must be float or base64, got '{encoding}'", "encoding_format")
        dimensions = _field(body, "dimensions", int)
        if dimensions is not None and dimensions < 1:
            raise ApiError(400, "'dimensions' must be at least 1", "dimensions")
        normalize = _field(body, "normalize", bool, True)  # (vLLM's extra)
        vectors, tokens = await self._embed(inputs, "input", body)
        if dimensions is not None:
            if dimensions > vectors.shape[1]:
                raise ApiError(400, f"'dimensions' is at most {vectors.shape[1]} for this model", "dimensions")
            vectors = vectors[:, :dimensions]
        if normalize:
            vectors = unit_vectors(vectors)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(self, body: dict) -> dict:
        """vLLM's /score for an embedding model: the cosine similarity of text_1 with each text_2
        (one text_1 against a list, or two lists pair by pair)."""
        model = self.check_model(body)
        first = _embedding_inputs(body.get("text_1"), "text_1")
        second = _embedding_inputs(body.get("text_2"), "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise ApiError(400, f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: give one text_1, or "
                                "as many as text_2", "text_1")
        vectors, tokens = await self._embed(first + second, "text_1", body)
        a, b = unit_vectors(vectors[:len(first)]), unit_vectors(vectors[len(first):])
        scores = (a * b).sum(axis=1) if len(first) > 1 else b @ a[0]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, body: dict) -> dict:
        """The rerank API (Jina's and Cohere's shape, as vLLM serves it) for an embedding model: the
        documents by their cosine similarity to the query, most relevant first, top_n of them."""
        model = self.check_model(body)
        query = _field(body, "query", str)
        if not query:
            raise ApiError(400, "'query' must be a non-empty string", "query")
        documents = _field(body, "documents", list)
        if not documents or not all(isinstance(d, str) or (isinstance(d, dict) and isinstance(d.get("text"), str))
                                    for d in documents):
            raise ApiError(400, "'documents' must be a non-empty list of strings (or {'text': ...} objects)",
                           "documents")
        texts = [d if isinstance(d, str) else d["text"] for d in documents]
        top_n = _field(body, "top_n", int, len(texts))
        if top_n < 1:
            raise ApiError(400, "'top_n' must be at least 1", "top_n")
        vectors, tokens = await self._embed([query] + texts, "documents", body)
        unit = unit_vectors(vectors)
        scores = unit[1:] @ unit[0]
        order = np.argsort(-scores, kind="stable")[:top_n]
        keep = _field(body, "return_documents", bool, True)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
                "results": [{"index": int(i), "relevance_score": float(scores[i]),
                             **({"document": {"text": texts[i]}} if keep else {})} for i in order]}

    async def _embed(self, inputs: list[str | list[int]], field: str, body: dict) -> tuple[np.ndarray, int]:
        """The inputs' embeddings ([n, hidden] float32, not normalized) and their token count;
        vLLM's truncate_prompt_tokens keeps each input's last k tokens."""
        if len(inputs) > MAX_CHOICES:
            raise ApiError(400, f"{len(inputs)} inputs: at most {MAX_CHOICES} in one request", field)
        keep = _field(body, "truncate_prompt_tokens", int)
        if keep is not None and keep < 1:
            raise ApiError(400, "'truncate_prompt_tokens' must be at least 1", "truncate_prompt_tokens")
        try:
            encoded = [self.manager.tokenize(p, None, field) if isinstance(p, str)
                       else self.manager.tokenize(None, p, field) for p in inputs]
        except RequestError as e:
            raise ApiError(400, f"{field}: {e}", field) from None
        encoded = [ids[-keep:] if keep else ids for ids in encoded]
        for ids in encoded:
            if not ids:
                raise ApiError(400, f"{field}: a text is empty", field)
            if len(ids) >= self.context_len:
                raise ApiError(400, f"{field}: a text has {len(ids)} tokens; the context length is "
                                    f"{self.context_len}", field)
        self.manager.ensure_capacity(len(encoded))
        outs = await asyncio.gather(*(self.manager.generate_final(input_ids=ids, sampling={"embedding": True})
                                      for ids in encoded))
        return np.asarray([out["embedding"] for out in outs], dtype=np.float32), sum(map(len, encoded))

    # ---- tokenize / detokenize -----------------------------------------------------------

    async def tokenize(self, body: dict) -> dict:
        """Token ids of a prompt, or of chat messages as the chat route renders them (vLLM's
        /tokenize: count, max_model_len, tokens, and token_strs where asked)."""
        self.check_model(body)
        special = _field(body, "add_special_tokens", bool)
        if body.get("messages") is not None:
            prompt, _, _ = self._chat_prompt(body, None)  # (no call grammar: nothing is generated)
            ids = self.manager.tokenizer.encode(prompt, add_special_tokens=bool(special))
        else:
            prompt = _field(body, "prompt", str)
            if prompt is None:
                raise ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt")
            try:
                ids = (self.manager.tokenize(prompt, None, "prompt") if special in (None, True)
                       else self.manager.tokenizer.encode(prompt, add_special_tokens=False))
            except RequestError as e:
                raise ApiError(400, str(e), "prompt") from None
        out = {"count": len(ids), "max_model_len": self.context_len, "tokens": ids}
        if _field(body, "return_token_strs", bool, False):
            out["token_strs"] = self.manager.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, body: dict) -> dict:
        """The text of token ids (vLLM's /detokenize answers `prompt`, SGLang's `text`: both)."""
        self.check_model(body)
        tokens = _field(body, "tokens", list)
        vocab = self.manager.vocab_size
        if tokens is None or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise ApiError(400, f"'tokens' must be a list of token ids in 0..{vocab - 1}", "tokens")
        text = self.manager.tokenizer.decode(tokens, skip_special_tokens=_field(body, "skip_special_tokens", bool,
                                                                                False))
        return {"prompt": text, "text": text}

    # ---- logprobs -----------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.manager.tokenizer.decode([token_id])

    def _completion_logprobs(self, lps: list | None) -> dict | None:
        if lps is None:
            return None
        tokens = [self._token_text(t) for t, _, _ in lps]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in lps],
                "top_logprobs": [None if top is None else {self._token_text(t): v for t, v in top} for _, _, top in lps],
                "text_offset": offsets}

    def _vllm_prompt_logprobs(self, out: dict, top: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob,
        rank, decoded_token}} for the token and the `top` most likely ones."""
        entries: list[dict | None] = []
        for tid, lp, alternatives in _prompt_token_logprobs(out, top):
            if lp is None:
                entries.append(None)
                continue
            ranked = {str(t): {"logprob": v, "rank": k + 1, "decoded_token": self._token_text(t)}
                      for k, (t, v) in enumerate(alternatives)}
            own = ranked.get(str(tid)) or {"logprob": lp, "decoded_token": self._token_text(tid)}
            entries.append({str(tid): own, **ranked})
        return entries

    def _chat_logprobs(self, lps: list | None) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]} for t, lp, top in lps]}

    # ---- shared -------------------------------------------------------------------------

    @staticmethod
    def _choice_sampling(sampling: dict, k: int) -> dict:
        # n choices of one seeded request must differ from each other yet be reproducible
        if k and sampling.get("seed") is not None:
            return {**sampling, "seed": sampling["seed"] + k}
        return sampling

    @staticmethod
    def _prefill_group(rid: str, prompt_index: int, n: int) -> str | None:
        # the n choices of one prompt share its prefill
        return f"{rid}-{prompt_index}" if n > 1 else None

    async def _run_all(self, jobs, routed_dp_rank: int | None) -> list[tuple[int, dict]]:
        async def one(idx, ids, sampling, group):
            return idx, await self.manager.generate_final(input_ids=ids, sampling=sampling, prefill_group=group,
                                                          routed_dp_rank=routed_dp_rank)

        return list(await asyncio.gather(*(one(*job) for job in jobs)))

    def _usage(self, prompt_tokens: int, outs: list[tuple[object, dict]], reasoning: tuple | None = None) -> dict:
        """Prompt tokens count once per prompt (not per choice), as OpenAI reports them, and so do
        cached tokens: a prompt's are those its first computation took from a cache (the fewest
        of its choices), never more than the prompt. `outs`: (prompt key, result) per choice.
        With a reasoning parser, the replies' thinking tokens (through the end tag) too."""
        completion = sum(o["meta_info"]["completion_tokens"] for _, o in outs)
        fewest: dict[object, int] = {}
        for key, o in outs:
            fewest[key] = min(fewest.get(key, o["meta_info"]["cached_tokens"]), o["meta_info"]["cached_tokens"])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(fewest.values())}}
        if reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self._reasoning_tokens(o, reasoning)
                                                                          for _, o in outs)}
        return usage

    def _reasoning_tokens(self, out: dict, reasoning: tuple) -> int:
        """A reply's thinking tokens: through the first run of the end tag's tokens (all of them
        where it never ends); 0 where the reply does not think."""
        from worker_proc.grammar import end_of_run

        fmt, thinking, _ = reasoning
        if fmt.split(out["text"], thinking)[0] is None:
            return 0
        end = end_of_run(out["output_ids"], self.reasoning_end_ids)
        return len(out["output_ids"]) if end is None else end

    @staticmethod
    def _by_prompt(jobs, outs: list[tuple[int, dict]]) -> list[tuple[object, dict]]:
        group_of = {idx: group if group is not None else idx for idx, _, _, group in jobs}
        return [(group_of[idx], o) for idx, o in outs]

    def _stream(self, rid, obj, model, jobs, prompt_tokens, include_usage, routed_dp_rank, make_choice, prefix=None,
                chat=False, calls=None, reasoning=None):
        """SSE chunks of every choice as they come, then a usage chunk if asked, then [DONE].
        Validation happens here, before the stream starts, so errors in it are the engine's.
        calls: (format, forced prefix, parallel, function names) where tool calls are parsed out of the
        chat reply; reasoning: (format, starts thinking, include it) where the thinking is split out."""
        for _, _, sampling, _ in jobs[:1]:  # (the choices differ only in their seeds)
            self.manager.check_request(sampling, routed_dp_rank=routed_dp_rank)
        # bounded (several choices; one choice has no queue): a client that stops reading makes the
        # pumps wait, and each request's generator then coalesces its progress into its next
        # (cumulative) result
        queue: asyncio.Queue = asyncio.Queue(STREAM_BUFFER)
        gens = [self.manager.generate(input_ids=ids, sampling=s, stream=True, prefill_group=group,
                                      routed_dp_rank=routed_dp_rank)
                for _, ids, s, group in jobs]

        wants_logprobs = [bool(s.get("logprobs")) for _, _, s, _ in jobs]
        group_of = {idx: group if group is not None else idx for idx, _, _, group in jobs}

        async def choice_items(idx, gen, wants):
            """One choice's items: its chunks' choice objects, then ("usage", group, result)."""
            sent, sent_tokens = 0, 0
            if chat:
                yield make_choice(idx, {"role": "assistant", "content": ""}, None, None)
            elif prefix is not None:
                yield make_choice(idx, prefix[idx], None, None)
            tool_stream = ToolCallStream(*calls) if calls else None
            thinking = ReasoningStream(*reasoning[:2]) if reasoning else None
            async for out in gen:
                lps = _token_logprobs(out)[sent_tokens:] if wants else None
                sent_tokens = len(out["output_ids"])
                finish = _finish(out) if out["meta_info"]["finish_reason"] else None
                text, thought = out["text"], {}
                if thinking is not None:  # (the answer goes on as below; the thinking beside it)
                    thought = {"reasoning_content": thinking.feed(text, final=finish is not None)}
                    text = thinking.content
                    if not thought["reasoning_content"] or not reasoning[2]:
                        thought = {}
                if tool_stream is None:
                    delta, sent = text[sent:], len(text)
                    if delta or thought or finish or lps:
                        yield make_choice(idx, _delta(thought, delta) if chat else delta, finish, lps)
                else:  # content as it becomes certain, each call once it is whole, then the finish
                    content, new_calls = tool_stream.feed(text, final=finish is not None)
                    if content or thought or lps:
                        yield make_choice(idx, _delta(thought, content), None, lps)
                    first = tool_stream.calls_sent - len(new_calls)
                    for k, call in enumerate(new_calls):
                        yield make_choice(idx, {"tool_calls": [call.to_openai(first + k)]}, None, None)
                    if finish:
                        yield make_choice(idx, {}, "tool_calls" if tool_stream.calls_sent else finish, None)
                if finish:
                    yield ("usage", group_of[idx], out)

        async def pump(idx, gen, wants):
            try:
                async for item in choice_items(idx, gen, wants):
                    await queue.put(item)
            finally:
                await queue.put(("done", idx))

        async def merged(pumps: int):
            """Several choices' items in the order they come, until every pump is done."""
            while pumps:
                item = await queue.get()
                if isinstance(item, tuple) and item[0] == "done":
                    pumps -= 1
                else:
                    yield item

        def chunk(payload: dict) -> bytes:
            return sse_data({"id": rid, "object": obj, "created": int(time.time()), "model": model, **payload})

        async def events() -> AsyncIterator[str | bytes]:
            tasks: list[asyncio.Task] = []
            if len(jobs) == 1:  # one choice (the usual stream): no task or queue in between
                items = choice_items(jobs[0][0], gens[0], wants_logprobs[0])
            else:
                tasks = [asyncio.create_task(pump(idx, g, w)) for (idx, *_), g, w in zip(jobs, gens, wants_logprobs)]
                items = merged(len(tasks))
            outs, errors = [], []
            try:
                try:
                    async for item in items:
                        if isinstance(item, tuple):
                            outs.append(item[1:])
                        else:
                            yield chunk({"choices": [item]})
                except Exception as e:  # (the one choice's failure; several choices' stay in their tasks)
                    errors.append(e)
                errors += [t.exception() for t in tasks if t.exception() is not None]
                for e in errors:
                    code = 400 if isinstance(e, RequestError) else 503 if isinstance(e, UnavailableError) else 500
                    yield f"data: {json.dumps({'error': {'message': str(e), 'code': code}})}\n\n"
                if include_usage:
                    yield chunk({"choices": [], "usage": self._usage(prompt_tokens, outs, reasoning)})
                yield "data: [DONE]\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                await items.aclose()
                for g in gens:
                    await g.aclose()  # a client gone mid-stream: abort what is still running

        return StreamingResponse(events(), media_type="text/event-stream")


def unit_vectors(vectors: np.ndarray) -> np.ndarray:
    """Each row over its L2 norm."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)


def _embedding_inputs(value: Any, field: str) -> list[str | list[int]]:
    """Texts to embed: a string, a list of strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(type(t) is int for t in value):
            return [value]
        if all(isinstance(v, list) and v and all(type(t) is int for t in v) for v in value):
            return list(value)
    raise ApiError(400, f"'{field}' must be a string, a list of strings, a list of token ids or a list of lists of "
                        "token ids", field)


def _delta(thought: dict, content: str) -> dict:
    """A chat chunk's delta: its thinking and its content (left out when empty beside thinking)."""
    return {**thought, "content": content} if content or not thought else thought


def _token_logprobs(out: dict) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token id, logprob, [(alternative id, logprob), ...]) per output token."""
    meta = out["meta_info"]
    return [(tid, lp, [(a, v) for v, a in top])
            for (lp, tid), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])]


def _prompt_token_logprobs(out: dict, top: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """(token id, logprob, [(alternative id, logprob), ...] of the `top` first) per prompt token;
    the first token has neither (None)."""
    meta = out["meta_info"]
    return [(tid, lp, None if alternatives is None else [(a, v) for v, a in alternatives[:top]])
            for (lp, tid), alternatives in zip(meta["input_token_logprobs"], meta["input_top_logprobs"])]


def _prompt_logprobs_field(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` extra: alternatives per prompt token (None: not asked)."""
    top = _field(body, "prompt_logprobs", int)
    if top is not None:
        if not 0 <= top <= 20:
            raise ApiError(400, "'prompt_logprobs' must be between 0 and 20", "prompt_logprobs")
        if stream:
            raise ApiError(400, "'prompt_logprobs' is answered whole: not with stream", "prompt_logprobs")
    return top


def _finish(out: dict) -> str | None:
    reason = out["meta_info"]["finish_reason"]
    return None if reason is None else reason["type"]


def _chat_reply(out: dict, calls: tuple[ToolCallFormat, str, bool, frozenset[str]] | None,
                reasoning: tuple[ReasoningFormat, bool, bool] | None = None) -> dict:
    """A non-streamed choice's message and finish_reason; with the thinking split out and tool
    calls parsed out of the answer where asked."""
    text, thought = out["text"], {}
    if reasoning is not None:
        fmt, thinking, include = reasoning
        thought_text, text = fmt.split(text, thinking)
        if thought_text is not None and include:
            thought = {"reasoning_content": thought_text}
    if calls is None:  # (a reply that only thought has no content, as vLLM answers)
        return {"message": {"role": "assistant", **thought, "content": text if text or not thought else None},
                "finish_reason": _finish(out)}
    fmt, forced, parallel, names = calls
    content, found = fmt.parse(forced + text, names)
    if not parallel:
        found = found[:1]
    if not found:
        return {"message": {"role": "assistant", **thought, "content": content if content or not thought else None},
                "finish_reason": _finish(out)}
    return {"message": {"role": "assistant", **thought, "content": content or None,
                        "tool_calls": [c.to_openai() for c in found]}, "finish_reason": "tool_calls"}


def _tools(body: dict) -> list[dict] | None:
    """The request's function tools, checked (as the template and the prompt take them)."""
    tools = _field(body, "tools", list)
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _tool_choice(body: dict, tools: list[dict] | None) -> str:
    """none, auto, required, or the name of the function the reply must call."""
    choice = _field(body, "tool_choice", (str, dict), "auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(400, f"'tool_choice' must be none, auto, required or a function, got '{choice}'",
                           "tool_choice")
        if choice == "required" and not tools:
            raise ApiError(400, "'tool_choice' required needs 'tools'", "tool_choice")
        return choice
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    names = [t["function"]["name"] for t in tools or []]
    if choice.get("type", "function") != "function" or name not in names:
        raise ApiError(400, f"'tool_choice' names a function that is not in 'tools' ({', '.join(names) or 'none'})",
                       "tool_choice")
    return name


# apply_chat_template's own arguments, which the route sets
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
                                       "truncation", "max_length", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs", "add_generation_prompt",
                                       "continue_final_message"})


def _template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (vLLM's and SGLang's extra): variables for the chat template, such
    as Qwen3's enable_thinking."""
    extra = _field(body, "chat_template_kwargs", dict, {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if reserved:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)} (the route's own arguments)",
                       "chat_template_kwargs")
    return extra


def _chat_call(c: Any, where: str) -> dict:
    """A past call of an assistant message: its name and arguments (an object)."""
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                       where)
    raw = fn.get("arguments") or {}
    args = json_object({} if isinstance(raw, str) and not raw.strip() else raw)
    if args is None:
        raise ApiError(400, f"{where}.function.arguments must be a JSON object", where)
    return {"id": c.get("id"), "name": fn["name"], "arguments": args}


def _chat_message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):  # a list of parts: keep the text ones
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part.get("text") or "")
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content")
    # (OpenAI's "developer" messages are what "system" ones were; chat templates know the latter)
    out = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
    if m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        out["tool_calls"] = [_chat_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])]
    for key in ("tool_call_id", "name", "reasoning_content"):  # (a tool message's; an assistant's thinking)
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def build_router(serving: OpenAIServing) -> APIRouter:
    from tokenizer_proc.responses_api import ResponsesServing

    router = APIRouter()
    responses = ResponsesServing(serving)

    async def handle(request: Request, fn):
        try:
            result = await fn(await read_json_object(request))
        except BodyError as e:
            return ApiError(e.status, e.message, e.param).response()
        except ApiError as e:
            return e.response()
        except RequestError as e:
            return ApiError(400, str(e), _sampling_param(str(e))).response()
        except UnavailableError as e:
            return ApiError(503, str(e), kind="server_overloaded").response()
        return result

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": serving.model_name, "object": "model", "created": serving.created,
                                            "owned_by": "loom", "max_model_len": serving.context_len}]}

    def route(method):
        async def endpoint(request: Request):
            return await handle(request, method)
        return endpoint

    for path, schema, method in (("/v1/completions", COMPLETION, serving.completions),
                                 ("/v1/chat/completions", CHAT_COMPLETION, serving.chat),
                                 ("/v1/embeddings", EMBEDDING, serving.embeddings),
                                 ("/score", SCORE, serving.score), ("/v1/score", SCORE, serving.score),
                                 ("/rerank", RERANK, serving.rerank), ("/v1/rerank", RERANK, serving.rerank),
                                 ("/v2/rerank", RERANK, serving.rerank),
                                 ("/tokenize", TOKENIZE, serving.tokenize),
                                 ("/detokenize", DETOKENIZE, serving.detokenize),
                                 ("/v1/responses", RESPONSE, responses.create)):
        router.add_api_route(path, route(method), methods=["POST"], openapi_extra=request_body(schema),
                             name=method.__name__)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        try:
            return responses.get(response_id)
        except ApiError as e:
            return e.response()

    return router
