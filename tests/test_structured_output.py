"""Structured output (worker_proc/grammar.py): the checks a request's grammar gets before it
starts, the worker's masks, and whole runs whose outputs must match their grammars through
chunked prompts, retractions and prefix-cache hits (in-process: SchedulerCore + ModelRunner on
the embedded model)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from inproc import run_to_completion
from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req
from tokenizer_proc.manager import RequestError, parse_sampling_params
from worker_proc.grammar import GrammarMasks, check_grammar

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_choices_become_a_grammar_of_their_literals():
    kind, text = SamplingParams(choice=['say "hi"', "back\\slash", "ünï"]).grammar
    assert kind == "ebnf" and text == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "ünï"'
    assert check_grammar(SamplingParams(choice=['say "hi"', "back\\slash", "ünï", "tab\t\x01"])) is None
    assert SamplingParams().grammar is None and not SamplingParams().uses_token_history
    assert SamplingParams(regex="a+").uses_token_history  # (the worker records its outputs)


@pytest.mark.parametrize("fields, message", [
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema is not valid: Unsupported type"),
    ({"json_schema": "[1, 2]"}, "json_schema is not valid"),
    ({"json_schema": "{not json"}, "json_schema is not valid"),
    ({"regex": "(ab"}, "regex is not valid"),
    ({"ebnf": 'root ::= "a" | b'}, "ebnf is not valid: EBNF parser error"),
    ({"ebnf": "x" * 70000}, "ebnf has 70000 characters"),
    ({"choice": ["a", ""]}, "choice takes 1 to"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex and ebnf: a request takes one kind"),
    # schemas whose compile would stall the worker's step
    ({"json_schema": '{"type": "array", "items": ' * 70 + "{}" + "}" * 70}, "json_schema is nested more than 64"),
    ({"json_schema": json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}})},
     "json_schema has 300 optional properties"),
])
def test_bad_grammars_are_refused_with_the_field_named(fields, message):
    problem = check_grammar(SamplingParams(**fields))
    assert problem is not None and problem.startswith(message), problem
    assert not re.search(r"\.cc:\d+", problem)  # (xgrammar's source location is cut)
    with pytest.raises(RequestError, match=re.escape(message[:20])):
        parse_sampling_params(fields)


def test_json_strings_take_no_control_characters():
    """xgrammar's length-bounded strings let a tab through, which json.loads refuses; loom's
    grammar of a schema keeps JSON's string characters."""
    from xgrammar.testing import _is_grammar_accept_string

    from worker_proc.grammar import build_grammar

    for schema in ({"type": "string", "maxLength": 8}, {"type": "string"}, PERSON):
        grammar = build_grammar("json_schema", json.dumps(schema))
        good = '"ab c"' if schema.get("type") == "string" else '{"name": "ab c", "age": 3}'
        assert _is_grammar_accept_string(grammar, good)
        assert not _is_grammar_accept_string(grammar, good.replace("ab c", "ab\tc"))


def test_a_schema_may_come_as_an_object():
    sp = parse_sampling_params({"json_schema": PERSON})
    assert json.loads(sp.json_schema) == PERSON


@pytest.fixture(scope="module")
def runner(default_model_dir):
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(str(default_model_dir), torch.float32, kv_cache_gb=0.05, max_running_requests=4,
                                    eos_token_ids=(2,)))


def test_masks_allow_exactly_what_the_grammar_allows(runner, smollm2_tokenizer):
    masks = GrammarMasks(runner.grammars.model_dir, 49152, (2,))
    params = [SamplingParams(), SamplingParams(choice=["yes", "no"]), SamplingParams(regex="[0-9]{2}")]
    bitmask, rows = masks.masks(params, [0, 1, 2], [0, 0, 0])
    assert rows == [1, 2]
    logits = torch.zeros(3, 49152)
    masks.apply(logits, (bitmask, rows))
    assert torch.isfinite(logits[0]).all()  # (a free row is left as it is)
    allowed = [smollm2_tokenizer.decode([t]) for t in torch.isfinite(logits[1]).nonzero().flatten().tolist()]
    assert set(allowed) and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    digits = [smollm2_tokenizer.decode([t]) for t in torch.isfinite(logits[2]).nonzero().flatten().tolist()]
    assert set(digits) == {str(d) for d in range(10)}
    # the slot's record moves its matcher on: after "7" one digit, then only the end
    seven = smollm2_tokenizer.convert_tokens_to_ids("7")
    masks.record([2], [seven])
    bitmask, rows = masks.masks(params[2:], [2], [1])
    logits = torch.zeros(1, 49152)
    masks.apply(logits, (bitmask, rows))
    assert {smollm2_tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()} \
        == {str(d) for d in range(10)}
    masks.record([2], [seven])
    bitmask, rows = masks.masks(params[2:], [2], [2])
    logits = torch.zeros(1, 49152)
    masks.apply(logits, (bitmask, rows))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2]
    # a new request in the slot starts over (and a record that misses tokens leaves the row free)
    masks.reset([2])
    assert masks.masks(params[2:], [2], [1]) is None


def _run(runner, reqs, core: SchedulerCore) -> SchedulerCore:
    def records_hold_the_output(batch):  # the worker's record of each constrained request is its output so far
        for row in batch.rows:
            if row.samples and row.req.sampling.has_grammar:
                assert runner.grammars.outputs.get(row.req.req_pool_idx, []) == \
                    row.req.output_ids[: row.output_index], row.req.rid

    return run_to_completion(runner, core, reqs, records_hold_the_output)


@pytest.mark.parametrize("radix_cache", [False, True])
def test_outputs_follow_their_grammars_through_retractions_and_chunks(runner, smollm2_tokenizer, radix_cache):
    """Four sampled requests in a pool too small for them all: they are retracted and re-prefilled
    (in chunks; with the prefix cache, from their cached prompt and output) and each output still
    matches its grammar to the end."""
    tok = smollm2_tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{topic}, in JSON please."}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for topic in ("Describe a person", "Name a colour", "Spell a long word", "Give phone numbers")]
    grammars = [{"json_schema": json.dumps(PERSON)}, {"regex": "[0-9]{40}"}, {"choice": ["red", "green", "blue"]},
                {"regex": "([0-9]{3}-){12}"}]
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=60, temperature=1.0, seed=i, **g))
            for i, (p, g) in enumerate(zip(prompts, grammars))]
    core = _run(runner, reqs, SchedulerCore(SchedulerConfig(max_total_tokens=sum(map(len, prompts[:3])) + 6, max_running_requests=4,
                                              max_prefill_tokens=16, chunked_prefill_size=16, max_context_len=512,
                                              init_new_token_ratio=0.0, min_new_token_ratio=0.0,
                                              eos_token_ids=(2,), enable_radix_cache=radix_cache)))
    assert core.num_retractions > 0
    texts = [tok.decode(r.output_ids, skip_special_tokens=True) for r in reqs]
    assert all(r.finish.type == "stop" and r.output_ids[-1] == 2 for r in reqs), [r.finish for r in reqs]
    person = json.loads(texts[0])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 12
    assert re.fullmatch("[0-9]{40}", texts[1]) and texts[2] in ("red", "green", "blue")
    assert re.fullmatch("([0-9]{3}-){12}", texts[3])


def test_a_prefix_cache_hit_and_greedy_rows(runner, smollm2_tokenizer):
    """The same prompt twice (the second starts on the first's cached KV), greedy: the grammar
    steers the argmax, and a free request beside them is unchanged."""
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Is water wet? Answer yes or no."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    core = SchedulerCore(SchedulerConfig(max_total_tokens=2000, max_running_requests=4, max_prefill_tokens=512,
                                         max_context_len=512, eos_token_ids=(2,)))
    free = Req("free", list(prompt), SamplingParams(max_new_tokens=12, temperature=0.0))
    first = Req("a", list(prompt), SamplingParams(max_new_tokens=12, temperature=0.0, choice=["Maybe", "Perhaps"]))
    _run(runner, [free, first], core)
    second = Req("b", list(prompt), SamplingParams(max_new_tokens=12, temperature=0.0, regex="(Maybe|Perhaps)!"))
    alone = Req("alone", list(prompt), SamplingParams(max_new_tokens=12, temperature=0.0))
    _run(runner, [second, alone], core)
    assert second.cached_tokens > 0
    assert tok.decode(first.output_ids, skip_special_tokens=True) in ("Maybe", "Perhaps")
    assert re.fullmatch("(Maybe|Perhaps)!", tok.decode(second.output_ids, skip_special_tokens=True))
    assert free.output_ids == alone.output_ids and not tok.decode(free.output_ids).startswith(("Maybe", "Perhaps"))
    assert core.num_retractions == 0


def test_a_prefix_table_restores_the_output_on_record(runner):
    """A re-prefill that starts on its own cached prompt and output (the prefix cache kept them
    when it was retracted): the record starts from the table's output tokens."""
    from types import SimpleNamespace

    from ipc.messages import PrefixTable

    prompt, output = [5, 6, 7, 8], [11, 12, 13]
    tokens = np.asarray(prompt + output, dtype=np.int32)
    batch = SimpleNamespace(req_pool_indices=[3], prompt_lens=[len(prompt)], prefix_tables=[
        PrefixTable(3, np.arange(7, dtype=np.int32).tobytes(), tokens.tobytes())])
    runner.grammars.record([3], [99])  # (what an earlier request in the slot left)
    runner._apply_prefix_tables(batch, None)
    assert runner.grammars.outputs[3] == output
    runner.grammars.reset([3])


def test_a_grammar_ends_the_output_before_min_new_tokens(runner, smollm2_tokenizer):
    """min_new_tokens does not hold a request past its grammar's end (which allows only EOS)."""
    req = Req("short", smollm2_tokenizer.encode("Say yes:"),
              SamplingParams(choice=["yes", "no"], min_new_tokens=5, max_new_tokens=10, temperature=0.0))
    run_to_completion(runner, SchedulerCore(SchedulerConfig(max_total_tokens=500, max_running_requests=4,
                                                            max_prefill_tokens=64, max_context_len=512,
                                                            eos_token_ids=(2,))), [req])
    assert req.finish.type == "stop" and req.output_ids[-1] == 2
    assert smollm2_tokenizer.decode(req.output_ids[:-1]) in ("yes", "no")


def test_a_grammar_after_a_tag_starts_once_the_tag_is_written(smollm2_tokenizer):
    """grammar_after (a reasoning model's end of thinking): the row is free until the output holds
    the tag's tokens, even written across two steps, and then follows the grammar from there."""
    masks = GrammarMasks("unused", 49152, (2,))
    masks._compiler = _compiler(smollm2_tokenizer)
    tag = [11, 12]
    params = [SamplingParams(regex="[0-9]{2}", grammar_after=tag)]
    outputs = [5, 11, 7, 12, 11]  # (11 alone, then 12 without 11 before it, then the tag's first token)
    for n, token in enumerate(outputs, 1):
        masks.record([0], [token])
        assert masks.masks(params, [0], [n]) is None
    masks.record([0], [12])
    bitmask, rows = masks.masks(params, [0], [6])
    logits = torch.zeros(1, 49152)
    masks.apply(logits, (bitmask, rows))
    assert {smollm2_tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()} \
        == {str(d) for d in range(10)}
    # a second tag does not start it over; a restarted request searches afresh
    seven = smollm2_tokenizer.convert_tokens_to_ids("7")
    masks.record([0], [seven])
    assert masks.matchers[0][3] == 6 and masks.masks(params, [0], [7]) is not None
    masks.reset([0])
    masks.record([0], [seven])
    assert masks.masks(params, [0], [1]) is None


def _compiler(tokenizer):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2]))


def test_a_run_answers_by_the_grammar_after_its_tag(runner, smollm2_tokenizer):
    """Greedy, the tag's token pushed up by logit_bias: the tag comes first (the grammar not yet
    applying), then the grammar forbids it and the digits follow, then EOS."""
    tok = smollm2_tokenizer
    bang = tok.convert_tokens_to_ids("!")
    req = Req("r", tok.encode("Count:"), SamplingParams(max_new_tokens=12, temperature=0.0, logit_bias={bang: 100.0},
                                                        regex="[0-9]{4}", grammar_after=[bang]))
    free = Req("free", tok.encode("Count:"), SamplingParams(max_new_tokens=3, temperature=0.0, logit_bias={bang: 100.0}))
    run_to_completion(runner, SchedulerCore(SchedulerConfig(max_total_tokens=500, max_running_requests=4,
                                                            max_prefill_tokens=64, max_context_len=512,
                                                            eos_token_ids=(2,))), [req, free])
    assert free.output_ids == [bang] * 3
    assert req.output_ids[0] == bang and req.output_ids[-1] == 2 and req.finish.type == "stop"
    assert re.fullmatch("[0-9]{4}", tok.decode(req.output_ids[1:-1]))
