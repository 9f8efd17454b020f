"""The chat route with the model's replies scripted: an OpenAIServing over a stand-in for the
TokenizerManager, each request's reply the next script line, streamed a few characters a result."""

from __future__ import annotations

import asyncio
import json

from tokenizer_proc.openai_api import OpenAIServing


class ScriptedManager:
    """What OpenAIServing asks of a TokenizerManager."""

    max_prompt_chars = None

    def __init__(self, tokenizer, replies: list[str], step: int = 4):
        self.tokenizer, self.replies, self.prompts, self.samplings = tokenizer, list(replies), [], []
        self.step = step  # characters a streamed result adds

    def check_vocabulary(self, ids, field):
        return ids

    def ensure_capacity(self, n):
        pass

    def check_request(self, sampling, **kwargs):
        pass

    def _results(self, ids, sampling):
        self.prompts.append(self.tokenizer.decode(ids))
        self.samplings.append(sampling)
        text = self.replies.pop(0)
        ends = list(range(self.step, len(text), self.step)) + [len(text)]
        for n in ends:
            yield {"text": text[:n], "output_ids": self.tokenizer.encode(text[:n], add_special_tokens=False),
                   "meta_info": {"finish_reason": {"type": "stop"} if n == len(text) else None,
                                 "completion_tokens": len(self.tokenizer.encode(text[:n], add_special_tokens=False)),
                                 "cached_tokens": 0, "output_token_logprobs": [], "output_top_logprobs": []}}

    async def generate(self, input_ids, sampling, stream=False, prefill_group=None, routed_dp_rank=None):
        for out in self._results(input_ids, sampling):
            yield out

    async def generate_final(self, input_ids, sampling, prefill_group=None, routed_dp_rank=None):
        return list(self._results(input_ids, sampling))[-1]


def chat(serving: OpenAIServing, body: dict):
    """The route's reply: the chat.completion dict, or a stream's chunks (decoded)."""
    async def run():
        response = await serving.chat(body)
        if isinstance(response, dict):
            return response
        chunks = []
        async for item in response.body_iterator:
            data = (item.decode() if isinstance(item, bytes) else item).removeprefix("data: ").strip()
            if data != "[DONE]":
                chunks.append(json.loads(data))
        return chunks

    return asyncio.run(run())


def serving(tokenizer, replies, parser="auto", reasoning_parser=None, step=4, sampling_defaults=None):
    manager = ScriptedManager(tokenizer, replies, step)
    return OpenAIServing(manager, "m", 2048, parser, reasoning_parser, sampling_defaults), manager
