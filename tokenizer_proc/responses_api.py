"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) over the chat route.

A request becomes a chat request: `instructions` a system message, `input` (a string or items:
messages, past function calls and their outputs) the conversation, after the stored one of
`previous_response_id`; `max_output_tokens`, `temperature`, `top_p`, function `tools`,
`tool_choice`, `parallel_tool_calls` and `text.format` (structured output) map to their chat
fields. The chat reply becomes output items: the thinking (with --reasoning-parser) a `reasoning`
item, the answer a `message`, each call a `function_call`. Streamed, the chat chunks become the
Responses events (response.created, output items added and done, text and argument deltas,
response.completed). Responses are kept (unless `store` is false), the most recent first, for
`previous_response_id` and GET.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from tokenizer_proc.openai_api import ApiError, OpenAIServing, _field, sse_data

# responses kept for previous_response_id, least recent dropped first past either bound
MAX_STORED = 1024
MAX_STORED_CHARS = 64 * 1024 * 1024  # of their conversations' text
# chat fields a Responses request may carry as they are (vLLM's and SGLang's extras included)
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "parallel_tool_calls", "chat_template_kwargs", "top_logprobs")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing:
    def __init__(self, chat: OpenAIServing):
        self.chat = chat
        self.stored: OrderedDict[str, tuple[list[dict], dict, int]] = OrderedDict()  # id -> (conversation, response, chars)
        self.stored_chars = 0

    async def create(self, body: dict) -> dict | StreamingResponse:
        model = self.chat.check_model(body)
        if _field(body, "background", bool, False):
            raise ApiError(400, "'background' responses are not supported", "background")
        messages = self._conversation(body)
        chat_body: dict[str, Any] = {"model": model, "messages": messages,
                                     **{k: body[k] for k in _PASSED if body.get(k) is not None}}
        limit = _field(body, "max_output_tokens", int)
        if limit is not None:
            chat_body["max_tokens"] = limit
        tools = _tools(body)
        if tools:
            chat_body["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat_body["tool_choice"] = choice
        response_format = _text_format(body)
        if response_format is not None:
            chat_body["response_format"] = response_format
        store = _field(body, "store", bool, True)
        base = {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
                "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": _field(body, "instructions", str), "max_output_tokens": limit,
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "tools": _field(body, "tools", list, []), "tool_choice": body.get("tool_choice") or "auto",
                "parallel_tool_calls": _field(body, "parallel_tool_calls", bool, True),
                "previous_response_id": body.get("previous_response_id"),
                "text": {"format": (_field(body, "text", dict, {}) or {}).get("format") or {"type": "text"}},
                "metadata": _field(body, "metadata", dict, {}), "store": store, "output": [], "usage": None}
        if not _field(body, "stream", bool, False):
            out = await self.chat.chat(chat_body)
            response = _finished(base, _output_items(out["choices"][0]["message"]), out["choices"][0]["finish_reason"],
                                 out["usage"])
            self._keep(store, messages, response)
            return response
        stream = await self.chat.chat({**chat_body, "stream": True, "stream_options": {"include_usage": True}})
        return StreamingResponse(self._events(stream, base, messages, store), media_type="text/event-stream")

    def get(self, response_id: str) -> dict:
        kept = self.stored.get(response_id)
        if kept is None:
            raise ApiError(404, f"no stored response '{response_id}'", "response_id", "not_found")
        return kept[1]

    # ---- the request --------------------------------------------------------------------

    def _conversation(self, body: dict) -> list[dict]:
        """The chat messages: the stored conversation of previous_response_id, the instructions,
        then the input."""
        messages: list[dict] = []
        previous = _field(body, "previous_response_id", str)
        if previous is not None:
            kept = self.stored.get(previous)
            if kept is None:
                raise ApiError(404, f"previous_response_id: no stored response '{previous}'", "previous_response_id",
                               "not_found")
            messages = [m for m in kept[0] if m["role"] != "system"]
        instructions = _field(body, "instructions", str)
        if instructions:
            messages = [{"role": "system", "content": instructions}] + messages
        value = body.get("input")
        if isinstance(value, str):
            messages.append({"role": "user", "content": value})
        elif isinstance(value, list) and value:
            for i, item in enumerate(value):
                _add_item(messages, item, f"input[{i}]")
        else:
            raise ApiError(400, "'input' must be a string or a non-empty list of items", "input")
        return messages

    def _keep(self, store: bool, messages: list[dict], response: dict) -> None:
        if not store:
            return
        conversation = list(messages)
        for item in response["output"]:
            _add_item(conversation, item, "output")
        chars = len(json.dumps(conversation))
        self.stored[response["id"]] = (conversation, response, chars)
        self.stored_chars += chars
        while len(self.stored) > MAX_STORED or (self.stored_chars > MAX_STORED_CHARS and len(self.stored) > 1):
            self.stored_chars -= self.stored.popitem(last=False)[1][2]

    # ---- streaming ----------------------------------------------------------------------

    async def _events(self, stream: StreamingResponse, base: dict, messages: list[dict],
                      store: bool) -> AsyncIterator[bytes]:
        """The chat stream's chunks as Responses events."""
        sequence = 0
        items: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item being streamed
        finish, usage = None, None

        def event(kind: str, **fields) -> bytes:
            nonlocal sequence
            sequence += 1
            return sse_data({"type": kind, "sequence_number": sequence - 1, **fields})

        def close() -> list[bytes]:
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item, index = open_item, None, len(items)
            items.append(item)
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                return [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=text),
                        event("response.output_item.done", output_index=index, item=item)]
            item["status"] = "completed"
            part = item["content"][0]
            return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]

        def text(kind: str, delta: str) -> list[bytes]:
            nonlocal open_item
            out = []
            if open_item is not None and open_item["type"] != kind:
                out += close()
            index = len(items)
            if open_item is None:
                open_item = _reasoning_item("") if kind == "reasoning" else _message_item("", "in_progress")
                out.append(event("response.output_item.added", output_index=index,
                                 item={**open_item, "content": []}))
                if kind == "message":
                    out.append(event("response.content_part.added", item_id=open_item["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            open_item["content"][0]["text"] += delta
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            out.append(event(name, item_id=open_item["id"], output_index=index, content_index=0, delta=delta,
                             **({} if kind == "reasoning" else {"logprobs": []})))
            return out

        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        async for raw in stream.body_iterator:
            data = (raw.decode() if isinstance(raw, bytes) else raw).removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                for out in close():
                    yield out
                yield event("error", code=str(chunk["error"].get("code")), message=chunk["error"].get("message"),
                            param=None)
                yield event("response.failed", response={**base, "status": "failed", "output": items,
                                                         "error": {"code": "server_error",
                                                                   "message": chunk["error"].get("message")}})
                return
            if chunk.get("usage") is not None and not chunk["choices"]:
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            for out in (text("reasoning", delta["reasoning_content"]) if delta.get("reasoning_content") else []):
                yield out
            for out in (text("message", delta["content"]) if delta.get("content") else []):
                yield out
            for call in delta.get("tool_calls") or []:
                for out in close():
                    yield out
                item, index = _call_item(call), len(items)
                items.append(item)
                yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"])
                yield event("response.output_item.done", output_index=index, item=item)
            finish = choice.get("finish_reason") or finish
        for out in close():
            yield out
        response = _finished(base, items, finish, usage)
        self._keep(store, messages, response)
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)


# ---- items ----------------------------------------------------------------------------------

def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call.get("id") or _new_id("call"),
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _output_items(message: dict) -> list[dict]:
    """A chat reply's message as output items: its thinking, its text, its calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    items += [_call_item(c) for c in message.get("tool_calls") or []]
    return items


def _finished(base: dict, items: list[dict], finish: str | None, usage: dict | None) -> dict:
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cut = finish == "length"
    return {**base, "status": "incomplete" if cut else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {})
                                               .get("cached_tokens", 0)},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": (usage.get("completion_tokens_details") or {})
                                                .get("reasoning_tokens", 0)},
                      "total_tokens": usage["total_tokens"]}}


def _text(content: Any, where: str) -> str:
    """An input message's content: a string, or parts whose text is kept (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") not in ("input_text", "output_text", "text") for p in content):
            raise ApiError(400, f"{where}.content: only text parts are supported", f"{where}.content")
        return "".join(p.get("text") or "" for p in content)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _add_item(messages: list[dict], item: Any, where: str) -> None:
    """One input (or stored output) item onto the chat messages."""
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ApiError(400, f"{where}.role must be user, assistant, system or developer", f"{where}.role")
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
            raise ApiError(400, f"{where}: a function_call takes a name and arguments (a JSON string)", where)
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
            last["tool_calls"].append(call)  # (a reply's calls are one assistant message)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = json.dumps(output)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    elif kind != "reasoning":  # (a past reply's thinking: templates leave it out)
        raise ApiError(400, f"{where}.type '{kind}' is not supported (message, function_call, function_call_output, "
                            "reasoning)", f"{where}.type")


def _tools(body: dict) -> list[dict]:
    """Responses' flat function tools as chat tools."""
    tools = _field(body, "tools", list, [])
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"tools[{i}]: only function tools are supported, got {kind!r}", f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                           "strict") if tool.get(k) is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}",
                   "tool_choice")


def _text_format(body: dict) -> dict | None:
    """`text.format` as the chat route's response_format."""
    fmt = (_field(body, "text", dict, {}) or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'text.format.type' must be text, json_object or json_schema", "text.format")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "schema",
                                                        "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    return {"type": fmt["type"]}
