"""Structured output: grammars that decide which tokens a request may sample next (xgrammar).

A request's SamplingParams may name a grammar (`SamplingParams.grammar`: a JSON schema, any JSON
object, a regular expression, an EBNF grammar, or a list of choices). The tokenizer process checks
it with `check_grammar` before the request starts, so a bad one is a 400 naming the field; the
sampling worker compiles it against the model's vocabulary (`GrammarMasks`, once per grammar text)
and, every step, masks each token the grammar forbids next before the sampler sees the logits.
Once the grammar is complete only the end-of-sequence tokens remain, so the request stops there.

A request's matcher follows the output tokens the worker is fed (each the step after it is
sampled, or again in a re-prefill after a retraction): the record the penalties keep, so it stays
right across retractions, prefix-cache hits and overlap scheduling with no round trip to the
scheduler. A grammar may start later in the output (`SamplingParams.grammar_after`: after a reasoning
model's end-of-thinking tag): the row is free until the record holds those tokens, and the matcher
then follows the tokens after them. JSON is generated compact (no free whitespace between tokens: a small model let to
choose may write whitespace until its tokens run out).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections import OrderedDict

import numpy as np
import torch

log = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 65536  # of a schema, pattern or grammar
MAX_CHOICES = 1024
# A JSON schema's compile time grows fast with its nesting and with the properties no `required`
# names (AMX Xeon: arrays 128 deep 0.3 s, 256 deep 2.2 s, 900 deep 89 s; 800 optional properties of
# one object 0.8 s, 2,400 of them 22 s), and it runs in the worker's step: bounds far above real
# schemas, where a compile takes ~0.1 s
MAX_SCHEMA_NESTING = 64  # JSON levels of the schema document
MAX_OPTIONAL_PROPERTIES = 256  # over the whole schema
COMPILED_CACHE = 256  # compiled grammars kept, least recently used dropped first
_ANY_OBJECT = '{"type": "object"}'


# xgrammar writes the characters of a length-bounded JSON string as this class, which lets control
# characters through (a tab in a string: JSON that json.loads refuses); JSON's own class instead
_LOOSE_STRING_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARACTER = '[^\\0-\\x1f\\"\\\\]'


def json_schema_grammar(schema: str, strict: bool = True):
    """The xgrammar Grammar of a JSON schema's text: compact JSON, and with `strict` no properties
    or items the schema does not name."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _LOOSE_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def end_of_run(tokens: list[int], run: list[int], start: int = 0) -> int | None:
    """Where the first occurrence of `run` in `tokens` at or after `start` ends (None: none yet):
    a reasoning model's end-of-thinking tag in its output."""
    n = len(run)
    for i in range(start, len(tokens) - n + 1):
        if tokens[i:i + n] == run:
            return i + n
    return None


def build_grammar(kind: str, text: str):
    """The xgrammar Grammar of a SamplingParams.grammar (kind, text); raises on a bad one."""
    import xgrammar as xgr

    if kind == "json_schema":
        return json_schema_grammar(text)
    if kind == "json_object":  # any object: properties the schema does not name are allowed
        return json_schema_grammar(_ANY_OBJECT, strict=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "ebnf":
        return xgr.Grammar.from_ebnf(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def check_grammar(params) -> str | None:
    """Why a request's structured output cannot be used (None: it can, or it asks for none)."""
    asked = params.structured_fields
    if not asked:
        return None
    if len(asked) > 1:
        return f"{' and '.join(asked)}: a request takes one kind of structured output"
    name = asked[0]
    if name == "choice":
        if len(params.choice) > MAX_CHOICES or not all(params.choice):
            return f"choice takes 1 to {MAX_CHOICES} non-empty strings"
    return _grammar_problem(name, *params.grammar)


@functools.lru_cache(maxsize=256)  # (the n choices of a request, a client repeating its schema)
def _grammar_problem(name: str, kind: str, text: str) -> str | None:
    if len(text) > MAX_GRAMMAR_CHARS:
        return f"{name} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}"
    if kind == "json_schema":
        problem = schema_problem(text)
        if problem is not None:
            return f"{name} {problem}"
    try:
        build_grammar(kind, text)
    except Exception as e:  # xgrammar's errors are RuntimeErrors carrying the parser's message
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
        return f"{name} is not valid: {message[:300]}"
    return None


def schema_problem(schema) -> str | None:
    """Why a JSON schema (its text or the decoded value) would take too long to compile."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            return f"is nested more than {MAX_SCHEMA_NESTING} levels deep"
        except ValueError:
            return None  # (xgrammar names the error)
    optional, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_NESTING:
            return f"is nested more than {MAX_SCHEMA_NESTING} levels deep"
        if isinstance(value, dict):
            properties, required = value.get("properties"), value.get("required")
            if isinstance(properties, dict):
                optional += len(set(properties) - set(required if isinstance(required, list) else []))
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    if optional > MAX_OPTIONAL_PROPERTIES:
        return f"has {optional} optional properties (not in `required`); at most {MAX_OPTIONAL_PROPERTIES}"
    return None


class GrammarMasks:
    """The sampling worker's grammars: compiled ones by their text, one matcher per request slot
    that has sampled under one, and each slot's output tokens since its request started."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.outputs: dict[int, list[int]] = {}  # slot -> its request's output tokens fed so far
        self.matchers: dict[int, list] = {}  # slot -> [matcher, tokens it has accepted, grammar, its start]
        self.starts: dict[int, tuple[int, int | None]] = {}  # slot -> (tokens searched, grammar start) (grammar_after)
        self._mask: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return bool(self.outputs or self.matchers)

    def reset(self, slots) -> None:
        """Requests (re)start in `slots`: their records and matchers go."""
        for slot in slots:
            self.outputs.pop(slot, None)
            self.matchers.pop(slot, None)
            self.starts.pop(slot, None)

    def record(self, slots: list[int], tokens: list[int]) -> None:
        """Output tokens fed this step, in order: tokens[i] to slots[i]."""
        for slot, token in zip(slots, tokens):
            self.outputs.setdefault(slot, []).append(token)

    def masks(self, params: list, slots, output_lens: list[int],
              ahead: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]] | None:
        """The step's token bitmask ([rows, vocab / 32] int32) and the rows it constrains; None
        when no row has a grammar to follow. `ahead`: per row, the speculative drafts before its
        position (not on the record yet): the matcher takes them in for the row's mask, then
        back; a row after a draft the grammar refuses is left free (that draft cannot be kept)."""
        rows = [i for i, p in enumerate(params) if p.has_grammar]
        if not rows:
            return None
        import xgrammar as xgr

        if self._mask is None or self._mask.shape[0] < len(params):
            self._mask = xgr.allocate_token_bitmask(max(len(params), 64), self.vocab_size)
        constrained = []
        for i in rows:
            matcher = self._matcher(int(slots[i]), params[i].grammar, output_lens[i], params[i].grammar_after)
            if matcher is None or matcher.is_terminated():
                continue
            drafts = ahead[i] if ahead else ()
            taken = 0
            for token in drafts:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                taken += 1
            if taken == len(drafts) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(self._mask, i)
                constrained.append(i)
            if taken:
                matcher.rollback(taken)
        return (self._mask, constrained) if constrained else None

    @staticmethod
    def apply(logits: torch.Tensor, masks: tuple[torch.Tensor, list[int]]) -> None:
        """-inf, in place, on the tokens each constrained row may not take. (The bits unpacked by
        numpy and one masked fill: 4 ms for 64 rows where xgrammar's CPU path took 21.)"""
        mask, rows = masks
        every = len(rows) == logits.shape[0]
        bits = (mask[: len(rows)] if every else mask[rows]).numpy().view(np.uint8)
        allowed = np.unpackbits(bits, axis=1, bitorder="little")[:, : logits.shape[-1]]
        forbidden = torch.from_numpy(allowed).view(torch.bool).logical_not_()
        if every:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))

    def _matcher(self, slot: int, grammar: tuple[str, str], output_len: int, after: list[int]):
        """The slot's matcher, caught up with the output its request has been fed (None: the row is
        free, its grammar not started yet)."""
        import xgrammar as xgr

        outputs = self.outputs.get(slot, [])
        if len(outputs) != output_len:  # (would be a bug: the record must hold every output token)
            log.warning("grammar: slot %d has %d output tokens on record, its request %d; left unconstrained",
                        slot, len(outputs), output_len)
            return None
        start = self._start(slot, outputs, after) if after else 0
        if start is None:
            return None
        state = self.matchers.get(slot)
        if state is None or state[2] != grammar or state[3] != start or state[1] > output_len:
            compiled = self._compile(grammar)
            if compiled is None:
                return None
            state = self.matchers[slot] = [xgr.GrammarMatcher(compiled), start, grammar, start]
        matcher = state[0]
        for token in outputs[state[1]:]:
            if not matcher.is_terminated() and not matcher.accept_token(token):
                log.warning("grammar: slot %d sampled token %d, which its grammar forbids", slot, token)
        state[1] = len(outputs)
        return matcher

    def _start(self, slot: int, outputs: list[int], after: list[int]) -> int | None:
        """Where the slot's grammar starts: after the output's first run of `after` (None: not
        written yet). Each step searches only the tokens new since the last."""
        searched, start = self.starts.get(slot, (0, None))
        if searched > len(outputs):  # (a shorter record: its request restarted)
            searched, start = 0, None
        if start is None:
            start = end_of_run(outputs, after, max(0, searched - len(after) + 1))
            self.starts[slot] = (len(outputs), start)
        return start

    def _compile(self, grammar: tuple[str, str]):
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        try:
            compiled = self.compiler.compile_grammar(build_grammar(*grammar))
        except Exception as e:  # (checked before the request started: not expected)
            log.error("grammar: %s failed to compile (%s); its request runs unconstrained", grammar[0], e)
            return None
        self._compiled[grammar] = compiled
        if len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return compiled

    @property
    def compiler(self):
        """xgrammar's compiler over the model's vocabulary (loaded at the first grammar)."""
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            log.info("structured output: loading the tokenizer's vocabulary for grammars")
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler
