import math
from types import SimpleNamespace

import torch

from ipc.messages import SamplingParams
from worker_proc.penalties import (
    OutputTokenCounts,
    PenaltyBatch,
    PromptTokenMask,
    apply_logit_bias,
    apply_penalties,
    logprobs,
    mask_min_tokens,
    min_tokens_rows,
)
from worker_proc.sampler import SamplingBatch, sample

B, V = 6, 50


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    counts = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32)
    counts[torch.rand(B, V, generator=g) < 0.6] = 0  # mostly unseen
    prompt_mask = torch.rand(B, V, generator=g) < 0.3
    return logits, counts, prompt_mask


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _ref_repetition(logits, counts, prompt_mask, pens):
    out = logits.clone()
    for b in range(B):
        p = torch.tensor(pens[b], dtype=torch.float32)
        for t in range(V):
            seen = counts[b, t].item() > 0 or (prompt_mask is not None and bool(prompt_mask[b, t]))
            if seen:
                x = logits[b, t]
                out[b, t] = x / p if x.item() > 0 else x * p
    return out


def _ref_freq_pres(logits, counts, freq, pres):
    out = logits.clone()
    for b in range(B):
        f = torch.tensor(freq[b], dtype=torch.float32)
        r = torch.tensor(pres[b], dtype=torch.float32)
        for t in range(V):
            c = counts[b, t].item()
            x = logits[b, t] - f * float(c)
            x = x - r * (1.0 if c > 0 else 0.0)
            out[b, t] = x
    return out


def test_repetition_penalty_matches_reference():
    logits, counts, prompt_mask = _case(0)
    pens = [1.0, 1.2, 2.0, 0.5, 1.7, 1.05]
    rep = torch.tensor(pens)
    out = apply_penalties(logits, counts, rep, None, None, prompt_mask)
    ref = _ref_repetition(logits, counts, prompt_mask, pens)
    assert torch.allclose(out, ref, rtol=1e-6, atol=0)
    assert torch.equal(out[0], logits[0])  # neutral row bit-identical
    # tokens seen only in the prompt are penalised too; unseen ones are untouched
    unseen = (counts == 0) & ~prompt_mask
    assert torch.equal(out[unseen], logits[unseen])
    only_prompt = (counts == 0) & prompt_mask
    assert not torch.equal(out[1][only_prompt[1]], logits[1][only_prompt[1]])
    # positive logits shrink, negative ones grow in magnitude (p > 1 always lowers the logit)
    seen2 = (counts[2] > 0) | prompt_mask[2]
    assert (out[2][seen2] <= logits[2][seen2]).all()
    # without a prompt mask only output tokens count
    out_np = apply_penalties(logits, counts, rep, None, None, None)
    assert torch.allclose(out_np, _ref_repetition(logits, counts, None, pens), rtol=1e-6, atol=0)
    assert not torch.equal(logits, out)  # input not modified in place
    assert torch.equal(logits, _case(0)[0])


def test_frequency_and_presence_match_reference():
    logits, counts, prompt_mask = _case(1)
    freq = [0.0, 0.5, -0.7, 2.0, 1.0, 0.0]
    pres = [0.0, 0.0, 1.5, -2.0, 0.3, 0.9]
    out = apply_penalties(logits, counts, None, torch.tensor(freq), torch.tensor(pres), prompt_mask)
    ref = _ref_freq_pres(logits, counts, freq, pres)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0], logits[0])
    # prompt tokens are not frequency/presence penalised
    assert torch.equal(out[(counts == 0)], logits[(counts == 0)])
    # each alone
    only_f = apply_penalties(logits, counts, None, torch.tensor(freq), None)
    assert torch.allclose(only_f, _ref_freq_pres(logits, counts, freq, [0.0] * B), rtol=1e-6, atol=1e-6)
    only_p = apply_penalties(logits, counts, None, None, torch.tensor(pres))
    assert torch.allclose(only_p, _ref_freq_pres(logits, counts, [0.0] * B, pres), rtol=1e-6, atol=1e-6)
    # exact values on one hand-picked entry: count 3, freq 0.5, presence 0 -> logit - 1.5
    c = counts.clone()
    c[1, 7] = 3
    v = apply_penalties(logits, c, None, torch.tensor(freq), torch.tensor(pres))
    assert math.isclose(v[1, 7].item(), logits[1, 7].item() - 1.5, rel_tol=1e-6, abs_tol=1e-6)


def test_all_penalties_combined_order():
    logits, counts, prompt_mask = _case(2)
    rep = [1.3, 1.0, 0.8, 2.0, 1.1, 1.0]
    freq = [0.2, 0.0, 0.4, -0.3, 0.0, 1.0]
    pres = [0.5, 0.0, -0.1, 0.2, 0.0, 0.0]
    out = apply_penalties(logits, counts, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres), prompt_mask)
    ref = _ref_freq_pres(_ref_repetition(logits, counts, prompt_mask, rep), counts, freq, pres)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], logits[1])


def test_neutral_values_bit_identical():
    logits, counts, prompt_mask = _case(3)
    assert apply_penalties(logits, counts, None, None, None, prompt_mask) is logits
    out = apply_penalties(logits, counts, torch.ones(B), torch.zeros(B), torch.zeros(B), prompt_mask)
    assert torch.equal(out, logits)
    assert apply_logit_bias(logits, [None, {}, None, None, {}, None]) is logits
    assert mask_min_tokens(logits, [], []) is logits
    pb = PenaltyBatch.build([SamplingParams()] * B, [0] * B, V, "cpu", eos_token_ids=[2])
    assert pb.is_noop and not pb.needs_counts and pb.top_logprobs is None
    assert pb.apply(logits) is logits


def test_logit_bias_adds_exactly():
    logits, _, _ = _case(4)
    biases = [None, {3: 5.0, 7: -100.0}, {}, {"0": 1.25, 49: 0.5}, {3: -2.5}, {60: 9.0, -1: 9.0}]
    out = apply_logit_bias(logits, biases)
    ref = logits.clone()
    for b, bias in enumerate(biases):
        for t, v in (bias or {}).items():
            t = int(t)
            if 0 <= t < V:
                ref[b, t] = logits[b, t] + torch.tensor(v, dtype=torch.float32)
    assert torch.equal(out, ref)
    assert torch.equal(out[[0, 2, 5]], logits[[0, 2, 5]])  # out-of-range ids ignored
    assert not torch.equal(out, logits) and torch.equal(logits, _case(4)[0])


def test_logit_bias_drives_sampling():
    logits = torch.zeros(4, V)
    biases = [{11: 100.0}, {12: 100.0}, None, {i: -100.0 for i in range(V) if i != 5}]
    out = apply_logit_bias(logits, biases)
    ids = sample(out, SamplingBatch.build([SamplingParams(temperature=1.0)] * 4, [0] * 4, V, "cpu"))
    assert ids[0].item() == 11 and ids[1].item() == 12 and ids[3].item() == 5


def test_mask_min_tokens():
    logits, _, _ = _case(5)
    out = mask_min_tokens(logits, [1, 4], [[0, 2], [2, 99]])
    assert out[1, 0] == -math.inf and out[1, 2] == -math.inf and out[4, 2] == -math.inf
    keep = torch.ones(B, V, dtype=torch.bool)
    keep[1, 0] = keep[1, 2] = keep[4, 2] = False
    assert torch.equal(out[keep], logits[keep])
    assert torch.isfinite(logits).all()  # input untouched
    greedy = sample(out, SamplingBatch.build([SamplingParams(temperature=0.0)] * B, [0] * B, V, "cpu"))
    assert greedy[1].item() not in (0, 2) and greedy[4].item() != 2


def test_min_tokens_rows_from_params():
    params = [
        SamplingParams(min_new_tokens=3, stop_token_ids=[7]),
        SamplingParams(min_new_tokens=3, stop_token_ids=[7], ignore_eos=True),
        SamplingParams(min_new_tokens=3),
        SamplingParams(min_new_tokens=0, stop_token_ids=[7]),
        SamplingParams(min_new_tokens=3, ignore_eos=True),  # nothing to mask
        SamplingParams(min_new_tokens=3, choice=["a"]),  # a grammar decides where it may end
    ]
    rows, stops = min_tokens_rows(params, [2, 0, 3, 0, 0, 1], eos_token_ids=[1, 2])
    assert rows == [0, 1] and stops == [[7, 1, 2], [7]]
    pb = PenaltyBatch.build(params, [2, 0, 3, 0, 0, 1], V, "cpu", eos_token_ids=[1, 2])
    assert pb.min_token_rows == [0, 1] and not pb.needs_counts and not pb.is_noop


def test_logprobs_match_log_softmax():
    logits, _, _ = _case(6)
    chosen = torch.tensor([0, 5, 49, 3, 3, 17])
    lp, ids, tops = logprobs(logits, chosen, 5)
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.dtype == torch.float32 and ids.shape == (B, 5) and tops.shape == (B, 5)
    assert torch.allclose(lp, ref[torch.arange(B), chosen])
    assert torch.allclose(tops, ref.gather(-1, ids))
    assert (tops[:, :-1] >= tops[:, 1:]).all()  # sorted descending
    assert torch.equal(ids[:, 0], logits.argmax(-1))
    assert torch.allclose(tops, ref.topk(5, dim=-1).values)
    lp0, ids0, tops0 = logprobs(logits.to(torch.bfloat16), chosen, 0)
    assert ids0.shape == (B, 0) and tops0.shape == (B, 0) and lp0.dtype == torch.float32
    _, ids_all, _ = logprobs(logits, chosen, 10 * V)
    assert ids_all.shape == (B, V)


def test_output_token_counts():
    c = OutputTokenCounts(max_reqs=8, vocab_size=V, device="cpu")
    # slot 3 generates token 5 twice in one batch (e.g. several tokens per step): accumulate
    c.add(torch.tensor([3, 3, 1, 6]), torch.tensor([5, 5, 5, 0]))
    c.add([1, 3], [5, 9])
    assert c.counts[3, 5].item() == 2 and c.counts[3, 9].item() == 1
    assert c.counts[1, 5].item() == 2 and c.counts[6, 0].item() == 1
    assert c.counts.sum().item() == 6
    g = c.gather(torch.tensor([6, 3]))
    assert g.shape == (2, V) and g.dtype == torch.int32
    assert torch.equal(g[1], c.counts[3]) and torch.equal(g[0], c.counts[6])
    g[1, 5] = 100  # gather is a copy
    assert c.counts[3, 5].item() == 2
    c.reset(torch.tensor([3, 6]))
    assert c.counts[3].sum().item() == 0 and c.counts[6].sum().item() == 0 and c.counts[1, 5].item() == 2
    c.add([], [])
    c.reset([])


def test_prompt_masks():
    prompts = [[1, 2, 2, 49], [], [0]]
    pm = PromptTokenMask(4, V, "cpu")
    pm.add([s for s, ids in zip([2, 0, 3], prompts) for _ in ids], [t for ids in prompts for t in ids])
    m = pm.gather([2, 0, 3])
    assert m.shape == (3, V) and m.dtype == torch.bool
    assert m[0].nonzero().flatten().tolist() == [1, 2, 49] and not m[1].any() and m[2, 0]
    assert m[2].sum().item() == 1
    pm.reset([2])
    assert not pm.mask[2].any()


def test_penalty_batch_end_to_end():
    logits, counts, prompt_mask = _case(7)
    params = [
        SamplingParams(),
        SimpleNamespace(repetition_penalty=1.5, frequency_penalty=0.0, presence_penalty=0.0,
                        logit_bias=None, min_new_tokens=0, stop_token_ids=[], ignore_eos=False,
                        logprobs=True, top_logprobs=3),
        SimpleNamespace(repetition_penalty=1.0, frequency_penalty=0.4, presence_penalty=0.6,
                        logit_bias={4: 2.0}, min_new_tokens=5, stop_token_ids=[9], ignore_eos=False,
                        logprobs=True, top_logprobs=7),
        SamplingParams(),
        SamplingParams(),
        SamplingParams(),
    ]
    pb = PenaltyBatch.build(params, [0, 0, 1, 0, 0, 0], V, "cpu", eos_token_ids=[2])
    assert pb.needs_counts and pb.needs_prompt_mask and pb.top_logprobs == 7
    assert pb.want_logprobs == [False, True, True, False, False, False]
    out = pb.apply(logits, counts, prompt_mask)
    rep = [1.0, 1.5, 1.0, 1.0, 1.0, 1.0]
    freq = [0.0, 0.0, 0.4, 0.0, 0.0, 0.0]
    pres = [0.0, 0.0, 0.6, 0.0, 0.0, 0.0]
    biased = logits.clone()
    biased[2, 4] += 2.0
    biased[2, 9] = biased[2, 2] = -math.inf
    ref = _ref_freq_pres(_ref_repetition(biased, counts, prompt_mask, rep), counts, freq, pres)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[[0, 3, 4, 5]], logits[[0, 3, 4, 5]])


def test_penalised_greedy_avoids_repeats():
    # a strong repetition penalty on a token seen in the output moves greedy off it
    logits = torch.zeros(1, V)
    logits[0, 10] = 2.0
    logits[0, 11] = 1.0
    c = OutputTokenCounts(1, V, "cpu")
    c.add([0], [10])
    out = apply_penalties(logits, c.gather([0]), torch.tensor([4.0]), None, None)
    assert out[0, 10].item() == 0.5
    ids = sample(out, SamplingBatch.build([SamplingParams(temperature=0.0)], [0], V, "cpu"))
    assert ids.item() == 11
