import math

import torch

from ipc.messages import SamplingParams
from worker_proc.sampler import SamplingBatch, sample

V = 32


def _sample(logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int] | None = None):
    batch = SamplingBatch.build(params, output_lens or [0] * len(params), logits.shape[-1], "cpu")
    return sample(logits, batch)


def _repeat(row: torch.Tensor, n: int) -> torch.Tensor:
    return row[None, :].expand(n, -1).contiguous()


def _support(logits_row: torch.Tensor, p: SamplingParams, n: int = 4000) -> set[int]:
    return set(_sample(_repeat(logits_row, n), [p] * n).tolist())


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1  # tie -> lowest index
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 8, [0] * 8, V, "cpu")
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch), logits.argmax(-1))
    assert sample(logits, batch)[3].item() == 5


def test_top_k_one_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(16, V)
    out = _sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 16)
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_support():
    torch.manual_seed(2)
    row = torch.randn(V) * 0.1  # nearly flat: every token would show up without top-k
    k = 5
    support = _support(row, SamplingParams(temperature=1.0, top_k=k))
    assert support == set(row.topk(k).indices.tolist())


def test_top_p_keeps_exact_nucleus():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    row = probs.log()
    assert _support(row, SamplingParams(top_p=0.65)) == {0, 1}  # 0.4 < 0.65 <= 0.7
    assert _support(row, SamplingParams(top_p=0.71)) == {0, 1, 2}
    assert _support(row, SamplingParams(top_p=0.01)) == {0}  # top token always kept
    # permuted vocabulary: the nucleus follows probabilities, not positions
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert _support(row[perm], SamplingParams(top_p=0.65)) == {1, 3}


def test_top_k_then_top_p():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    # top-k=2 renormalises to [4/7, 3/7]; top_p=0.5 then keeps only token 0
    assert _support(probs.log(), SamplingParams(top_k=2, top_p=0.5)) == {0}


def test_min_p_support():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    # threshold 0.3 * 0.4 = 0.12: keeps 0.4, 0.3, 0.15
    assert _support(probs.log(), SamplingParams(min_p=0.3)) == {0, 1, 2}


def test_distribution_matches_softmax():
    torch.manual_seed(3)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    n = 20_000
    out = _sample(_repeat(logits, n), [SamplingParams(temperature=1.0)] * n)
    freq = torch.bincount(out, minlength=5).float() / n
    assert (freq - logits.softmax(-1)).abs().max() < 0.02


def test_temperature_scales_distribution():
    torch.manual_seed(4)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    n = 20_000
    out = _sample(_repeat(logits, n), [SamplingParams(temperature=2.0)] * n)
    freq = torch.bincount(out, minlength=5).float() / n
    assert (freq - (logits / 2).softmax(-1)).abs().max() < 0.02


def test_tiny_temperature_is_finite_and_argmax():
    torch.manual_seed(5)
    logits = torch.randn(8, V) * 30
    out = _sample(logits, [SamplingParams(temperature=1e-9)] * 8)
    assert torch.equal(out, logits.argmax(-1))


def test_seed_independent_of_batch():
    torch.manual_seed(6)
    row = torch.randn(V)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(position: int, companions: list[SamplingParams], output_len: int) -> int:
        params = list(companions)
        params.insert(position, seeded)
        logits = torch.randn(len(params), V)
        logits[position] = row
        lens = [7] * len(params)
        lens[position] = output_len
        return _sample(logits, params, lens)[position].item()

    for output_len in range(20):
        a = run(0, [], output_len)
        b = run(2, [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=9)], output_len)
        c = run(1, [SamplingParams(top_k=3), SamplingParams(top_p=0.5, seed=1234)], output_len)
        assert a == b == c


def test_seed_sequences_differ():
    row = torch.zeros(V)  # uniform: 32 choices per step
    logits = _repeat(row, 2)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    steps = [_sample(logits, params, [t, t]).tolist() for t in range(20)]
    seq1, seq2 = [s[0] for s in steps], [s[1] for s in steps]
    assert seq1 != seq2
    assert len(set(seq1)) > 1  # output_len changes the draw


def test_mixed_greedy_and_sampled():
    torch.manual_seed(7)
    logits = torch.randn(6, V)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=0.0, top_p=0.1),
        SamplingParams(temperature=1.0, min_p=0.5),
    ]
    batch = SamplingBatch.build(params, [0] * 6, V, "cpu")
    assert not batch.all_greedy and batch.need_top_k and batch.need_top_p and batch.need_min_p
    for _ in range(50):
        out = sample(logits, batch)
        assert out.dtype == torch.int64 and out.shape == (6,)
        for i in (0, 2, 4):
            assert out[i].item() == logits[i].argmax().item()
        assert out[1].item() in logits[1].topk(3).indices.tolist()
        probs5 = logits[5].softmax(-1)
        assert probs5[out[5]].item() >= 0.5 * probs5.max().item() - 1e-6


def test_flags_skip_greedy_rows():
    batch = SamplingBatch.build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)], [0], V, "cpu")
    assert batch.all_greedy and not (batch.need_top_k or batch.need_top_p or batch.need_min_p)
    batch = SamplingBatch.build([SamplingParams(top_k=-1), SamplingParams(top_k=10 * V)], [0, 0], V, "cpu")
    assert batch.top_ks.tolist() == [V, V] and not batch.need_top_k
    assert math.isclose(batch.temperatures[0].item(), 1.0)
