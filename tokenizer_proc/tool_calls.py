"""Function calling: the tools and past calls into a chat prompt, and the calls out of the model's
reply, whole or as it streams, in the format the model's chat template teaches.

Formats (`--tool-call-parser`; auto picks one from the chat template's text):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a block per call (Qwen2.5,
               Qwen3, Hermes, ...). A template that renders no tools gets them in a system message
               that asks for this format.
  llama3_json  the reply is {"name": ..., "parameters": {...}} (after <|python_tag|> or not),
               several joined by ";" (Llama 3.1-3.3).
  mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (the marker is a control token
               that decoding may drop: a reply that is such a list counts too).
A reply whose calls do not parse is content, as it came."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from scheduler_proc.registry import Registry

TOOL_CALL_FORMATS = Registry("tool call parser")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def json_object(value: Any) -> dict | None:
    """A call's arguments as an object: an object as it is, JSON text of one decoded; else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # (RecursionError: nested too deeply)
            return None
    return value if isinstance(value, dict) else None


def _call(obj: Any, argument_keys: tuple[str, ...], names: frozenset[str] | None) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., <argument key>: {...}} of a function in `names` (None: any), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = json_object(next((obj[k] for k in argument_keys if k in obj), {}))
    return None if args is None else ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Every JSON value in `text`, one after another with only `separators` and whitespace between
    them; None if anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):  # (RecursionError: nested too deeply)
            return None
        values.append(value)


class ToolCallFormat:
    name: str
    marker: str  # the text that opens the calls
    # a call as the model writes one: opening + {"name": ..., arguments_key: {...}} + closing; several
    # calls: `between` after each call's object but the last
    opening = closing = ""
    between = ""
    arguments_key = "arguments"

    def calls_start(self, text: str) -> int | None:
        """Where the calls begin in `text` (None: not, as far as the text goes)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def parse(self, text: str, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply; a reply whose calls do not parse (or call a function not
        in `names`): (text, [])."""
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:], names)
        return (text, []) if not calls else (text[:start].rstrip(), calls)

    def parse_calls(self, text: str, names: frozenset[str] | None = None) -> list[ToolCall] | None:
        """The calls in `text` (which starts where they start); None unless all of it parses."""
        raise NotImplementedError

    def forced_prefix(self, function: str | None) -> str:
        """The start of a reply that makes it a call (of `function`, or of one the model names)."""
        return self.opening + '{"name": ' + (f'{json.dumps(function)}, "{self.arguments_key}": ' if function else '"')

    def call_grammar(self, tools: list[dict], function: str | None, parallel: bool = False) -> str | None:
        """An EBNF grammar (structured output) of the rest of a reply that forced_prefix(function)
        began: one call of `function` (None: of any tool, the model writing the name), its
        arguments an object of the function's parameters schema, then, with `parallel`, any
        number of further calls (of the same functions), then the calls' end. None where the
        schemas are beyond what a grammar here takes (xgrammar refuses one, or they would compile
        too long): the reply is then only started as a call."""
        import xgrammar as xgr

        from worker_proc.grammar import MAX_GRAMMAR_CHARS, json_schema_grammar, schema_problem

        def literal(text: str):
            return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))

        chosen = [t["function"] for t in tools if function is None or t["function"]["name"] == function]
        schemas = [fn.get("parameters") or {"type": "object"} for fn in chosen]
        if schema_problem(schemas) is not None:
            return None
        firsts, wholes = [], []
        for fn, schema in zip(chosen, schemas):
            try:  # (properties the schema does not name are allowed unless the function is strict)
                arguments = json_schema_grammar(json.dumps(schema), strict=bool(fn.get("strict")))
            except RuntimeError:
                return None
            named = json.dumps(fn["name"], ensure_ascii=False) + f', "{self.arguments_key}": '
            firsts.append(xgr.Grammar.concat(*([] if function else [literal(named[1:])]), arguments, literal("}")))
            wholes.append(xgr.Grammar.concat(literal('{"name": ' + named), arguments, literal("}")))
        first = firsts[0] if len(firsts) == 1 else xgr.Grammar.union(*firsts)
        text = str(xgr.Grammar.concat(first, literal(self.closing)) if self.closing else first)
        if parallel:  # first (between next){0,} closing, from the rules of one union (their names kept apart)
            more = xgr.Grammar.concat(literal(self.between), wholes[0] if len(wholes) == 1
                                      else xgr.Grammar.union(*wholes))
            both = str(xgr.Grammar.union(first, more))
            heads = re.match(r"root ::= \(\((\w+)\) \| \((\w+)\)\)\n", both)
            if heads is not None:
                closing = f" {json.dumps(self.closing)}" if self.closing else ""
                text = f"root ::= (({heads[1]} {heads[2]}{{0, -1}}{closing}))\n" + both[heads.end():]
        return text if len(text) <= MAX_GRAMMAR_CHARS else None

    def call_text(self, name: str, arguments: dict) -> str:
        """A past call as the model writes it (for templates that render no tool calls)."""
        call = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        return self.opening + call + self.closing

    def holds(self, text: str) -> int:
        """How many characters at the end of `text` a stream keeps back: they may begin the marker."""
        return tag_start_at_end(text, self.marker)


@TOOL_CALL_FORMATS.register("hermes")
class Hermes(ToolCallFormat):
    marker = "<tool_call>"
    opening, closing = "<tool_call>\n", "\n</tool_call>"
    between = "\n</tool_call>\n<tool_call>\n"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]]:
        """A block that does not parse stays in the content, as do the words around the blocks."""
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls, rest, last = [], [], start
        for m in self._BLOCK.finditer(text, start):
            call = self._block_call(m.group(1), names)
            if call is not None:
                calls.append(call)
                rest.append(text[last:m.start()])
                last = m.end()
        if not calls:
            return text, []
        rest = "".join(rest + [text[last:]]).strip()
        before = text[:start].rstrip()
        return (before + "\n" + rest if before and rest else before or rest), calls

    def parse_calls(self, text: str, names: frozenset[str] | None = None) -> list[ToolCall] | None:
        return [c for c in (self._block_call(b, names) for b in self._BLOCK.findall(text)) if c is not None] or None

    @staticmethod
    def _block_call(body: str, names: frozenset[str] | None) -> ToolCall | None:
        values = _json_values(body, "")
        return _call(values[0], ("arguments", "parameters"), names) if values and len(values) == 1 else None



@TOOL_CALL_FORMATS.register("llama3_json")
class Llama3Json(ToolCallFormat):
    marker = "<|python_tag|>"
    arguments_key = "parameters"
    between = "; "

    def calls_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.marker) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def parse_calls(self, text: str, names: frozenset[str] | None = None) -> list[ToolCall] | None:
        values = _json_values(text.removeprefix(self.marker), ";")
        calls = [_call(v, ("parameters", "arguments"), names) for v in values or []]
        return calls if calls and all(calls) else None

    def holds(self, text: str) -> int:
        return len(text) if not text.strip() else super().holds(text)  # (a reply's first character decides)



@TOOL_CALL_FORMATS.register("mistral")
class Mistral(ToolCallFormat):
    marker = "[TOOL_CALLS]"
    opening, closing = "[TOOL_CALLS][", "]"  # (a list of calls)
    between = ", "

    def calls_start(self, text: str) -> int | None:
        i = text.find(self.marker)
        if i >= 0:
            return i
        stripped = text.lstrip()  # (the marker decoded away)
        return len(text) - len(stripped) if stripped.startswith("[{") else None

    def parse_calls(self, text: str, names: frozenset[str] | None = None) -> list[ToolCall] | None:
        values = _json_values(text.removeprefix(self.marker), "")
        if not values or len(values) != 1 or not isinstance(values[0], list):
            return None
        calls = [_call(v, ("arguments", "parameters"), names) for v in values[0]]
        return calls if calls and all(calls) else None

    def holds(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped == "[":  # (a list may be starting)
            return len(text)
        return super().holds(text)



def tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (shorter than the tag): what a stream
    keeps back until the text after it says whether the tag is being written."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def format_for_template(chat_template: str | None) -> str:
    """The format a chat template teaches, by the markers in its text (hermes where none shows)."""
    text = chat_template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def renders_tools(chat_template: str | None) -> bool:
    """Whether the template writes the `tools` it is given into the prompt."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tools_system_text(tools: list[dict], fmt: ToolCallFormat) -> str:
    """A system message that lists the tools and how to call them, for templates that render none."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.call_text("<function name>", {"<argument>": "<value>"})
    return ("You can call functions to help with the user's request. The functions, as JSON schemas:\n"
            f"{listed}\n\nTo call one, reply with exactly:\n{example}\n"
            "one such call per function call; a function's result comes back in a tool message.")


class ToolCallStream:
    """One streamed choice's reply, fed as its text grows: the content that can go out now (text
    that may begin the calls' marker is kept back) and the calls completed so far."""

    def __init__(self, fmt: ToolCallFormat, prefix: str = "", parallel: bool = True,
                 names: frozenset[str] | None = None):
        self.fmt, self.prefix, self.parallel, self.names = fmt, prefix, parallel, names
        self.sent = 0  # characters of content sent
        self.calls_sent = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content to send, calls to send) for the reply's text so far (without the prefix).
        Content is what parse() would give, sent as it becomes certain: trailing whitespace waits
        for what follows it (parse drops it before the calls)."""
        full = self.prefix + text
        start = self.fmt.calls_start(full)
        if start is None:
            end = len(full) if final else len(full[:len(full) - self.fmt.holds(full)].rstrip())
            return self._content(full, end), []
        before = full[:start].rstrip()
        content = self._content(full, len(before))
        if not final:
            closed = full.rfind("</tool_call>") if isinstance(self.fmt, Hermes) else -1
            if closed > start:  # (hermes: each block's call goes out once it closes)
                blocks = full[start:closed + len("</tool_call>")]
                return content, self._new_calls(self.fmt.parse_calls(blocks, self.names) or [])
            return content, []
        whole, calls = self.fmt.parse(full, self.names)
        if not calls:  # the calls did not parse: the rest is content
            return content + self._content(full, len(full)), []
        return content + whole[len(before):], self._new_calls(calls)

    def _content(self, full: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = full[self.sent:end], end
        return out

    def _new_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.parallel:
            calls = calls[:1]
        new = calls[self.calls_sent:]
        self.calls_sent = len(calls)
        return new


def template_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolCallFormat,
                      template_renders_tools: bool) -> list[dict]:
    """Chat messages as the template takes them. A template that renders tools gets the assistant's
    calls with their arguments as objects (as HF templates expect) and tool messages as they are;
    any other gets the tools in a system message (first, or merged into the first system message),
    the calls written in the format's text and the tool results as user messages."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if template_renders_tools:
            if calls:
                m["tool_calls"] = [{**({"id": c["id"]} if c.get("id") else {}), "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        else:
            if calls:
                m["content"] = "\n".join([m["content"]] * bool(m["content"]) +
                                         [fmt.call_text(c["name"], c["arguments"]) for c in calls])
            if m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not template_renders_tools:
        text = tools_system_text(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
