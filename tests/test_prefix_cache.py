"""The prefix cache through every process, SmolLM2 float32: the same greedy outputs with the cache
on and off for requests sharing a long system prompt and for a multi-turn chat replay, and the
hits it reports."""

from __future__ import annotations

import pytest

GREEDY = {"max_new_tokens": 24, "temperature": 0}
SYSTEM = ("You are the archivist of a mountain library. You answer in one sentence, you cite the shelf "
          "where a book stands, and you never invent a title that the catalogue does not list. ") * 6


@pytest.fixture(scope="module")
def engines(default_model_dir):
    from launch import Engine

    made = {}
    try:
        for name, disable in (("cache", False), ("no cache", True)):
            made[name] = Engine(dtype="float32", kv_cache_gb=0.5, max_running_requests=32, disable_radix_cache=disable,
                                log_level="warning")
        yield made
    finally:
        for e in made.values():
            e.shutdown()


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_groups_sharing_a_system_prompt_give_the_same_outputs_with_and_without_the_cache(engines):
    tok = engines["cache"].tokenizer
    questions = ["Where is the atlas of rivers?", "Do you have a book on bees?", "Which shelf holds poetry?",
                 "Is there a cookbook from the coast?"]
    prompts = [chat_ids(tok, [{"role": "system", "content": f"Group {g}. {SYSTEM}"},
                              {"role": "user", "content": q}]) for g in range(3) for q in questions]
    outs = {name: e.generate(input_ids=prompts, sampling_params=GREEDY) for name, e in engines.items()}
    assert [o["output_ids"] for o in outs["cache"]] == [o["output_ids"] for o in outs["no cache"]]
    cached = [o["meta_info"]["cached_tokens"] for o in outs["cache"]]
    system_len = len(chat_ids(tok, [{"role": "system", "content": f"Group 0. {SYSTEM}"}]))
    assert sum(c >= system_len - 10 for c in cached) >= 9  # all but the first of each group (at least)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs["no cache"])


def test_a_multi_turn_chat_replay_gives_the_same_outputs_and_hits_every_earlier_turn(engines):
    tok = engines["cache"].tokenizer
    users = [["Hello! Who are you?", "Name a river.", "How long is it?", "Thank you."],
             ["Hi. Can you count to three?", "And back down?", "Now in French.", "Bye."],
             ["What is a haiku?", "Write one about snow.", "Another about rain.", "Which do you prefer?"]]
    replies: dict[str, list[list[str]]] = {}
    for name, engine in engines.items():
        history = [[] for _ in users]
        replies[name] = [[] for _ in users]
        for turn in range(4):
            prompts = []
            for c, conv in enumerate(users):
                history[c].append({"role": "user", "content": conv[turn]})
                prompts.append(chat_ids(tok, history[c]))
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            for c, out in enumerate(outs):
                history[c].append({"role": "assistant", "content": out["text"]})
                replies[name][c].append(out["text"])
                if name == "cache" and turn > 0:  # every earlier turn comes from the cache
                    assert out["meta_info"]["cached_tokens"] >= len(prompts[c]) - 40, (turn, c)
    assert replies["cache"] == replies["no cache"]


def test_flush_empties_the_cache_and_is_refused_while_requests_run(engines):
    import threading

    engine = engines["cache"]
    engine.generate("Fill the cache a little.", GREEDY)
    stats = engine.get_stats()
    assert stats["kv_slots_evictable"] > 0 and stats["kv_slots_locked"] == 0
    thread = threading.Thread(target=engine.generate, args=("A long answer, please.",
                                                            {"max_new_tokens": 400, "ignore_eos": True}))
    thread.start()
    import time

    while engine.get_stats()["num_running"] == 0:
        time.sleep(0.02)
    assert "running" in engine.flush_cache()
    engine.abort()
    thread.join(60)
    assert engine.flush_cache() is None
    stats = engine.get_stats()
    assert stats["kv_slots_free"] == stats["kv_slots_total"] and stats["kv_slots_evictable"] == 0
