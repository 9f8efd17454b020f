"""The OpenAI-compatible routes through the official `openai` SDK against a live server."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from test_server import Server

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-queued-requests", "40")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, model):
    assert model == "SmolLM2-135M-Instruct"


def test_chat_completion(client, model):
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_content_as_parts_and_nulls(client, model):
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=32, top_p=None, seed=None,
                                       messages=[{"role": "user", "content": [
                                           {"type": "text", "text": "What is the capital "},
                                           {"type": "text", "text": "of France?"}]}])
    assert r.choices[0].message.content == "The capital of France is Paris."


def test_streaming_chat_with_usage(client, model):
    stream = client.chat.completions.create(model=model, temperature=0, max_tokens=32, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_with_n_stop_and_length(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    full = r.choices[0].text
    word = full.split()[1]
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  stop=[word])
    assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].text
    assert full.startswith(r.choices[0].text)
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3,
                                  seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1
    echo = client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello")


def _cached_prompt_tokens_total(server) -> float:
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return next(float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("loom_cached_prompt_tokens_total "))


def test_n_choices_compute_the_prompt_once_and_a_repeat_hits_the_cache(server, client, model):
    kw = dict(model=model, prompt="Seen by this test only: the longest river in Africa is", max_tokens=8,
              temperature=0)
    before = _cached_prompt_tokens_total(server)
    r = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] == texts[2]
    # usage counts the prompt once: its first computation took nothing from a cache
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    n = r.usage.prompt_tokens
    assert _cached_prompt_tokens_total(server) - before == 2 * (n - 1)  # the other two choices took it
    again = client.completions.create(**kw)
    assert again.choices[0].text == texts[0]
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1  # all but the token it samples from
    messages = [{"role": "user", "content": "Seen by this test only: what is the capital of Peru?"}]
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8, n=3,
                                                 stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == k)
             for k in range(3)]
    assert texts[0] == texts[1] == texts[2] and texts[0]
    usage = chunks[-1].usage  # the chat template's system part is cached from earlier chats, the question is not
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens - 8
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    rate = next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith('loom_cache_hit_rate{dp_rank="0"} '))
    assert 0 < rate < 1


def test_seed_reproducibility(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_errors(server, client, model):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="8192"):
        client.completions.create(model=model, prompt="hi", max_tokens=9000)
    with pytest.raises(openai.BadRequestError, match="temperature") as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    for interval in (0, 2**70):
        with pytest.raises(openai.BadRequestError, match="stream_interval") as e:
            client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"stream_interval": interval})
        assert e.value.body["param"] == "stream_interval"
    r = httpx.post(server.url + "/v1/completions", content=b"{oops", headers={"Authorization": f"Bearer {KEY}",
                                                                              "content-type": "application/json"})
    assert r.status_code == 400
    # the server still answers after every error
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_queue_full_is_503(server, model):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                   json={"model": model, "prompt": ["a"] * 41, "max_tokens": 1})
    assert r.status_code == 503 and "max-queued-requests" in r.json()["error"]["message"]


def test_logprobs_match_hf_log_softmax(client, model, hf_smollm2, smollm2_tokenizer):
    import torch

    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    ids = smollm2_tokenizer.encode(prompt)
    with torch.inference_mode():
        out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    gen = out.sequences[0, len(ids):].tolist()
    for step, (token_id, logits) in enumerate(zip(gen, out.logits)):
        ref = torch.log_softmax(logits[0].float(), -1)
        assert abs(lp.token_logprobs[step] - ref[token_id].item()) < 1e-4
        top_ref = ref.topk(3)
        assert list(lp.top_logprobs[step].values()) == pytest.approx(top_ref.values.tolist(), abs=1e-4)
        assert lp.tokens[step] == smollm2_tokenizer.decode([token_id])


def test_chat_logprobs_streaming_and_not(client, model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content)  # + the EOS token
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob <= 0 for c in content)
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                                 logprobs=True, stream=True))
    streamed = [c for ch in chunks for c in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_stream_interval_gathers_tokens_into_fewer_chunks(client, model):
    """A request's stream_interval: its first token at once, then chunks of that many tokens (the
    last one shorter), the same text and logprobs as token by token."""
    args = dict(model=model, prompt="The capital of France is", temperature=0, max_tokens=20, logprobs=1)
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    per_chunk = {}
    for interval in (1, 6):
        chunks = [c for c in client.completions.create(**args, stream=True,
                                                       extra_body={"ignore_eos": True, "stream_interval": interval})
                  if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        lps = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        # (the repeats take the prompt from the prefix cache: float32 sums in another order)
        assert lps == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-4)
        per_chunk[interval] = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert per_chunk[1] == [1] * 20
    assert per_chunk[6] == [1, 6, 6, 6, 1]


def test_tools_through_the_sdk(client, model):
    """The SDK takes loom's function-calling replies, streamed or not (with auto, what the 135M
    model writes decides whether it called; required and named calls follow the call's grammar, so
    they come back as calls; test_tool_calls.py pins the parsing on scripted replies)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                           temperature=0, max_tokens=48)
        reply = r.choices[0]
        assert reply.finish_reason in ("stop", "length", "tool_calls")
        assert (reply.finish_reason == "tool_calls") == bool(reply.message.tool_calls)
        assert choice == "auto" or reply.finish_reason == "tool_calls"
        for call in reply.message.tool_calls or []:
            assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
        chunks = list(client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                                     temperature=0, max_tokens=48, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length", "tool_calls")
    # a conversation that carries a call and its result
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    assert client.chat.completions.create(model=model, messages=follow_up, tools=tools, max_tokens=8).usage.total_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert e.value.body["param"] == "tool_choice"


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def test_structured_output_through_the_sdk(client, model):
    """response_format (json_schema, json_object) and the vLLM / SGLang extras: every reply
    follows its grammar, streamed or not."""
    messages = [{"role": "user", "content": "Invent a person."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0.7, seed=3,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON_SCHEMA, "strict": True}})
    person = json.loads(r.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0, stream=True,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), dict)
    for extra in ({"guided_choice": ["left", "right"]}, {"structured_outputs": {"choice": ["left", "right"]}}):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick a side."}],
                                           max_tokens=8, temperature=1.0, n=3, extra_body=extra)
        assert all(c.message.content in ("left", "right") for c in r.choices)
    r = client.completions.create(model=model, prompt="Call me at", max_tokens=24, temperature=1.0,
                                  extra_body={"regex": r"\+1 \d{3} \d{3} \d{4}"})
    assert re.fullmatch(r"\+1 \d{3} \d{3} \d{4}", r.choices[0].text)


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": "left"}, "guided_choice"),
    ({"guided_json": PERSON_SCHEMA, "guided_regex": "a+"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= b"}}, "structured_outputs.grammar"),
])
def test_bad_structured_output_is_a_400_naming_the_field(client, model, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body=extra)
    assert e.value.body["param"] == field, e.value.body


def test_tokenize_and_detokenize(server, client, model, smollm2_tokenizer):
    """vLLM's /tokenize (a prompt, or chat messages as the chat route renders them) and
    /detokenize."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        r = http.post("/tokenize", json={"model": model, "prompt": "The capital of France", "return_token_strs": True})
        assert r.status_code == 200, r.text
        ids = smollm2_tokenizer.encode("The capital of France")
        assert r.json()["tokens"] == ids and r.json()["count"] == len(ids) and r.json()["max_model_len"] > 0
        assert "".join(r.json()["token_strs"]).replace("Ġ", " ") == "The capital of France"
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        assert http.post("/tokenize", json={"messages": messages}).json()["count"] == chat.usage.prompt_tokens
        fewer = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["count"]
        assert fewer < chat.usage.prompt_tokens
        r = http.post("/detokenize", json={"model": model, "tokens": ids})
        assert r.json() == {"prompt": "The capital of France", "text": "The capital of France"}
        for route, body, field in (("/detokenize", {"tokens": [1, -5]}, "tokens"), ("/detokenize", {}, "tokens"),
                                   ("/tokenize", {"prompt": 7}, "prompt"), ("/tokenize", {}, "prompt")):
            r = http.post(route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_prompt_logprobs_for_loglikelihood(client, model, server, hf_smollm2, smollm2_tokenizer):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) and vLLM's prompt_logprobs:
    the prompt tokens' logprobs, as HF's log_softmax gives them (the server here runs bfloat16 or
    float32 as the CPU's probe chose: a loose tolerance)."""
    import torch

    prompt = "The capital of France is Paris"
    ids = smollm2_tokenizer.encode(prompt)
    with torch.no_grad():
        want = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    want = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.choices[0].finish_reason == "length"
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) and "".join(lp.tokens) == prompt
    assert all(abs(a - b) < 0.25 for a, b in zip(lp.token_logprobs[1:], want)), (lp.token_logprobs, want)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:]) and lp.top_logprobs[0] is None
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    entries = r.model_extra["choices"][0]["prompt_logprobs"] if "choices" in r.model_extra else \
        r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for entry, tid, lp in zip(entries[1:], ids[1:], lp.token_logprobs[1:]):
        assert abs(entry[str(tid)]["logprob"] - lp) < 1e-3 and 2 <= len(entry) <= 3
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=1, stream=True)
    assert e.value.body["param"] == "stream"


def test_embeddings_through_the_sdk(server, client, model):
    texts = ["The capital of France is Paris.", "Paris is the capital of France.", "Turtles swim slowly."]
    r = client.embeddings.create(model=model, input=texts)  # (the SDK asks for base64 and decodes it)
    vectors = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(len(v) == 576 for v in vectors)
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    similarity = [sum(a * b for a, b in zip(vectors[0], v)) for v in vectors[1:]]
    assert similarity[0] > similarity[1]  # (the paraphrase is nearer than the turtles)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    floats = httpx.post(server.url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"input": texts[0], "encoding_format": "float", "dimensions": 64}).json()
    short = floats["data"][0]["embedding"]
    assert len(short) == 64 and abs(sum(x * x for x in short) - 1) < 1e-4
    head = vectors[0][:64]
    assert max(abs(a - b / sum(x * x for x in head) ** 0.5) for a, b in zip(short, head)) < 1e-4
    ids = client.embeddings.create(model=model, input=[[1, 2, 3, 4]]).data[0].embedding
    assert len(ids) == 576


@pytest.mark.parametrize("body,field", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [1, "a"]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"), ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 100000}, "dimensions"), ({"input": [[99999999]]}, "input"),
])
def test_bad_embeddings_requests_are_a_400_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_score_and_rerank_by_embedding_similarity(server, client, model):
    auth = {"Authorization": f"Bearer {KEY}"}
    docs = ["Turtles swim slowly.", "Paris is the capital of France.", "The capital of France is Paris."]
    vectors = [d.embedding for d in client.embeddings.create(model=model, input=docs).data]
    cosine = [sum(a * b for a, b in zip(vectors[2], v)) for v in vectors]
    r = httpx.post(server.url + "/score", headers=auth, timeout=60, json={"text_1": docs[2], "text_2": docs}).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["usage"]["prompt_tokens"] > 0
    assert max(abs(d["score"] - c) for d, c in zip(r["data"], cosine)) < 1e-4 and abs(cosine[2] - 1) < 1e-4
    pairs = httpx.post(server.url + "/v1/score", headers=auth, timeout=60,
                       json={"text_1": docs[:2], "text_2": docs[1:]}).json()
    assert abs(pairs["data"][1]["score"] - cosine[1]) < 1e-4
    ranked = httpx.post(server.url + "/v1/rerank", headers=auth, timeout=60,
                        json={"query": docs[2], "documents": docs, "top_n": 2}).json()["results"]
    assert [x["index"] for x in ranked] == sorted(range(3), key=lambda i: -cosine[i])[:2]
    assert ranked[0]["document"] == {"text": docs[2]} and ranked[0]["relevance_score"] >= ranked[1]["relevance_score"]
    bad = httpx.post(server.url + "/rerank", headers=auth, timeout=60, json={"query": "q", "documents": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    bad = httpx.post(server.url + "/score", headers=auth, timeout=60,
                     json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_responses_through_the_sdk(server, client, model):
    r = client.responses.create(model=model, input="What is the capital of France?", instructions="You are a helpful assistant.",
                                max_output_tokens=32, temperature=0)
    assert r.status == "completed" and r.output_text == "The capital of France is Paris."
    assert r.output[0].type == "message" and r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    # the conversation goes on from the stored response
    more = client.responses.create(model=model, input="And of Italy?", previous_response_id=r.id,
                                   max_output_tokens=32, temperature=0)
    assert more.output_text and more.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text
    # streamed: the events add up to the same text, and end with the whole response
    events = list(client.responses.create(model=model, input="What is the capital of France?",
                                          instructions="You are a helpful assistant.", max_output_tokens=32,
                                          temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    cut = client.responses.create(model=model, input="Tell me a story.", max_output_tokens=4)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_responses_with_tools_and_a_schema(server, client, model):
    weather = {"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                              "required": ["city"]}}
    r = client.responses.create(model=model, input="Weather in Paris?", tools=[weather], tool_choice="required",
                                max_output_tokens=48, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    answer = client.responses.create(model=model, previous_response_id=r.id, tools=[weather], max_output_tokens=16,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny, 21 C"}])
    assert answer.status in ("completed", "incomplete")
    events = list(client.responses.create(model=model, input="Weather in Paris?", tools=[weather],
                                          tool_choice="required", max_output_tokens=48, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="Invent a person.", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "person", "schema": person}})
    assert set(json.loads(r.output_text)) == {"name"}


@pytest.mark.parametrize("body,field", [
    ({"input": []}, "input"), ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
])
def test_bad_responses_requests_name_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == field, r.text
