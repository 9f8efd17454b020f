"""Overlap scheduling: the core planned one step ahead of its results (placeholders resolved in
the worker's future map) against the normal order, first without processes (a fake worker with
its own future map, random workloads), then through every process with SmolLM2."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ipc.messages import SamplingParams, future_capacity
from scheduler_proc.req import Req
from test_core import EOS, FakeWorker, drained, make_core, next_token


class FutureWorker(FakeWorker):
    """The fake worker with a future map: input references -k - 1 read entry k, and every
    step's sampled tokens are stored in their entries. Its model ends a request (EOS) where the
    next token would be a multiple of `eos_every`, so requests finish at lengths the scheduler
    cannot foresee."""

    def __init__(self, max_running: int, eos_every: int = 0):
        super().__init__()
        self.futures = np.zeros(future_capacity(max_running), dtype=np.int32)
        self.eos_every = eos_every
        self.references_seen = 0

    def forward(self, b):
        ids = np.frombuffer(b.input_ids, np.int32).copy()
        refs = ids < 0
        self.references_seen += int(refs.sum())
        ids[refs] = self.futures[-ids[refs] - 1]
        tokens = super().forward(msgspec.structs.replace(b, input_ids=ids.tobytes()))
        if self.eos_every:
            tokens = [EOS if t % self.eos_every == 0 else t for t in tokens]
        if len(tokens) == len(b.future_slots):  # (a step with drafts is never planned past, as in the worker)
            self.futures[b.future_slots] = tokens
        return tokens


def drive(core, worker, overlap: bool, on_step=None, max_steps: int = 20_000):
    """Runs the core as the scheduler's event loops do (scheduler_proc/event_loop.py): overlap
    launches step N+1 before applying step N's result. Returns outputs, finishes, overlapped steps."""
    outputs, finishes, results = {}, {}, {}
    overlapped = 0

    def record(outs):
        for o in outs:
            outputs.setdefault(o.req.rid, []).extend(o.new_ids)
            if o.finished:
                assert o.req.rid not in finishes, "a request ended twice"
                finishes[o.req.rid] = o.req.finish

    def apply(batch):
        record(core.on_result(batch, results.pop(batch.step)))

    in_flight = None
    for step in range(max_steps):
        if on_step:
            record(on_step(step, core))
        if in_flight is not None and (not overlap or core.overlap_blocker(in_flight)):
            apply(in_flight)
            in_flight = None
        batch, ended = core.next_batch()
        record(ended)
        if batch is not None:
            results[batch.step] = worker.forward(batch.to_worker_batch())  # the worker runs steps in order
            overlapped += in_flight is not None
        if in_flight is not None:
            apply(in_flight)
        in_flight = batch
        if in_flight is None and not core.waiting and not core.running:
            break
    assert drained(core)
    return outputs, finishes, overlapped


def workload(seed: int, n: int = 12, **sp) -> list[Req]:
    rng = np.random.default_rng(seed)
    return [Req(f"r{i}", rng.integers(3, 900, int(rng.integers(1, 90))).tolist(),
                SamplingParams(max_new_tokens=int(rng.integers(1, 40)), **sp), arrival=float(i)) for i in range(n)]


def both(cfg: dict, reqs_of, eos_every: int = 0, on_step=None):
    runs = {}
    for overlap in (False, True):
        core = make_core(**cfg)
        worker = FutureWorker(cfg.get("max_running_requests", 16), eos_every)
        for r in reqs_of():
            core.add_request(r)
        runs[overlap] = (*drive(core, worker, overlap, on_step), worker, core)
    return runs


def test_outputs_and_finishes_equal_the_normal_order_and_steps_really_overlap():
    runs = both({}, lambda: workload(0), eos_every=13)
    (out_n, fin_n, _, worker_n, _), (out_o, fin_o, overlapped, worker_o, _) = runs[False], runs[True]
    assert out_o == out_n and fin_o == fin_n
    assert {f.type for f in fin_o.values()} == {"stop", "length"}  # EOS found one step late, and lengths
    assert worker_n.references_seen == 0  # the normal order never sends a reference
    assert worker_o.references_seen > 0 and overlapped > 0
    for rid, ids in out_o.items():  # no token past a stop
        assert EOS not in ids[:-1] and len(ids) <= 40


def test_a_length_limit_is_not_planned_past():
    """A request whose token in flight is its last gets no further decode step."""
    core = make_core()
    worker = FutureWorker(16)
    core.add_request(Req("a", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True)))
    outputs, finishes, _ = drive(core, worker, overlap=True)
    assert len(outputs["a"]) == 3 and finishes["a"].type == "length"
    assert core.step == 3  # prompt step + 2 decodes: none wasted


config = st.fixed_dictionaries({
    "max_total_tokens": st.integers(200, 800),
    "max_running_requests": st.integers(1, 8),
    "max_prefill_tokens": st.integers(8, 200),
    "chunked_prefill_size": st.one_of(st.none(), st.integers(4, 64)),
    "enable_mixed_chunk": st.booleans(),
    "decode_first": st.booleans(),
    "init_new_token_ratio": st.sampled_from([0.0, 0.7]),
    "min_new_token_ratio": st.just(0.0),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# (a prompt's last chunk takes one slot more than the reservation held for it: admission overran)
@example(cfg={"max_total_tokens": 292, "max_running_requests": 4, "max_prefill_tokens": 14,
              "chunked_prefill_size": 14, "enable_mixed_chunk": False, "decode_first": True,
              "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
         seed=1311, eos_every=0, stop_at=None, groups=False)
@given(cfg=config, seed=st.integers(0, 10_000), eos_every=st.sampled_from([0, 7, 29]),
       stop_at=st.sampled_from([None, 101, 404]), groups=st.booleans())
def test_random_workloads_give_the_same_outputs_in_both_orders(cfg, seed, eos_every, stop_at, groups):
    """Retractions (small pools), chunked prompts, mixed and unmixed steps, stop tokens, EOS one
    step late, shared prefills: the overlap order gives the normal order's tokens and finishes."""
    def reqs():
        out = workload(seed, stop_token_ids=[stop_at] if stop_at else [])
        if groups:  # the n choices of one prompt share its prefill
            out += [Req(f"g{k}", list(out[0].input_ids), out[0].sampling, arrival=99.0, prefill_group="g")
                    for k in range(3)]
        return out

    runs = both(cfg, reqs, eos_every)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]


def test_an_abort_while_steps_are_in_flight_frees_everything():
    victims = {3: "r1", 7: "r4", 11: "r8"}  # (step of the loop, request)

    def on_step(step, core):
        return core.abort(victims[step]) if step in victims else []

    def reqs():
        return [Req(f"r{i}", list(range(10 + i, 30 + 2 * i)), SamplingParams(max_new_tokens=30, ignore_eos=True),
                    arrival=float(i)) for i in range(10)]

    runs = both({}, reqs, on_step=on_step)
    (out_n, fin_n, *_), (out_o, fin_o, *_) = runs[False], runs[True]
    assert sum(f.type == "abort" for f in fin_o.values()) == 3
    for rid in out_n:
        if "abort" in (fin_n[rid].type, fin_o[rid].type):  # cut at different points: one a prefix of the other
            short, long = sorted((out_n[rid], out_o[rid]), key=len)
            assert long[: len(short)] == short
        else:
            assert out_o[rid] == out_n[rid] and fin_o[rid] == fin_n[rid]


@pytest.mark.parametrize("max_new", [1, 2])
def test_one_and_two_token_outputs(max_new):
    runs = both({}, lambda: [Req("x", [9, 8, 7], SamplingParams(max_new_tokens=max_new, ignore_eos=True))])
    assert runs[True][0] == runs[False][0] and len(runs[True][0]["x"]) == max_new


def test_tokens_are_the_model_s_whatever_the_order():
    core = make_core()
    worker = FutureWorker(16)
    prompt = [11, 12, 13]
    core.add_request(Req("x", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True)))
    outputs, *_ = drive(core, worker, overlap=True)
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(next_token(tokens))
    assert outputs["x"] == tokens[3:]


# ---- through every process: SmolLM2, float32 ---------------------------------------------------

@pytest.fixture(scope="module")
def engines(default_model_dir):
    """One Engine per loop (normal, overlap), started once for the tests below."""
    from launch import Engine

    made = {}
    try:
        for loop, disable in (("normal", True), ("overlap", False)):
            made[loop] = Engine(dtype="float32", kv_cache_gb=0.5, max_running_requests=64,
                                disable_overlap_schedule=disable, log_level="warning")
        yield made
    finally:
        for e in made.values():
            e.shutdown()


def test_greedy_and_seeded_outputs_are_the_same_in_both_loops(engines, chat_prompt_ids):
    prompts = [list(p) for p in chat_prompt_ids]
    greedy = {"max_new_tokens": 64, "temperature": 0}
    seeded = {"max_new_tokens": 64, "temperature": 0.8, "top_p": 0.9, "seed": 1234}
    outs = {}
    for loop, engine in engines.items():
        alone = [engine.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts[:4]]
        batched = [o["output_ids"] for o in engine.generate(input_ids=prompts * 8, sampling_params=greedy)]
        sampled = [o["output_ids"] for o in engine.generate(input_ids=prompts * 2, sampling_params=seeded)]
        outs[loop] = (alone, batched, sampled)
        assert engine.get_stats()["overlapped_steps"] > 0 if loop == "overlap" else True
    assert outs["overlap"][0] == outs["normal"][0]
    assert outs["overlap"][1] == outs["normal"][1]
    assert outs["overlap"][2] == outs["normal"][2]
    # (batched = alone, as the parity tests say)
    assert [o for i, o in enumerate(outs["normal"][1]) if i % len(prompts) < 4] == outs["normal"][0] * 8


def _stop_cases(engine, prompt: list[int]) -> list[dict]:
    """Sampling params that end a greedy completion each way, found from its unbounded output:
    length, EOS, a stop string that spans a token boundary, a stop regex."""
    ref = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 48, "temperature": 0,
                                                              "skip_special_tokens": False})
    ids = ref["output_ids"]
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    i = next(i for i in range(3, len(ids) - 1)
             if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    across = pieces[i][-2:] + pieces[i + 1][:2]  # the last two characters of one token, the first two of the next
    word = next(w for w in ref["text"].split() if w.isalpha() and len(w) >= 4)
    return [{"max_new_tokens": 7}, {"max_new_tokens": 64}, {"max_new_tokens": 48, "stop": [across]},
            {"max_new_tokens": 48, "stop_regex": [word[:3] + "[a-z]"]}]


def test_stop_conditions_end_at_the_same_token_in_both_loops(engines, chat_prompt_ids):
    prompt = list(chat_prompt_ids[1])
    cases = _stop_cases(engines["normal"], prompt)
    results = {loop: [e.generate(input_ids=prompt, sampling_params={**c, "temperature": 0}) for c in cases]
               for loop, e in engines.items()}
    kinds = []
    for normal, overlap in zip(results["normal"], results["overlap"]):
        assert overlap["output_ids"] == normal["output_ids"] and overlap["text"] == normal["text"]
        assert overlap["meta_info"]["completion_tokens"] == len(overlap["output_ids"])
        assert overlap["meta_info"]["finish_reason"] == normal["meta_info"]["finish_reason"]
        kinds.append(normal["meta_info"]["finish_reason"]["type"])
    assert kinds[0] == "length" and len(results["overlap"][0]["output_ids"]) == 7
    assert results["overlap"][1]["meta_info"]["finish_reason"]["matched"] in engines["overlap"].tokenizer.all_special_ids
    assert kinds[2:] == ["stop", "stop"]


def test_an_abort_mid_stream_ends_the_text_there_and_frees_everything(engines, chat_prompt_ids):
    engine = engines["overlap"]
    full = engine.generate(input_ids=list(chat_prompt_ids[2]),
                           sampling_params={"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})
    chunks = []
    for chunk in engine.generate(input_ids=list(chat_prompt_ids[2]), stream=True, rid="cut",
                                 sampling_params={"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}):
        chunks.append(chunk)
        if len(chunk["output_ids"]) >= 5 and not any(len(c["output_ids"]) >= 5 for c in chunks[:-1]):
            engine.abort("cut")  # once, mid-stream
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["output_ids"] == full["output_ids"][: len(last["output_ids"])]
    assert last["meta_info"]["completion_tokens"] == len(last["output_ids"]) < 64


def test_nothing_leaks_after_retractions_and_aborts_in_the_overlap_loop(default_model_dir, chat_prompt_ids):
    from launch import Engine

    with Engine(dtype="float32", kv_cache_gb=0.02, max_running_requests=16, log_level="warning") as engine:
        assert engine.get_stats()["overlap_schedule"] == 1
        prompts = [list(p) for p in chat_prompt_ids] * 2
        done = []
        thread = threading.Thread(target=lambda: done.append(engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})))
        thread.start()
        time.sleep(1.0)
        engine.abort()  # everything, mid-run
        thread.join(120)
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 40, "temperature": 0,
                                                                    "ignore_eos": True})
        assert all(len(o["output_ids"]) == 40 for o in outs)
        stats = engine.get_stats()
        assert stats["num_retractions"] > 0
        assert stats["kv_slots_total"] - stats["kv_slots_free"] == stats["kv_slots_evictable"]
        assert stats["kv_slots_locked"] == 0 and stats["req_slots_free"] == stats["req_slots_total"]
        assert stats["idle_check_failures"] == 0 and stats["num_running"] == 0
        assert engine.flush_cache() is None and engine.get_stats()["kv_slots_free"] == stats["kv_slots_total"]


def test_step_metrics_sum_log_and_count_the_busy_fraction():
    from scheduler_proc.step_metrics import StepMetrics

    m = StepMetrics(log_interval=2)
    assert m.on_step(0.100, 0.0, 0.0) is None
    m.on_scheduler_cpu(0.002)
    line = m.on_step(0.100, 0.010, 0.0)
    assert line is not None and "busy 0.952" in line and "scheduler cpu 1.00 ms" in line
    m.overlap_skips["after-retraction"] = 3
    stats = m.stats()
    assert stats["forward_steps"] == 2 and stats["busy_fraction"] == pytest.approx(0.2 / 0.21)
    assert stats["overlap_skipped_after_retraction"] == 3 and m.window.steps == 0


def test_the_overlap_benchmark_runs_both_loops(default_model_dir, tmp_path):
    from benchmarks.bench_overlap import main

    out = main(["--num-requests", "4", "--decode-requests", "4", "--skip-serving", "--json", str(tmp_path / "o.json")])
    loops = [side["loop"] for side in out["results"]]
    assert loops == ["normal", "overlap"]
    normal, overlap = (side["offline"] for side in out["results"])
    assert normal["overlapped_steps"] == 0 < overlap["overlapped_steps"]
    assert 0 < overlap["busy_fraction"] <= 1 and normal["output_tok_s"] > 0
