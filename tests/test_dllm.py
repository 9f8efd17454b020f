"""Block diffusion (--dllm-algorithm): loom's paged-KV rounds against an independent reference (HF
transformers' Qwen3 over the whole sequence with an explicit block-causal mask, no cache), FDFO
against sync, the lifecycle of a batch with one slow block (admission, in-place reuse, re-loops,
no leak), and the Engine and HTTP (native, OpenAI) streaming one chunk per committed block."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from inproc import build_tiny_checkpoint, with_tokenizer
from ipc.messages import SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.req import Req, ReqState

BLOCK = 8
MASK = 999  # the tiny vocabulary's last id
THRESHOLD = 0.9
ALGORITHMS = ("low_confidence", "joint_threshold")
PROMPT_LENS = (5, 13, 16, 21)
NEW_TOKENS = 20  # (not a whole number of blocks: the last block is cut)
GREEDY = dict(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def build_dllm_checkpoint(out_dir, seed: int = 2) -> Path:
    """A tiny random Qwen3 with a mask token, its LM head scaled up so confidences spread (some
    positions clear the threshold in a round, others take several rounds)."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_checkpoint("qwen3", out_dir, seed=seed)
    config = json.loads((path / "config.json").read_text())
    config["mask_token_id"] = MASK
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] *= 3.0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_dllm_checkpoint(tmp_path_factory.mktemp("dllm"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 990, (n,), generator=g).tolist() for n in PROMPT_LENS]


_runners: dict = {}


def runner_for(checkpoint: Path, algorithm: str, backend: str = "auto"):
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    key = (str(checkpoint), algorithm, backend)
    if key not in _runners:
        _runners[key] = ModelRunner(RunnerConfig(str(checkpoint), torch.float32, kv_cache_gb=0.02,
                                                 max_running_requests=8, kernel_backend=backend,
                                                 dllm_algorithm=algorithm, dllm_block_size=BLOCK,
                                                 dllm_threshold=THRESHOLD, dllm_edit_threshold=0.5,
                                                 dllm_max_post_edit_steps=2))
    return _runners[key]


def make_core(runner, fdfo: bool = True, in_place: bool = True, max_running: int = 8,
              page_size: int = BLOCK, radix: bool = True) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(
        max_total_tokens=runner.num_slots, max_running_requests=max_running, max_prefill_tokens=4096,
        max_context_len=runner.context_len, page_size=page_size, enable_radix_cache=radix,
        dllm_block_size=BLOCK, dllm_mask_id=MASK, dllm_fdfo=fdfo, dllm_in_place=in_place))


def run_core(core: SchedulerCore, runner, reqs: list[Req], on_step=None) -> None:
    """Drives the core and the runner in one process until every request ends."""
    for req in reqs:
        assert core.add_request(req) is None
    while True:
        batch, _ = core.next_batch()
        if batch is None:
            break
        result = runner.forward_dllm(batch.to_worker_batch())
        outputs = core.on_dllm_result(batch, result)
        if on_step is not None:
            on_step(batch, result, outputs)
    assert not core.idle_leaks(), core.idle_leaks()


def loom_alone(runner, prompts, fdfo=True, in_place=True, **sampling) -> list[list[int]]:
    outs = []
    for i, p in enumerate(prompts):
        req = Req(str(i), list(p), SamplingParams(**{**GREEDY, **sampling}))
        run_core(make_core(runner, fdfo, in_place), runner, [req])
        outs.append(req.output_ids)
    return outs


# ---- the reference ---------------------------------------------------------------------------

def reference(hf, algorithm, prompt: list[int], block_causal: bool = True) -> list[int]:
    """HF forward over prompt + committed output + the block, every round, no cache, with an
    explicit 4D mask (block-causal, or plain causal to show the mask matters); the same algorithm
    picks the tokens."""
    from worker_proc.dllm_algorithms import DllmBlocks

    seq, n_prompt = list(prompt), len(prompt)
    state = None
    while len(seq) - n_prompt < NEW_TOKENS:
        start = len(seq) // BLOCK * BLOCK
        end = start + BLOCK
        ids = torch.tensor([seq[start:] + [MASK] * (end - len(seq))])
        prompt_mask = torch.tensor([[start + i < n_prompt for i in range(BLOCK)]])
        state = algorithm.init_state(prompt_mask[0].tolist())
        pos = torch.arange(end)
        allowed = (pos[None, :] // BLOCK <= pos[:, None] // BLOCK) if block_causal else pos[None, :] <= pos[:, None]
        mask = torch.zeros(1, 1, end, end).masked_fill(~allowed, float("-inf"))
        while True:
            with torch.no_grad():
                logits = hf(torch.tensor([seq[:start] + ids[0].tolist()]), attention_mask=mask).logits[0, start:end]
            blocks = DllmBlocks(ids, prompt_mask, torch.tensor([start]), [SamplingParams(temperature=0.0)])
            if algorithm.step(blocks, logits[None], [state])[0]:
                break
        seq = seq[:start] + ids[0].tolist()
    return seq[n_prompt : n_prompt + NEW_TOKENS]


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("backend", ("torch", "cpu"))
def test_paged_rounds_match_the_reference(checkpoint, prompts, hf_model, algorithm, backend):
    """Batch 1: loom's paged KV (committed blocks computed once, the block rewritten in place)
    gives the reference's tokens, on the torch backend and on the compiled kernels."""
    from worker_proc.dllm_algorithms import DLLM_ALGORITHMS, DllmAlgoConfig

    runner = runner_for(checkpoint, algorithm, backend)
    algo = DLLM_ALGORITHMS.make(algorithm, DllmAlgoConfig(MASK, BLOCK, THRESHOLD, 0.5, 2))
    expected = [reference(hf_model, algo, p) for p in prompts]
    assert loom_alone(runner, prompts) == expected
    assert len({tuple(e) for e in expected}) == len(prompts) and all(MASK not in e for e in expected)
    if backend == "torch" and algorithm == "low_confidence":  # the mask matters: causal attention differs
        assert [reference(hf_model, algo, p, block_causal=False) for p in prompts] != expected


# ---- modes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fdfo_and_sync_give_the_same_tokens_at_batch_1(checkpoint, prompts, algorithm):
    runner = runner_for(checkpoint, algorithm)
    sync = loom_alone(runner, prompts, fdfo=False)
    assert loom_alone(runner, prompts, fdfo=True, in_place=True) == sync
    assert loom_alone(runner, prompts, fdfo=True, in_place=False) == sync
    seeded = dict(temperature=0.8, top_k=20, seed=5)
    assert loom_alone(runner, prompts[:2], fdfo=True, **seeded) == loom_alone(runner, prompts[:2], fdfo=False, **seeded)


def rounds_of_first_block(runner, prompt, new_tokens: int) -> int:
    core = make_core(runner, fdfo=False)
    run_core(core, runner, [Req("probe", list(prompt), SamplingParams(**{**GREEDY, "max_new_tokens": new_tokens}))])
    return core.stats()["dllm_rounds"]


FAST_NEW = 2  # a fast request: its prompt fills all but FAST_NEW positions of its only block


@pytest.fixture(scope="module")
def slow_and_fast(checkpoint):
    """A block-aligned prompt whose first block (all masks) takes the most rounds, and prompts
    that leave FAST_NEW masks in their block (at most FAST_NEW rounds)."""
    runner = runner_for(checkpoint, "low_confidence")
    g = torch.Generator().manual_seed(3)
    candidates = [torch.randint(3, 990, (BLOCK,), generator=g).tolist() for _ in range(6)]
    rounds = [rounds_of_first_block(runner, p, BLOCK) for p in candidates]
    fast = [torch.randint(3, 990, (2 * BLOCK - FAST_NEW,), generator=g).tolist() for _ in range(4)]
    assert max(rounds) >= 2 * FAST_NEW + 2, rounds
    return candidates[int(np.argmax(rounds))], fast, max(rounds)


def lifecycle(runner, slow, fast, fdfo, in_place):
    """The slow request and two fast ones run (3 at most), two more fast ones wait; records each
    step: its rows, accept lengths, allocator counters."""
    core = make_core(runner, fdfo, in_place, max_running=3)
    reqs = [Req("slow", list(slow), SamplingParams(**{**GREEDY, "max_new_tokens": BLOCK}))]
    reqs += [Req(f"fast{i}", list(p), SamplingParams(**{**GREEDY, "max_new_tokens": FAST_NEW}))
             for i, p in enumerate(fast)]
    steps = []

    def on_step(batch, result, outputs):
        steps.append(dict(rows=[r.req.rid for r in batch.rows], slots=[r.new_slots.tolist() for r in batch.rows],
                          accept=list(result.accept_lens), rounds=result.rounds, block_rounds=result.block_rounds,
                          state={r.rid: r.state for r in reqs}, alloc=core.token_pool.allocated_total,
                          freed=core.token_pool.freed_total, committed=[o.req.rid for o in outputs]))

    run_core(core, runner, reqs, on_step)
    assert [len(r.output_ids) for r in reqs] == [BLOCK] + [FAST_NEW] * 4
    return core, reqs, steps


def test_fdfo_lets_fast_requests_finish_and_new_ones_in_while_a_slow_block_continues(checkpoint, slow_and_fast):
    slow, fast, slow_rounds = slow_and_fast
    runner = runner_for(checkpoint, "low_confidence")
    core, reqs, steps = lifecycle(runner, slow, fast, fdfo=True, in_place=True)
    first_slow_commit = next(i for i, s in enumerate(steps) if "slow" in s["committed"])
    before = steps[:first_slow_commit]
    # fast requests finished and the waiting ones were admitted, all while the slow block ran
    assert sum(s["state"][f"fast{i}"] is ReqState.FINISHED for s in before[-1:] for i in range(4)) >= 3
    assert {"fast2", "fast3"} <= {rid for s in before for rid in s["rows"]}
    # every step returned with some block done: rounds that finished none re-looped in the worker
    assert all(any(s["accept"]) for s in steps)
    stats = core.stats()
    assert stats["dllm_reloop_rounds"] == stats["dllm_rounds"] - stats["dllm_steps"] > 0
    assert sum(s["rounds"] for s in steps) == stats["dllm_rounds"]
    # FDFO's rounds carry every block of the step until one is done: rounds x rows
    assert all(s["block_rounds"] == s["rounds"] * len(s["rows"]) for s in steps)
    assert stats["dllm_block_rounds"] == sum(s["block_rounds"] for s in steps)
    # the slow block kept its slots from step to step: no allocation or free for it in between
    slow_block_slots = [s["slots"][s["rows"].index("slow")][-BLOCK:] for s in steps[: first_slow_commit + 1]]
    assert all(slots == slow_block_slots[0] for slots in slow_block_slots)
    for prev, cur in zip(steps, steps[1:]):
        new_rows = [rid for rid in cur["rows"] if rid not in prev["rows"]]
        if not new_rows and not prev["committed"]:  # (never: each step commits some block)
            assert cur["alloc"] == prev["alloc"] and cur["freed"] == prev["freed"]
    # FDFO takes no more rounds than sync for the same work, and sync keeps every request to the
    # end of the step: all blocks of a step commit together
    _, _, sync_steps = lifecycle(runner, slow, fast, fdfo=False, in_place=True)
    assert all(all(a == BLOCK for a in s["accept"]) and sorted(s["committed"]) == sorted(s["rows"])
               for s in sync_steps)
    assert sync_steps[0]["rounds"] == slow_rounds  # the first step waits for the slow block
    # ... but its later rounds compute only the blocks not done yet
    assert sync_steps[0]["block_rounds"] < sync_steps[0]["rounds"] * len(sync_steps[0]["rows"])
    assert {r for r in sync_steps[0]["rows"]} == {"slow", "fast0", "fast1"}


def test_without_in_place_reuse_unfinished_blocks_churn_and_return_every_round(checkpoint, slow_and_fast):
    slow, fast, slow_rounds = slow_and_fast
    runner = runner_for(checkpoint, "low_confidence")
    core, reqs, steps = lifecycle(runner, slow, fast, fdfo=True, in_place=False)
    stats = core.stats()
    assert stats["dllm_reloop_rounds"] == 0 and all(s["rounds"] == 1 for s in steps)
    assert any(not any(s["accept"]) for s in steps)  # rounds that finish nothing come back
    idle = [(prev, cur) for prev, cur in zip(steps, steps[1:]) if cur["rows"] == prev["rows"] and not prev["committed"]]
    assert idle and all(cur["alloc"] - prev["alloc"] == BLOCK * len(cur["rows"]) for prev, cur in idle)
    # the same tokens as with in-place reuse
    _, reqs_in_place, _ = lifecycle(runner, slow, fast, fdfo=True, in_place=True)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in reqs_in_place]


def test_abort_frees_an_in_flight_block_and_the_cache_holds_only_final_blocks(checkpoint, prompts):
    runner = runner_for(checkpoint, "low_confidence")
    core = make_core(runner)
    long_prompt = prompts[3]  # 21 tokens: two whole prompt blocks, the third shared with the output
    req = Req("a", list(long_prompt), SamplingParams(**GREEDY))
    assert core.add_request(req) is None
    batch, _ = core.next_batch()
    assert batch.rows[0].extend_len == 3 * BLOCK  # two prompt blocks + the first block
    core.on_dllm_result(batch, runner.forward_dllm(batch.to_worker_batch()))  # (FDFO: it returns done)
    assert len(req.output_ids) == 3 and req.dllm_kv_valid == 2 * BLOCK
    batch, _ = core.next_batch()
    assert (batch.rows[0].prefix_len, batch.rows[0].extend_len) == (2 * BLOCK, 2 * BLOCK)  # recompute + new block
    free_before = core.token_pool.num_free
    result = runner.forward_dllm(batch.to_worker_batch())
    core.abort("a")  # while the step runs
    assert req.state is ReqState.FINISHED and core.on_dllm_result(batch, result) == []
    assert not core.idle_leaks()
    # the two prompt blocks (KV of final ids) went into the prefix cache; the committed block
    # (recomputed only by the step in flight) and the block in flight were freed
    assert core.cache.total_size == 2 * BLOCK
    assert core.token_pool.num_free == free_before + 2 * BLOCK
    again = Req("b", list(long_prompt), SamplingParams(**GREEDY))
    run_core(core, runner, [again])
    assert again.cached_tokens == 2 * BLOCK
    assert again.output_ids == loom_alone(runner, [long_prompt])[0]


def test_a_finished_request_caches_its_recomputed_blocks_not_its_last_one(checkpoint, prompts):
    runner = runner_for(checkpoint, "low_confidence")
    core = make_core(runner)
    first = Req("a", list(prompts[2]), SamplingParams(**{**GREEDY, "max_new_tokens": 2 * BLOCK}))
    run_core(core, runner, [first])
    # 16 prompt + 16 output: the output's first block was recomputed with the second, the last was not
    assert core.cache.total_size == 3 * BLOCK
    follow = Req("b", list(prompts[2]) + first.output_ids, SamplingParams(**{**GREEDY, "max_new_tokens": BLOCK}))
    run_core(core, runner, [follow])
    assert follow.cached_tokens == 3 * BLOCK


@pytest.mark.parametrize("fdfo", [True, False])
def test_a_pool_too_small_retracts_and_restarts_requests_with_the_same_tokens(checkpoint, prompts, fdfo):
    """KV for about two of the four requests: the planner retracts (the batching strategy's victim)
    and the victim restarts later from its committed tokens; every request still gives its tokens
    when run alone, nothing leaks."""
    runner = runner_for(checkpoint, "low_confidence")
    alone = loom_alone(runner, prompts, fdfo=fdfo)
    core = SchedulerCore(SchedulerConfig(
        max_total_tokens=72, max_running_requests=4, max_prefill_tokens=4096, max_context_len=runner.context_len,
        page_size=BLOCK, enable_radix_cache=False, dllm_block_size=BLOCK, dllm_mask_id=MASK, dllm_fdfo=fdfo))
    reqs = [Req(str(i), list(p), SamplingParams(**GREEDY)) for i, p in enumerate(prompts)]
    run_core(core, runner, reqs)
    assert core.num_retractions > 0
    assert [r.output_ids for r in reqs] == alone


def test_page_size_must_be_a_multiple_of_the_block(checkpoint):
    import launch
    from worker_proc.model_config import ModelConfig

    config = ModelConfig.from_dir(checkpoint)
    with pytest.raises(ValueError, match="--page-size 4 is not a multiple of the diffusion block size 8"):
        launch.check_dllm(launch.ServerArgs(dllm_algorithm="low_confidence", dllm_block_size=8, page_size=4), config)
    launch.check_dllm(launch.ServerArgs(dllm_algorithm="low_confidence", dllm_block_size=8, page_size=16), config)


# ---- Engine and HTTP ---------------------------------------------------------------------------

def streamed_at_block_ends(lengths: list[int], block_ends: list[int]) -> bool:
    """A stream's cumulative output lengths all fall where blocks commit, rising to the end
    (never a partial block; usually one chunk per block)."""
    return lengths == sorted(set(lengths)) and set(lengths) <= set(block_ends) and lengths[-1] == block_ends[-1]


@pytest.fixture(scope="module")
def served_checkpoint(checkpoint, default_model_dir):
    return with_tokenizer(checkpoint, default_model_dir)


def test_engine_with_data_and_tensor_parallel_ranks_streams_one_chunk_per_block(served_checkpoint, checkpoint,
                                                                               prompts):
    """--dp-size 2 x --tp-size 2 (rank 0 of each group runs the algorithm and shares its ids): the
    tokens of one in-process rank; a stream gets one chunk per committed block."""
    from launch import Engine

    expected = loom_alone(runner_for(checkpoint, "low_confidence"), prompts)
    with Engine(model_path=str(served_checkpoint), dtype="float32", kv_cache_gb=0.1, log_level="warning",
                dllm_algorithm="low_confidence", dllm_block_size=BLOCK, dllm_threshold=THRESHOLD,
                page_size=BLOCK, dp_size=2, tp_size=2) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == expected
        chunks = list(engine.generate(input_ids=prompts[1], sampling_params=GREEDY, stream=True))
        # prompt of 13: its block 1 holds 5 prompt tokens and 3 outputs; blocks 2 and 3; 1 of block 4.
        # Chunks end where blocks commit (a consumer that lags gets several blocks in one chunk).
        assert streamed_at_block_ends([len(c["output_ids"]) for c in chunks], [3, 11, 19, 20])
        assert chunks[-1]["output_ids"] == expected[1]
        stats = engine.get_stats()
        assert stats["dllm_blocks_committed"] > 0 and stats["dllm_rounds"] >= stats["dllm_steps"]
        assert all(rank["dllm_steps"] > 0 for rank in stats["dp_ranks"])


def test_http_native_and_openai_stream_blocks(served_checkpoint, checkpoint, prompts):
    import httpx
    import openai

    from test_server import Server

    expected = loom_alone(runner_for(checkpoint, "low_confidence"), prompts[:1])[0]
    server = Server("--model-path", str(served_checkpoint), "--dllm-algorithm", "low_confidence", "--dllm-block-size",
                    str(BLOCK), "--dllm-threshold", str(THRESHOLD), "--page-size", str(BLOCK))
    try:
        body = {"input_ids": prompts[0], "sampling_params": GREEDY, "stream": True}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        # prompt of 5: 3 outputs in its block, then 8, 8 and the last 1
        assert streamed_at_block_ends([len(e["output_ids"]) for e in events], [3, 11, 19, 20]), events
        assert events[-1]["output_ids"] == expected
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=NEW_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        texts = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
        # one chunk per committed block (a block whose text ends mid-character waits for the next)
        assert 2 <= len(texts) <= 4
        assert "".join(texts) == events[-1]["text"]
        bad = httpx.post(server.url + "/generate", json={"input_ids": prompts[0],
                                                           "sampling_params": {"max_new_tokens": 4, "logprobs": True}})
        assert bad.status_code == 400 and "logprobs" in bad.text
    finally:
        server.stop()
