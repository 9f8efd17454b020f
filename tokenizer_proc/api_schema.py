"""The JSON Schemas of the HTTP request bodies, as the OpenAPI document (`/openapi.json`) shows
them. The routes read their bodies by hand (leniently, with errors that name the field), so these
schemas document what they accept; the fuzz tests generate requests from them."""

from __future__ import annotations

_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
_NUMBER = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer"}}
_TEXT = {"type": ["string", "null"]}
_CHOICES = {"type": ["array", "null"], "items": {"type": "string"}}
_SCHEMA = {"type": ["string", "object", "boolean", "null"]}

SAMPLING_PARAMS = {
    "type": "object",
    "properties": {
        "max_new_tokens": _INT, "min_new_tokens": _INT, "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT,
        "min_p": _NUMBER, "seed": _INT, "stop": _STOP, "stop_regex": _STOP,
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
        "ignore_eos": {"type": ["boolean", "null"]}, "skip_special_tokens": {"type": ["boolean", "null"]},
        "repetition_penalty": _NUMBER, "frequency_penalty": _NUMBER, "presence_penalty": _NUMBER,
        "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        "logprobs": {"type": ["boolean", "null"]}, "top_logprobs": _INT, "stream_interval": _INT,
        "json_schema": {"type": ["string", "object", "null"]}, "json_object": {"type": ["boolean", "null"]},
        "regex": _TEXT, "ebnf": _TEXT, "choice": _CHOICES, "prompt_logprobs": _INT,
        "embedding": {"type": ["boolean", "null"]},
        "grammar_after": {"type": ["array", "null"], "items": {"type": "integer"}},
    },
    "additionalProperties": False,
}

GENERATE = {
    "type": "object",
    "properties": {
        "text": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "input_ids": {"anyOf": [_TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS}]},
        "sampling_params": SAMPLING_PARAMS,
        "stream": {"type": "boolean"},
        "incremental": {"type": "boolean"},
        "rid": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "priority": {"type": "integer"},
        "routing_key": {"type": ["string", "null"]},
        "routed_dp_rank": _INT,
        # SGLang's logprob fields
        "return_logprob": {"type": ["boolean", "null"]}, "top_logprobs_num": _INT, "logprob_start_len": _INT,
    },
}

_OPENAI_SAMPLING = {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "min_p": _NUMBER, "seed": _INT, "stop": _STOP,
    "stop_regex": _STOP, "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
    "ignore_eos": {"type": ["boolean", "null"]}, "skip_special_tokens": {"type": ["boolean", "null"]},
    "min_tokens": _INT, "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
    "n": _INT, "best_of": _INT, "stream": {"type": ["boolean", "null"]}, "stream_interval": _INT,
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "model": {"type": ["string", "null"]}, "routed_dp_rank": _INT, "user": {"type": ["string", "null"]},
    # structured output: OpenAI's, vLLM's extras, SGLang's
    "response_format": {"type": ["object", "null"], "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"}, "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}}},
    "guided_json": _SCHEMA, "guided_regex": _TEXT, "guided_choice": _CHOICES, "guided_grammar": _TEXT,
    "structured_outputs": {"type": ["object", "null"], "properties": {
        "json": _SCHEMA, "regex": _TEXT, "choice": _CHOICES, "grammar": _TEXT,
        "json_object": {"type": ["boolean", "null"]}}},
    "json_schema": _SCHEMA, "regex": _TEXT, "ebnf": _TEXT, "prompt_logprobs": _INT,
}

COMPLETION = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, _TOKEN_IDS,
                             {"type": "array", "items": _TOKEN_IDS}]},
        "max_tokens": _INT, "echo": {"type": ["boolean", "null"]}, "logprobs": _INT,
        "suffix": {"type": ["string", "null"]}, **_OPENAI_SAMPLING,
    },
}

_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
    "type": "object", "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}}]}

_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "minLength": 1}, "description": {"type": ["string", "null"]},
    "parameters": {"type": ["object", "null"]}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]}, "function": _FUNCTION}}
_TOOL_CALL = {"type": "object", "required": ["type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string"}}}}}

CHAT_COMPLETION = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": _CONTENT, "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
            "tool_call_id": {"type": ["string", "null"]}, "reasoning_content": _TEXT}}},
        "max_tokens": _INT, "max_completion_tokens": _INT, "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": _INT, "tools": {"type": ["array", "null"], "items": _TOOL},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "null"},
                                  {"type": "object", "required": ["type", "function"], "properties": {
                                      "type": {"type": "string", "enum": ["function"]},
                                      "function": {"type": "object", "required": ["name"],
                                                   "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]}, "add_generation_prompt": {"type": ["boolean", "null"]},
        "chat_template_kwargs": {"type": ["object", "null"]}, "continue_final_message": {"type": ["boolean", "null"]},
        # a reasoning model's thinking (--reasoning-parser): SGLang's split switch, vLLM's keep switch
        "separate_reasoning": {"type": ["boolean", "null"]}, "include_reasoning": {"type": ["boolean", "null"]},
        **_OPENAI_SAMPLING,
    },
}

EMBEDDING = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": COMPLETION["properties"]["prompt"], "model": {"type": ["string", "null"]},
        "encoding_format": {"type": ["string", "null"], "enum": ["float", "base64", None]},
        "dimensions": _INT, "user": {"type": ["string", "null"]},
        # vLLM's extras
        "normalize": {"type": ["boolean", "null"]}, "truncate_prompt_tokens": _INT,
    },
}

_RESPONSE_ITEM = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "reasoning"]},
    "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]}, "content": _CONTENT,
    "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
    "output": {"type": "string"}}}
RESPONSE = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _RESPONSE_ITEM}]},
        "model": {"type": ["string", "null"]}, "instructions": _TEXT, "previous_response_id": _TEXT,
        "max_output_tokens": _INT, "temperature": _NUMBER, "top_p": _NUMBER, "stream": {"type": ["boolean", "null"]},
        "store": {"type": ["boolean", "null"]}, "metadata": {"type": ["object", "null"]},
        "tools": {"type": ["array", "null"], "items": {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string", "minLength": 1},
            "description": _TEXT, "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}},
        "tool_choice": {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {"type": "null"},
                                  {"type": "object", "required": ["type", "name"], "properties": {
                                      "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"}}}]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "text": {"type": ["object", "null"], "properties": {"format": {"type": "object", "required": ["type"],
                                                                       "properties": {"type": {"type": "string", "enum": [
                                                                           "text", "json_object", "json_schema"]}}}}},
        "user": _TEXT, "top_k": _INT, "min_p": _NUMBER, "seed": _INT, "repetition_penalty": _NUMBER,
    },
}

_TEXTS = EMBEDDING["properties"]["input"]
SCORE = {
    "type": "object",
    "required": ["text_1", "text_2"],
    "properties": {"text_1": _TEXTS, "text_2": _TEXTS, "model": {"type": ["string", "null"]},
                   "truncate_prompt_tokens": _INT},
}

RERANK = {
    "type": "object",
    "required": ["query", "documents"],
    "properties": {
        "query": {"type": "string"}, "model": {"type": ["string", "null"]}, "top_n": _INT,
        "documents": {"type": "array", "items": {"anyOf": [{"type": "string"}, {
            "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]}},
        "return_documents": {"type": ["boolean", "null"]}, "truncate_prompt_tokens": _INT,
    },
}

TOKENIZE = {
    "type": "object",
    "properties": {
        "prompt": {"type": "string"}, "messages": CHAT_COMPLETION["properties"]["messages"],
        "tools": CHAT_COMPLETION["properties"]["tools"], "add_generation_prompt": {"type": ["boolean", "null"]},
        "chat_template_kwargs": {"type": ["object", "null"]},
        "add_special_tokens": {"type": ["boolean", "null"]}, "return_token_strs": {"type": ["boolean", "null"]},
        "model": {"type": ["string", "null"]},
    },
}

DETOKENIZE = {
    "type": "object",
    "required": ["tokens"],
    "properties": {"tokens": _TOKEN_IDS, "skip_special_tokens": {"type": ["boolean", "null"]},
                   "model": {"type": ["string", "null"]}},
}

ABORT = {"type": "object", "properties": {"rid": {"type": "string"}, "abort_all": {"type": "boolean"}}}


def request_body(schema: dict) -> dict:
    """`openapi_extra` for a route whose JSON body follows `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
