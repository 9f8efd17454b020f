"""The Responses API's request and store (tokenizer_proc/responses_api.py), the model's replies
scripted; the routes through the SDK are in test_openai_api.py."""

from __future__ import annotations

import asyncio

import pytest

from scripted_chat import serving
from tokenizer_proc import responses_api
from tokenizer_proc.openai_api import ApiError
from tokenizer_proc.responses_api import ResponsesServing


def test_input_items_become_the_chat_conversation(smollm2_tokenizer):
    route, manager = serving(smollm2_tokenizer, ["Done."])
    responses = ResponsesServing(route)
    items = [{"role": "user", "content": "Weather in Oslo and Rome?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": {"sky": "rain"}},
             {"type": "reasoning", "summary": []}]
    messages = responses._conversation({"input": items, "instructions": "Be brief."})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]  # (one reply's calls: one message)
    assert messages[4]["content"] == '{"sky": "rain"}'
    r = asyncio.run(responses.create({"input": items}))
    assert r["output"][0]["content"][0]["text"] == "Done." and "sunny" in manager.prompts[0]


def test_the_store_keeps_the_latest_within_its_bounds(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(responses_api, "MAX_STORED", 2)
    route, manager = serving(smollm2_tokenizer, ["One.", "Two.", "Three.", "Four."])
    responses = ResponsesServing(route)
    ids = [asyncio.run(responses.create({"input": f"Say {n}."}))["id"] for n in ("one", "two", "three")]
    assert list(responses.stored) == ids[1:]
    with pytest.raises(ApiError) as e:
        asyncio.run(responses.create({"input": "And?", "previous_response_id": ids[0]}))
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    asyncio.run(responses.create({"input": "And?", "previous_response_id": ids[2], "store": False}))
    assert "Say three." in manager.prompts[-1] and "Three." in manager.prompts[-1]
    assert list(responses.stored) == ids[1:] and responses.stored_chars == sum(c for *_, c in responses.stored.values())
