"""Function calling: the tool-call formats whole and streamed, the tools in the prompt, and the
chat route's prompts and tool_calls (the model's replies scripted)."""

from __future__ import annotations

import copy
import json
import random

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from scripted_chat import chat as _chat, serving as _serving
from tokenizer_proc.openai_api import ApiError
from tokenizer_proc.tool_calls import (TOOL_CALL_FORMATS, ToolCallStream, format_for_template, renders_tools,
                                       template_messages)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = frozenset({"get_weather", "get_time"})

# (format, reply, content, [(name, arguments)])
REPLIES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> Done.',
     "Done.", [("get_weather", {"city": "Oslo"})]),
    ("hermes", 'A <tool_call>{"name": "get_time", "arguments": {}}</tool_call> then <tool_call>{oops</tool_call>',
     "A\nthen <tool_call>{oops</tool_call>", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ("hermes", "No tools needed: 4 < 5 and <tool is not a marker.", "No tools needed: 4 < 5 and <tool is not a marker.", []),
    ("hermes", 'text <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
     'text <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Lima"}}', "", [("get_weather", {"city": "Lima"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Kyiv"}}',
     "", [("get_time", {}), ("get_weather", {"city": "Kyiv"})]),
    ("llama3_json", 'The answer is {"x": 1}.', 'The answer is {"x": 1}.', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}]', "Sure.",
     [("get_weather", {"city": "Bern"})]),
    ("mistral", '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Riga"}}]', "",
     [("get_time", {}), ("get_weather", {"city": "Riga"})]),
    ("mistral", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS.names())
def test_a_named_start_writes_the_name_as_json(fmt):
    f = TOOL_CALL_FORMATS.make(fmt)
    name = 'say "hi"'
    prefix = f.forced_prefix(name)
    reply = f.call_text(name, {})
    assert reply.startswith(prefix) and _calls(f.parse(reply, frozenset({name}))[1]) == [(name, {})]


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS.names())
def test_a_reply_nested_too_deeply_is_content(fmt):
    f = TOOL_CALL_FORMATS.make(fmt)
    reply = f.forced_prefix("get_time") + "[" * 100_000
    assert f.parse(reply, NAMES) == (reply, [])
    assert ToolCallStream(f, names=NAMES).feed(reply, final=True) == (reply, [])


@pytest.mark.parametrize("fmt,reply,content,calls", REPLIES)
def test_a_whole_reply_parses_into_content_and_calls(fmt, reply, content, calls):
    got_content, got_calls = TOOL_CALL_FORMATS.make(fmt).parse(reply, NAMES)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_") for c in got_calls)


@pytest.mark.parametrize("fmt,reply,content,calls", REPLIES)
def test_a_streamed_reply_gives_what_the_whole_one_gives(fmt, reply, content, calls):
    rng = random.Random(len(reply))
    for _ in range(6):
        stream, sent, found, cut = ToolCallStream(TOOL_CALL_FORMATS.make(fmt), names=NAMES), "", [], 0
        while cut < len(reply):
            cut = min(len(reply), cut + rng.randint(1, 9))
            text, new = stream.feed(reply[:cut], final=False)
            sent, found = sent + text, found + new
        text, new = stream.feed(reply, final=True)
        assert (sent + text, _calls(found + new)) == (content, calls)


def test_a_stream_holds_back_what_may_begin_the_calls_and_sends_each_hermes_call_once_closed():
    stream = ToolCallStream(TOOL_CALL_FORMATS.make("hermes"), names=NAMES)
    assert stream.feed("Checking <tool_", final=False) == ("Checking", [])
    assert stream.feed('Checking <tool_call>{"name": "get_time", "arguments": {}}', final=False) == ("", [])
    text, calls = stream.feed('Checking <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', final=False)
    assert text == "" and _calls(calls) == [("get_time", {})]
    assert stream.feed('Checking <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', final=True) == ("", [])


@pytest.mark.parametrize("fmt", TOOL_CALL_FORMATS.names())
def test_a_forced_start_and_the_models_continuation_make_the_call(fmt):
    f = TOOL_CALL_FORMATS.make(fmt)
    whole = f.call_text("get_weather", {"city": "Paris"})
    for function in ("get_weather", None):
        prefix = f.forced_prefix(function)
        assert whole.startswith(prefix)
        stream = ToolCallStream(f, prefix, names=NAMES)
        text, calls = stream.feed(whole[len(prefix):], final=True)
        assert text == "" and _calls(calls) == [("get_weather", {"city": "Paris"})]
        assert _calls(f.parse(whole, NAMES)[1]) == [("get_weather", {"city": "Paris"})]


def test_the_format_is_the_one_the_template_teaches():
    assert format_for_template("{% for t in tools %}...<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert format_for_template("{{- '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3_json"
    assert format_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert format_for_template(None) == "hermes"
    assert renders_tools("{% if tools %}{{ tools }}{% endif %}") and not renders_tools("{{ messages }}")


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_7", "name": "get_weather", "arguments": {"city": "Paris"}}]},
    {"role": "tool", "content": "18 C", "tool_call_id": "call_7"},
]


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text():
    fmt = TOOL_CALL_FORMATS.make("hermes")
    out = template_messages(copy.deepcopy(CONVERSATION), [WEATHER], fmt, template_renders_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == fmt.call_text("get_weather", {"city": "Paris"}) and "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>"


def test_a_template_with_tools_gets_the_calls_with_their_arguments_as_objects():
    out = template_messages(copy.deepcopy(CONVERSATION), [WEATHER], TOOL_CALL_FORMATS.make("hermes"), True)
    assert out[0] == CONVERSATION[0] and out[3] == CONVERSATION[3]
    assert out[2]["tool_calls"] == [{"id": "call_7", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


# ---- the chat route, the model's replies scripted -----------------------------------------------

BODY = {"messages": [{"role": "user", "content": "Weather in Paris and the time?"}], "tools": [WEATHER, TIME]}
REPLY = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_chat_returns_the_calls_streamed_or_not(smollm2_tokenizer):
    serving, manager = _serving(smollm2_tokenizer, [REPLY, REPLY])
    r = _chat(serving, BODY)
    message = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "I will check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert '"name": "get_weather"' in manager.prompts[0]  # (SmolLM2's template renders no tools: a system message)

    chunks = _chat(serving, {**BODY, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "I will check."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [(tc["index"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] \
        == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert all(tc["id"].startswith("call_") and tc["type"] == "function" for tc in calls)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(smollm2_tokenizer):
    serving, _ = _serving(smollm2_tokenizer, [REPLY, REPLY])
    r = _chat(serving, {**BODY, "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in r["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    chunks = _chat(serving, {**BODY, "parallel_tool_calls": False, "stream": True})
    assert [tc["function"]["name"] for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []] \
        == ["get_weather"]


def test_tool_choice_none_and_a_reply_without_calls_are_plain_content(smollm2_tokenizer):
    serving, _ = _serving(smollm2_tokenizer, [REPLY, "It is sunny."])
    r = _chat(serving, {**BODY, "tool_choice": "none"})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert r["choices"][0]["finish_reason"] == "stop"
    r = _chat(serving, BODY)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}


@pytest.mark.parametrize("choice,prefix", [
    ({"type": "function", "function": {"name": "get_time"}}, '<tool_call>\n{"name": "get_time", "arguments": '),
    ("required", '<tool_call>\n{"name": "'),
])
def test_a_required_or_named_call_starts_the_reply_as_one(smollm2_tokenizer, choice, prefix):
    continuation = {"required": 'get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'}.get(
        choice, '{}}\n</tool_call>') if isinstance(choice, str) else '{}}\n</tool_call>'
    serving, manager = _serving(smollm2_tokenizer, [continuation, continuation])
    r = _chat(serving, {**BODY, "tool_choice": choice})
    assert manager.prompts[0].endswith(prefix)
    grammar = xgr.Grammar.from_ebnf(manager.samplings[0]["ebnf"])  # (the reply is held to a call)
    assert _is_grammar_accept_string(grammar, continuation)
    assert not _is_grammar_accept_string(grammar, continuation.replace("}}", '}, "extra": 1}'))
    calls = r["choices"][0]["message"]["tool_calls"]
    want = ("get_weather", {"city": "Nice"}) if choice == "required" else ("get_time", {})
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [want]
    chunks = _chat(serving, {**BODY, "tool_choice": choice, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    assert [tc["function"]["name"] for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []] == [want[0]]


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS.names()))
@pytest.mark.parametrize("function", ["get_weather", None])
def test_the_call_grammar_takes_a_call_after_its_forced_start(fmt, function):
    fmt = TOOL_CALL_FORMATS.make(fmt)
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    grammar = xgr.Grammar.from_ebnf(fmt.call_grammar([strict_weather, TIME], function))
    forced = fmt.forced_prefix(function)
    for name, args, ok in [("get_weather", {"city": "Nice"}, True), ("get_time", {}, function is None),
                           ("get_weather", {"city": 3}, False), ("get_weather", {"town": "Nice"}, False),
                           ("get_time", {"any": [1, "two"]}, function is None), ("nope", {}, False)]:
        text = fmt.call_text(name, args)
        assert _is_grammar_accept_string(grammar, text[len(forced):]) == (ok and text.startswith(forced)), text
    # schemas a grammar cannot take (or not in time): the reply is only started as a call
    for parameters in ({"type": "nonsense"}, {"type": "object", "properties": {f"p{i}": {} for i in range(300)}}):
        assert fmt.call_grammar([{"type": "function", "function": {"name": "f", "parameters": parameters}}], "f") is None


def test_a_template_that_renders_tools_gets_them(smollm2_tokenizer):
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
        "\n{% endfor %}<assistant>")
    serving, manager = _serving(tokenizer, [REPLY])
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "noon"}],
            "tools": [WEATHER, TIME]}
    r = _chat(serving, body)
    # (HF templates drop the newline after a block tag)
    assert manager.prompts[0] == ('TOOLS:get_weather;get_time;<user>Hi<assistant><tool_call>{"tz": "UTC"}</tool_call>'
                                  "<tool>noon<assistant>")
    assert r["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}]}, "messages[0].tool_calls[0]"),
])
def test_bad_tools_fields_are_400_naming_the_field(smollm2_tokenizer, body, param):
    serving, _ = _serving(smollm2_tokenizer, ["x"])
    with pytest.raises(ApiError) as e:
        _chat(serving, {"messages": [{"role": "user", "content": "Hi"}], **body})
    assert e.value.status == 400 and e.value.param == param


def test_a_developer_message_is_a_system_message(smollm2_tokenizer):
    serving, manager = _serving(smollm2_tokenizer, ["Hi.", "Hi."])
    for role in ("developer", "system"):
        _chat(serving, {"messages": [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]})
    assert manager.prompts[0] == manager.prompts[1] and "Answer in French." in manager.prompts[0]


def test_continue_final_message_continues_the_assistant_s_start(smollm2_tokenizer):
    serving, manager = _serving(smollm2_tokenizer, [" Paris."])
    start = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}]
    r = _chat(serving, {"messages": start, "continue_final_message": True})
    assert manager.prompts[0].endswith("<|im_start|>assistant\nIt is") and r["choices"][0]["message"]["content"] == " Paris."
    for body in ({"messages": start, "continue_final_message": True, "add_generation_prompt": True},
                 {"messages": start[:1], "continue_final_message": True}):
        with pytest.raises(ApiError) as e:
            _chat(serving, body)
        assert e.value.status == 400 and e.value.param == "continue_final_message"


@pytest.mark.parametrize("fmt", sorted(TOOL_CALL_FORMATS.names()))
def test_required_calls_may_be_several_while_parallel(fmt):
    """Under required with parallel_tool_calls the grammar takes one call or more, each of a tool
    and its schema; the reply then parses into those calls."""
    f = TOOL_CALL_FORMATS.make(fmt)
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    grammar = xgr.Grammar.from_ebnf(f.call_grammar([strict_weather, TIME], None, parallel=True))
    forced = f.forced_prefix(None)

    def reply(*calls):
        return f.opening + f.between.join(json.dumps({"name": n, f.arguments_key: a}) for n, a in calls) + f.closing

    for calls, ok in [([("get_weather", {"city": "Oslo"})], True),
                      ([("get_weather", {"city": "Oslo"}), ("get_time", {}), ("get_weather", {"city": "Rome"})], True),
                      ([("get_time", {}), ("get_weather", {"town": "Rome"})], False),
                      ([("get_time", {}), ("nope", {})], False)]:
        text = reply(*calls)
        assert _is_grammar_accept_string(grammar, text[len(forced):]) == ok, text
        if ok:
            assert _calls(f.parse(text, NAMES)[1]) == calls
    assert not _is_grammar_accept_string(grammar, reply(("get_time", {}))[len(forced):] + f.between)
    single = xgr.Grammar.from_ebnf(f.call_grammar([strict_weather, TIME], None))
    assert not _is_grammar_accept_string(single, reply(("get_time", {}), ("get_time", {}))[len(forced):])


def test_the_model_s_generation_config_gives_unset_sampling_fields(smollm2_tokenizer, tmp_path):
    """--generation-config auto: generation_config.json's sampling fields are the defaults of the
    OpenAI routes; a request's own values win; none: loom's defaults."""
    import json as _json

    from launch import sampling_defaults

    (tmp_path / "generation_config.json").write_text(_json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
         "eos_token_id": 2, "min_p": None}))
    defaults = sampling_defaults(tmp_path, "auto")
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert sampling_defaults(tmp_path, "none") == {} and sampling_defaults(tmp_path / "missing", "auto") == {}
    serving, manager = _serving(smollm2_tokenizer, ["Hi.", "Hi."], "auto")
    serving.sampling_defaults = defaults
    _chat(serving, {"messages": [{"role": "user", "content": "Hi"}]})
    _chat(serving, {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "top_k": None})
    assert {k: manager.samplings[0][k] for k in defaults} == defaults
    assert manager.samplings[1]["temperature"] == 0 and manager.samplings[1]["top_k"] == 20
