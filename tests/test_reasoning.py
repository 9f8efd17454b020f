"""Reasoning models' replies (--reasoning-parser): the thinking split from the answer whole and
streamed, where a reply starts thinking, and the chat route's fields (reasoning_content,
chat_template_kwargs, include_reasoning / separate_reasoning, a grammar after the thinking, tool
calls in the answer), the model's replies scripted."""

from __future__ import annotations

import copy
import json
import random

import pytest

from scripted_chat import chat, serving
from tokenizer_proc.openai_api import ApiError
from tokenizer_proc.reasoning import REASONING_FORMATS, ReasoningStream

# (format, starts thinking, reply, thinking, answer)
REPLIES = [
    ("qwen3", False, "<think>\nplan\n</think>\n\nAnswer.", "\nplan\n", "Answer."),
    ("qwen3", False, "Answer.", None, "Answer."),
    ("qwen3", False, "<b>bold</b> <think>", None, "<b>bold</b> <think>"),
    ("qwen3", False, "  <think>cut off before its end", "cut off before its end", ""),
    ("qwen3", True, "plan</think>Answer", "plan", "Answer"),
    ("qwen3", True, "</think>", "", ""),
    ("qwen3", False, "", None, ""),
    ("deepseek_r1", True, "plan only, cut off </thi", "plan only, cut off </thi", ""),
    ("deepseek_r1", True, "<think>plan</think>\nA < B </think> <", "plan", "A < B </think> <"),
    ("deepseek_r1", True, "x </ y </think>z", "x </ y ", "z"),
]


@pytest.mark.parametrize("fmt,thinking,reply,thought,answer", REPLIES)
def test_a_whole_reply_splits_into_thinking_and_answer(fmt, thinking, reply, thought, answer):
    assert REASONING_FORMATS.make(fmt).split(reply, thinking) == (thought, answer)


@pytest.mark.parametrize("fmt,thinking,reply,thought,answer", REPLIES)
def test_a_streamed_reply_gives_what_the_whole_one_gives(fmt, thinking, reply, thought, answer):
    rng = random.Random(len(reply))
    for _ in range(20):
        stream = ReasoningStream(REASONING_FORMATS.make(fmt), thinking)
        ends = sorted({rng.randrange(len(reply) + 1) for _ in range(rng.randrange(1, 8))}) + [len(reply)]
        sent, answers = "", []
        for k, end in enumerate(ends):
            sent += stream.feed(reply[:end], final=k == len(ends) - 1)
            answers.append(stream.content)
        assert (sent, stream.content) == (thought or "", answer)
        assert all(answer.startswith(a) for a in answers)  # (the answer only grows)


@pytest.mark.parametrize("fmt,prompt,thinking", [
    ("qwen3", "<|im_start|>assistant\n", False),
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("deepseek_r1", "<｜Assistant｜>", True),
    ("deepseek_r1", "<｜Assistant｜></think>", False),
])
def test_the_prompt_says_whether_a_reply_starts_thinking(fmt, prompt, thinking):
    assert REASONING_FORMATS.make(fmt).thinking_at_start(prompt) == thinking


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
              "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")
R1_LIKE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant><think>\n"
ASK = {"messages": [{"role": "user", "content": "2 + 2?"}]}
REPLY = "<think>\nTwo and two.\n</think>\n\nIt is 4."


def _with_template(tokenizer, template):
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def _streamed(chunks) -> tuple[str, str, list[str | None]]:
    deltas = [c["choices"][0]["delta"] for c in chunks]
    return ("".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            [c["choices"][0]["finish_reason"] for c in chunks])


@pytest.mark.parametrize("step", [1, 3, 7])
def test_chat_returns_the_thinking_beside_the_answer(smollm2_tokenizer, step):
    tok = _with_template(smollm2_tokenizer, QWEN3_LIKE)
    route, _ = serving(tok, [REPLY, REPLY], reasoning_parser="qwen3", step=step)
    message = chat(route, ASK)["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "\nTwo and two.\n", "content": "It is 4."}
    chunks = chat(route, {**ASK, "stream": True})
    assert _streamed(chunks) == ("\nTwo and two.\n", "It is 4.", [None] * (len(chunks) - 1) + ["stop"])
    # every chunk but the first (the role) and the last (the finish) carries text
    assert all(c["choices"][0]["delta"] for c in chunks[1:-1])


def test_without_the_parser_or_with_separate_reasoning_false_the_reply_is_content(smollm2_tokenizer):
    tok = _with_template(smollm2_tokenizer, QWEN3_LIKE)
    plain, _ = serving(tok, [REPLY])
    assert chat(plain, ASK)["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    route, _ = serving(tok, [REPLY, REPLY, REPLY], reasoning_parser="qwen3")
    assert chat(route, {**ASK, "separate_reasoning": False})["choices"][0]["message"]["content"] == REPLY
    # include_reasoning false: the thinking is left out, the answer alone is content
    assert chat(route, {**ASK, "include_reasoning": False})["choices"][0]["message"] == \
        {"role": "assistant", "content": "It is 4."}
    assert _streamed(chat(route, {**ASK, "include_reasoning": False, "stream": True}))[:2] == ("", "It is 4.")


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_answer(smollm2_tokenizer):
    tok = _with_template(smollm2_tokenizer, QWEN3_LIKE)
    route, manager = serving(tok, ["It is 4.", "It is 4."], reasoning_parser="qwen3")
    body = {**ASK, "chat_template_kwargs": {"enable_thinking": False}, "response_format": {"type": "json_object"}}
    assert chat(route, body)["choices"][0]["message"] == {"role": "assistant", "content": "It is 4."}
    assert manager.prompts[0].endswith("<think>\n\n</think>\n\n")
    assert "grammar_after" not in manager.samplings[0]  # (the thinking is closed: the grammar holds from the start)
    # a past turn's thinking goes to the template as reasoning_content
    history = {"messages": [{"role": "user", "content": "1 + 1?"},
                            {"role": "assistant", "content": "2", "reasoning_content": "One and one."},
                            {"role": "user", "content": "2 + 2?"}]}
    chat(route, history)
    assert "<think>One and one.</think>2" in manager.prompts[1]


@pytest.mark.parametrize("fmt,template,reply", [
    ("deepseek_r1", R1_LIKE, "Two and two.</think>It is 4."),
    ("deepseek_r1", QWEN3_LIKE, "Two and two.</think>It is 4."),
    ("qwen3", R1_LIKE, "Two and two.</think>It is 4."),
    ("qwen3", QWEN3_LIKE, "<think>Two and two.</think>It is 4."),
])
def test_a_reply_that_starts_thinking_holds_its_grammar_until_the_thinking_ends(smollm2_tokenizer, fmt, template,
                                                                                 reply):
    tok = _with_template(smollm2_tokenizer, template)
    route, manager = serving(tok, [reply], reasoning_parser=fmt)
    message = chat(route, {**ASK, "response_format": {"type": "json_object"}})["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning_content": "Two and two.", "content": "It is 4."}
    starts_thinking = template == R1_LIKE or fmt == "deepseek_r1"
    assert manager.samplings[0].get("grammar_after") == \
        (tok.encode("</think>", add_special_tokens=False) if starts_thinking else None)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tool_calls_are_parsed_out_of_the_answer(smollm2_tokenizer):
    tok = _with_template(smollm2_tokenizer, R1_LIKE)
    reply = ('I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
             '</tool_call>')
    route, manager = serving(tok, [reply, reply], parser="hermes", reasoning_parser="deepseek_r1")
    body = {**ASK, "tools": [WEATHER]}
    choice = chat(route, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "I need the weather."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Oslo"})] and choice["message"]["content"] is None
    chunks = chat(route, {**body, "stream": True})
    thought, content, finishes = _streamed(chunks)
    assert (thought, content, finishes[-1]) == ("I need the weather.", "", "tool_calls")
    assert [tc["function"]["name"] for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []] \
        == ["get_weather"]


def test_a_required_call_starts_the_reply_as_a_call_not_as_thinking(smollm2_tokenizer):
    tok = _with_template(smollm2_tokenizer, R1_LIKE)
    route, manager = serving(tok, ['{"city": "Oslo"}}\n</tool_call>'], parser="hermes",
                             reasoning_parser="deepseek_r1")
    choice = chat(route, {**ASK, "tools": [WEATHER], "tool_choice": "required"})["choices"][0]
    assert "reasoning_content" not in choice["message"] and choice["finish_reason"] == "tool_calls"
    assert "ebnf" in manager.samplings[0] and "grammar_after" not in manager.samplings[0]


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"messages": []}, {"add_generation_prompt": False}, "yes"])
def test_bad_chat_template_kwargs_are_400_naming_the_field(smollm2_tokenizer, kwargs):
    route, _ = serving(smollm2_tokenizer, ["x"])
    with pytest.raises(ApiError) as e:
        chat(route, {**ASK, "chat_template_kwargs": kwargs})
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"


def test_the_responses_api_returns_the_thinking_as_a_reasoning_item(smollm2_tokenizer):
    import asyncio

    from tokenizer_proc.responses_api import ResponsesServing

    tok = _with_template(smollm2_tokenizer, QWEN3_LIKE)
    route, _ = serving(tok, [REPLY, REPLY], reasoning_parser="qwen3", step=3)
    responses = ResponsesServing(route)
    r = asyncio.run(responses.create({"input": "2 + 2?"}))
    assert [(o["type"], o["content"][0]["text"]) for o in r["output"]] == [
        ("reasoning", "\nTwo and two.\n"), ("message", "It is 4.")]

    async def events():
        stream = await responses.create({"input": "2 + 2?", "stream": True})
        return [json.loads(e.decode().removeprefix("data: ")) async for e in stream.body_iterator]

    got = asyncio.run(events())
    assert "".join(e["delta"] for e in got if e["type"] == "response.reasoning_text.delta") == "\nTwo and two.\n"
    assert "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta") == "It is 4."
    assert [o["type"] for o in got[-1]["response"]["output"]] == ["reasoning", "message"]
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [0, 1]


def test_usage_counts_the_thinking_tokens(smollm2_tokenizer):
    import asyncio

    from tokenizer_proc.responses_api import ResponsesServing

    tok = _with_template(smollm2_tokenizer, QWEN3_LIKE)
    thinking = len(tok.encode("<think>\nTwo and two.\n</think>", add_special_tokens=False))
    route, _ = serving(tok, [REPLY, REPLY, REPLY, "It is 4."], reasoning_parser="qwen3")
    usage = chat(route, ASK)["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == thinking < usage["completion_tokens"]
    streamed = chat(route, {**ASK, "stream": True, "stream_options": {"include_usage": True}})[-1]["usage"]
    assert streamed["completion_tokens_details"]["reasoning_tokens"] == thinking
    r = asyncio.run(ResponsesServing(route).create({"input": "2 + 2?"}))
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking
    plain = chat(route, {**ASK, "chat_template_kwargs": {"enable_thinking": False}})["usage"]
    assert plain["completion_tokens_details"]["reasoning_tokens"] == 0
