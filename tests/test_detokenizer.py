"""Tests for detokenizer_proc.incremental.IncrementalDetokenizer (real SmolLM2 tokenizer)."""

from __future__ import annotations

import pytest

from detokenizer_proc.incremental import IncrementalDetokenizer


@pytest.fixture(scope="module")
def _tok(smollm2_tokenizer):
    return smollm2_tokenizer


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1, matched_stop: str | None = None) -> list[str]:
    """Feed `ids` `step` at a time, finishing on the last chunk; return the chunks."""
    chunks = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        chunks.append(detok.add(ids[i : i + step], finished=last, matched_stop=matched_stop if last else None))
    return chunks


TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14, isn't it?\n  Indented line\ttab.",
    "Hello 世界! 中文测试：你好，世界。 🙂🙂 emoji 👍🏽 café naïve Ångström — done.",
    "🙂",
    " leading space and trailing space ",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streaming_matches_full_decode(_tok, text: str, step: int) -> None:
    ids = _tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok)
    chunks = stream(detok, ids, step)
    expected = _tok.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) == expected == detok.text
    assert not any("\ufffd" in c for c in chunks)


def test_split_char_is_held_until_complete(_tok) -> None:
    ids = _tok.encode("a世", add_special_tokens=False)
    assert len(ids) > 2  # 世 spans several byte-level tokens
    detok = IncrementalDetokenizer(_tok)
    chunks = [detok.add([i]) for i in ids]
    assert chunks[0] == "a"
    assert all(c == "" for c in chunks[1:-1])
    assert chunks[-1] == "世"


def test_finish_flushes_incomplete_char(_tok) -> None:
    ids = _tok.encode("ok世", add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok)
    out = detok.add(ids[:-1])  # last byte of 世 missing
    assert "\ufffd" not in out
    out += detok.add([], finished=True)
    assert out == _tok.decode(ids[:-1]) and out.endswith("\ufffd")


def test_prompt_tail_is_context_only(_tok) -> None:
    prompt = _tok.encode("The capital of France is", add_special_tokens=False)
    gen = _tok.encode(" Paris, of course.", add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok, prompt_ids_tail=prompt[-3:])
    text = "".join(stream(detok, gen))
    assert text == _tok.decode(prompt + gen)[len(_tok.decode(prompt)) :] == " Paris, of course."


def test_stop_string_spanning_tokens_never_emitted(_tok) -> None:
    full = "The answer is 42. END OF ANSWER and more text after."
    stop = "END OF ANSWER"
    ids = _tok.encode(full, add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok, stop=[stop])
    # The generating side notices the stop only after the token completing it.
    upto = next(n for n in range(len(ids) + 1) if stop in _tok.decode(ids[:n]))
    chunks = stream(detok, ids[:upto], matched_stop=stop)
    assert all("END" not in c for c in chunks)
    assert detok.text == "".join(chunks) == "The answer is 42. "
    assert detok.add(ids[upto:]) == ""  # nothing after a stop


def test_stop_detected_without_matched_stop(_tok) -> None:
    """Safety net: the stop list alone trims even if the generator kept going."""
    ids = _tok.encode("alpha beta STOP gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok, stop=["STOP"])
    chunks = stream(detok, ids)
    assert "".join(chunks) == detok.text == "alpha beta "


def test_partial_stop_prefix_is_held_then_released(_tok) -> None:
    ids = _tok.encode("I love Paris in spring. Paris.", add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok, stop=["Paris."])
    emitted = ""
    held_back = False
    for n, i in enumerate(ids, 1):
        emitted += detok.add([i])
        if _tok.decode(ids[:n]).endswith(("Par", "Paris")):
            held_back = held_back or not emitted.endswith(("Par", "Paris"))
    assert held_back
    # "Paris in" was released once it clearly was not "Paris."; the real stop is cut.
    assert emitted == "I love Paris in spring. "
    assert detok.add([], finished=True, matched_stop="Paris.") == ""


def test_random_chunking_with_stops(_tok) -> None:
    """Any chunking gives the full decode cut at the first stop string."""
    import random

    rng = random.Random(0)
    text = TEXTS[0] + " " + TEXTS[1] + " Ångström 中文测试 🙂 the end."
    ids = _tok.encode(text, add_special_tokens=False)
    full = _tok.decode(ids)
    for stops in ([], ["中文测试"], ["🙂 the"], ["lazy dog", "isn't"], ["not present ☃"]):
        cut = min([full.find(s) for s in stops if s in full], default=len(full))
        for _ in range(5):
            detok = IncrementalDetokenizer(_tok, stop=stops)
            chunks, i = [], 0
            while i < len(ids):
                step = rng.randint(1, 4)
                chunks.append(detok.add(ids[i : i + step], finished=i + step >= len(ids)))
                i += step
            assert "".join(chunks) == detok.text == full[:cut]
            assert not any("\ufffd" in c for c in chunks)


def test_finish_flushes_held_back_text(_tok) -> None:
    ids = _tok.encode("See you in Par", add_special_tokens=False)
    detok = IncrementalDetokenizer(_tok, stop=["Paris."])
    out = "".join(detok.add([i]) for i in ids)
    assert not out.endswith("Par")  # held back: might become "Paris."
    out += detok.add([], finished=True)
    assert out == detok.text == "See you in Par"


def test_special_tokens(_tok) -> None:
    im_start, im_end = _tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [im_start] + _tok.encode("assistant\nHi there!", add_special_tokens=False) + [im_end]
    skipped = IncrementalDetokenizer(_tok, skip_special_tokens=True)
    assert "".join(stream(skipped, ids)) == "assistant\nHi there!" == _tok.decode(ids, skip_special_tokens=True)
    shown = IncrementalDetokenizer(_tok, skip_special_tokens=False)
    text = "".join(stream(shown, ids))
    assert text == "<|im_start|>assistant\nHi there!<|im_end|>" == _tok.decode(ids, skip_special_tokens=False)
