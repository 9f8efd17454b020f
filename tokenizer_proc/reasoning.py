"""Reasoning models' replies split into their thinking and their answer (`--reasoning-parser`).

Models such as DeepSeek-R1, QwQ and Qwen3 think first, inside <think> ... </think>, then answer.
The chat route returns the thinking as `reasoning_content` beside the answer's `content` (the
DeepSeek API's fields, which vLLM and SGLang use too), streamed or not. Whether a reply starts
inside the thinking comes from the prompt: a template that opens the block in the prompt
(DeepSeek-R1, Qwen3-Thinking) or closes it there (Qwen3 with `enable_thinking` false, DeepSeek
V3.1 without `thinking`) decides it; otherwise each format's default (R1's replies think from their
first token, Qwen3's only when they open the block themselves).

The answer's structured output (a JSON schema, a regex, ...) starts after the thinking: the worker
holds the grammar back until the reply has written the end tag's tokens (SamplingParams.grammar_after).
"""

from __future__ import annotations

from scheduler_proc.registry import Registry
from tokenizer_proc.tool_calls import tag_start_at_end

REASONING_FORMATS = Registry("reasoning parser")


class ReasoningFormat:
    start = "<think>"
    end = "</think>"
    thinks_by_default = False  # a reply starts inside the thinking when the prompt says nothing

    def thinking_at_start(self, prompt: str) -> bool:
        """Whether a reply to this prompt starts inside the thinking block."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return False
        if tail.endswith(self.start):
            return True
        return self.thinks_by_default

    def split(self, text: str, thinking: bool) -> tuple[str | None, str]:
        """(thinking, answer) of a reply's text; thinking None where the reply has none. The answer
        starts after the end tag and the whitespace after it; a reply cut inside its thinking has
        no answer yet."""
        stripped = text.lstrip()
        opens = stripped.startswith(self.start)
        if not thinking and not opens:
            return None, text
        body = stripped[len(self.start):] if opens else text
        at = body.find(self.end)
        if at < 0:
            return body, ""
        return body[:at], body[at + len(self.end):].lstrip()


@REASONING_FORMATS.register("deepseek_r1")
class DeepSeekR1(ReasoningFormat):
    """DeepSeek-R1 and its distillations: a reply thinks from its first token (the template may
    also open the block in the prompt)."""

    thinks_by_default = True


@REASONING_FORMATS.register("qwen3")
class Qwen3(ReasoningFormat):
    """Qwen3, QwQ, Qwen3-Thinking, DeepSeek V3.1 and other <think> models whose template opens or
    closes the block in the prompt (`chat_template_kwargs` such as enable_thinking); otherwise
    a reply thinks only when it opens the block itself."""


class ReasoningStream:
    """One streamed reply, fed its text as it grows: the thinking to send now, and the answer so
    far (`content`). Text that may still turn out to be a tag (or the whitespace the answer
    drops) is kept back until what follows decides it, so the pieces sent add up to `split`'s."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool):
        self.fmt, self.thinking = fmt, thinking
        self.reasoning_sent = 0
        self.content = ""

    def feed(self, text: str, final: bool) -> str:
        """The thinking to send for the reply's text so far; `content` moves on with the answer."""
        fmt = self.fmt
        if not final and fmt.start.startswith(text.lstrip()):  # (nothing yet, or an open tag being written)
            return ""
        reasoning, content = fmt.split(text, self.thinking)
        if reasoning is None:
            self.content = content
            return ""
        if not final and not content:
            if fmt.end not in text:  # the thinking's end may be a tag being written
                reasoning = reasoning[:len(reasoning) - tag_start_at_end(reasoning, fmt.end)]
        else:
            self.content = content
        delta = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return delta
