"""The simulator (sim/): workloads, the scheduling core on a virtual clock, global schedulers,
pipeline stages, preemption, the prefix cache, predictors, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.step_metrics import STEP_FEATURES, step_features
from sim import metrics, workload
from sim.predictor import MODELS, Device, FittedPredictor, Predictor, RooflinePredictor
from sim.simulator import Simulator

ROOT = Path(__file__).resolve().parent.parent


class UnitSteps(Predictor):
    """Every step takes `per_step` seconds plus `per_token` per token computed."""

    description = "unit"

    def __init__(self, per_step: float = 0.01, per_token: float = 0.0):
        self.per_step, self.per_token = per_step, per_token
        self.batches = []

    def seconds(self, batch) -> float:
        self.batches.append([(r.req.rid, r.prefix_len, r.extend_len) for r in batch.rows])
        return self.per_step + self.per_token * batch.num_tokens

    def seconds_of_shape(self, shape: tuple) -> float:
        return self.per_step + self.per_token * shape[0]


def config(**kw) -> SchedulerConfig:
    base = dict(max_total_tokens=20_000, max_running_requests=16, max_prefill_tokens=512, max_context_len=4096,
                chunked_prefill_size=256)
    base.update(kw)
    return SchedulerConfig(**base)


def test_generated_workloads():
    reqs = workload.generate(4000, rate=50.0, min_len=256, max_len=2048, pd_ratio=20.0, seed=1)
    gaps = np.diff([r.arrival for r in reqs])
    assert abs(gaps.mean() - 1 / 50) < 0.002 and abs(gaps.std() / gaps.mean() - 1) < 0.08  # Poisson: cv 1
    total = np.array([r.prompt_len + r.output_len for r in reqs])
    assert 256 <= total.min() and total.max() <= 2048 and abs(total.mean() - 1152) < 30
    ratio = sum(r.prompt_len for r in reqs) / sum(r.output_len for r in reqs)
    assert 19 < ratio < 21
    bursty = workload.generate(4000, arrival="gamma", rate=50.0, cv=3.0, seed=1)
    g = np.diff([r.arrival for r in bursty])
    assert abs(g.mean() - 1 / 50) < 0.004 and 2.5 < g.std() / g.mean() < 3.5
    z = workload.generate(3000, length_dist="zipf", pd_ratio=None, prompt_len=(10, 1000), output_len=(5, 50), seed=2)
    prompts = np.array([r.prompt_len for r in z])
    assert np.median(prompts) < 40 and prompts.max() > 500  # many short, a few long
    burst = workload.generate(10, arrival="burst", seed=3)
    assert all(r.arrival == 0 for r in burst)
    with pytest.raises(ValueError, match="length distribution"):
        workload.generate(3, length_dist="pareto")


def test_shared_prefixes_share_exactly_their_prefix():
    reqs = workload.generate(20, shared_prefix_groups=2, shared_prefix_len=100, seed=4)
    ids = [r.prompt_ids(i) for i, r in enumerate(reqs)]
    for i, a in enumerate(reqs):
        assert len(ids[i]) == a.prompt_len
        for j, b in enumerate(reqs[:i]):
            common = next((k for k, (x, y) in enumerate(zip(ids[i], ids[j])) if x != y), 0)
            assert common == (100 if a.prefix_group == b.prefix_group else 0)


def test_traces_replay(tmp_path):
    (tmp_path / "t.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,100,10\n0.1,20,3\n")
    reqs = workload.from_csv(tmp_path / "t.csv")
    assert [(r.arrival, r.prompt_len, r.output_len) for r in reqs] == [(0.1, 20, 3), (0.5, 100, 10)]
    serving = {"requests": {"start_s": [10.0, 10.5], "input_lens": [30, 40], "expected_output_lens": [5, 6],
                            "ttfts_s": [0.1, 0.3], "e2e_latencies_s": [1.0, 2.0]}, "output_throughput": 7.0}
    (tmp_path / "s.json").write_text(json.dumps(serving))
    reqs, measured = workload.from_bench_json(tmp_path / "s.json")
    assert [(r.arrival, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 30, 5), (0.5, 40, 6)]
    assert measured == {"ttft_s": pytest.approx(0.2), "e2e_s": pytest.approx(1.5), "output_tok_s": 7.0}


def test_every_request_completes_on_the_virtual_clock():
    reqs = workload.generate(300, rate=40.0, pd_ratio=None, prompt_len=(10, 300), output_len=(1, 40), seed=5)
    res = Simulator(config(), UnitSteps(0.01, 1e-5), replicas=2, progress=False).run(reqs)
    by = {r.rid: r for r in res.records}
    for spec in reqs:
        rec = by[spec.rid]
        assert rec.tokens == spec.output_len and rec.finish_reason == "length"
        assert rec.arrival <= rec.scheduled <= rec.first_token <= rec.finished
        assert rec.first_token > rec.arrival  # a step takes time
    s = metrics.summary(res)
    assert s["completed"] == 300 and s["output_tokens"] == sum(r.output_len for r in reqs)
    assert len(res.tbts) == sum(r.output_len - 1 for r in reqs)
    assert s["ttft_s"]["p50"] >= 0.01 and s["tbt_s"]["p50"] >= 0.01


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_plans_the_next_step_as_a_step_starts(overlap):
    """As the live overlap loop: the step after the one running was planned when it started, so a
    request arriving meanwhile joins the step after next; without overlap, the next one."""
    reqs = [workload.SimRequest("a", 0.0, 16, 10), workload.SimRequest("b", 0.005, 16, 10)]
    res = Simulator(config(), UnitSteps(0.01), progress=False, overlap=overlap).run(reqs)
    by = {r.rid: r for r in res.records}
    assert by["a"].scheduled == 0.0 and by["a"].first_token == pytest.approx(0.01)
    assert by["b"].first_token == pytest.approx(0.03 if overlap else 0.02)
    assert all(r.tokens == 10 for r in res.records)


def _simulate_diffusion(mode: str, block: int = 8):
    reqs = [workload.SimRequest(f"r{i}", 0.0, 5 + 3 * i, 20) for i in range(8)]  # 3 blocks of output each
    cfg = config(dllm_block_size=block, dllm_fdfo=mode != "sync", dllm_in_place=mode == "fdfo",
                 max_running_requests=8)
    sim = Simulator(cfg, UnitSteps(0.01, 1e-4), progress=False, dllm_rounds=(1, 6), seed=3)
    return reqs, sim, sim.run(reqs)


@pytest.mark.parametrize("mode", ["sync", "fdfo", "fdfo-no-reloop"])
def test_block_diffusion_is_simulated_by_the_core_s_planner(mode):
    """Diffusion steps planned by the core (scheduler_proc/dllm.py), rounds per block drawn by
    sim/dllm.py: every request ends with its length, committed a block at a time; sync steps run
    every block to its end (the 8 requests that start together move together), FDFO without
    re-loop one round per step."""
    block = 8
    reqs, sim, res = _simulate_diffusion(mode, block)
    assert all(r.tokens == 20 and r.finish_reason == "length" for r in res.records)
    stats = sim.replicas[0].core.stats()
    blocks = sum(-(-(len(r.prompt_ids(i)) + 20) // block) - len(r.prompt_ids(i)) // block for i, r in enumerate(reqs))
    assert stats["dllm_blocks_committed"] == blocks
    if mode == "fdfo-no-reloop":
        assert stats["dllm_steps"] == stats["dllm_rounds"]
    elif mode == "sync":
        assert stats["dllm_steps"] <= 4  # (a prompt's last block may hold its first outputs: 3 or 4 blocks)
    else:
        assert stats["dllm_steps"] > 4


def test_fdfo_gets_first_blocks_out_sooner_than_sync_in_the_simulator():
    ttft = {mode: np.mean([r.first_token for r in _simulate_diffusion(mode)[2].records]) for mode in ("sync", "fdfo")}
    assert ttft["fdfo"] < ttft["sync"]


@pytest.mark.parametrize("strategy", ["loom", "sarathi", "vllm", "orca", "lightllm", "static"])
def test_the_simulator_steps_are_the_core_s_steps(strategy):
    """All at once: the simulator's steps are exactly those of the scheduling core driven
    directly (it re-implements nothing)."""
    reqs = workload.generate(40, arrival="burst", pd_ratio=None, prompt_len=(5, 400), output_len=(1, 30), seed=6)
    unit = UnitSteps()
    Simulator(config(batching_strategy=strategy, max_total_tokens=3000), unit, progress=False).run(reqs)

    from ipc.messages import SamplingParams
    from scheduler_proc.req import Req

    core = SchedulerCore(config(batching_strategy=strategy, max_total_tokens=3000))
    for i, r in enumerate(reqs):
        core.add_request(Req(r.rid, r.prompt_ids(i), SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)))
    direct = []
    while True:
        batch, _ = core.next_batch(0.0)
        if batch is None:
            break
        direct.append([(r.req.rid, r.prefix_len, r.extend_len) for r in batch.rows])
        core.on_result(batch, [1] * sum(r.samples for r in batch.rows))
    assert unit.batches == direct


def test_global_schedulers_spread_the_load():
    reqs = workload.generate(400, rate=100.0, seed=7, pd_ratio=None, prompt_len=(10, 100), output_len=(5, 60))
    counts = {}
    for method in ("round_robin", "lor", "random", "total_tokens", "total_requests"):
        res = Simulator(config(), UnitSteps(0.01), replicas=4, load_balance_method=method, progress=False).run(reqs)
        counts[method] = np.bincount([r.replica for r in res.records], minlength=4)
        assert counts[method].sum() == 400
    assert counts["round_robin"].tolist() == [100] * 4
    for method in ("lor", "total_tokens", "total_requests", "random"):
        assert counts[method].min() > 60, (method, counts[method])


def test_pipeline_stages_overlap_disjoint_micro_batches():
    reqs = workload.generate(64, arrival="burst", pd_ratio=None, prompt_len=(20, 20), output_len=(50, 50), seed=8)
    one = Simulator(config(max_running_requests=64), UnitSteps(0.02), progress=False).run(reqs)

    unit = UnitSteps(0.02)
    two = Simulator(config(max_running_requests=64), unit, pp_stages=2, progress=False).run(reqs)
    for a, b in zip(unit.batches, unit.batches[1:]):  # consecutive steps are in flight together
        assert not {r for r, _, _ in a} & {r for r, _, _ in b}
    s1, s2 = metrics.summary(one), metrics.summary(two)
    assert s2["completed"] == 64
    # two stages of half the step: twice the steps in flight, each request one step per full step time
    assert s2["output_tok_s"] == pytest.approx(s1["output_tok_s"], rel=0.1)
    assert s2["mean_batch_rows"] == pytest.approx(s1["mean_batch_rows"] / 2, rel=0.1)


def test_preemption_restarts_and_counts_lost_time():
    reqs = workload.generate(40, arrival="burst", pd_ratio=None, prompt_len=(50, 60), output_len=(80, 100), seed=9)
    res = Simulator(config(max_total_tokens=1200, init_new_token_ratio=0.0, min_new_token_ratio=0.0,
                           batching_strategy="vllm"), UnitSteps(0.01), progress=False).run(reqs)
    s = metrics.summary(res)
    assert s["completed"] == 40 and s["preemptions"] > 0
    restarted = [r for r in res.records if r.restarts]
    assert restarted and all(r.preempted_s > 0 for r in restarted)


def test_the_prefix_cache_is_simulated():
    reqs = workload.generate(200, rate=50.0, pd_ratio=None, prompt_len=(20, 40), output_len=(5, 10),
                             shared_prefix_groups=4, shared_prefix_len=800, seed=10)
    ttft = {}
    for cache in (True, False):
        res = Simulator(config(enable_radix_cache=cache), UnitSteps(0.005, 2e-5), progress=False).run(reqs)
        ttft[cache] = metrics.summary(res)["ttft_s"]["p50"]
    assert ttft[True] < 0.7 * ttft[False]


def test_fitted_predictor_recovers_a_linear_step_time(tmp_path):
    rng = np.random.default_rng(11)
    true = {"tokens": 2e-5, "sampled": 1e-4, "prefill_attn": 1e-9, "decode_ctx": 3e-8, "rows": 5e-6}
    shapes = [tuple(float(x) for x in rng.integers(0, 2000, 5)) for _ in range(200)]
    seconds = [0.003 + sum(true[f] * x for f, x in zip(STEP_FEATURES, s)) for s in shapes]
    fitted = FittedPredictor.fit(shapes, seconds, {"cpu": "test"})
    assert fitted.intercept == pytest.approx(0.003, rel=1e-3)
    for f in STEP_FEATURES:
        assert fitted.coef[f] == pytest.approx(true[f], rel=1e-3)
    fitted.save(tmp_path / "p.json")
    again = FittedPredictor.load(tmp_path / "p.json")
    assert again.coef == fitted.coef and again.intercept == fitted.intercept


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    pred = RooflinePredictor.named("h100", "llama-2-7b")
    weights = MODELS["llama-2-7b"].weight_bytes
    core = SchedulerCore(config())
    from ipc.messages import SamplingParams
    from scheduler_proc.req import Req

    core.add_request(Req("a", [1] * 8, SamplingParams(max_new_tokens=5)))
    batch, _ = core.next_batch()
    bandwidth_bound = weights / (3.35e12 * 0.8) + 0.5e-3
    assert pred.seconds(batch) == pytest.approx(bandwidth_bound, rel=0.01)  # 8 tokens: weights dominate
    assert step_features(batch) == (8, 1, 8 * 4.5, 0, 1)
    core.add_request(Req("b", [2] * 4000, SamplingParams(max_new_tokens=5)))
    core.on_result(batch, [3])
    big = SchedulerCore(config(max_prefill_tokens=4000, chunked_prefill_size=None))
    big.add_request(Req("b", [2] * 4000, SamplingParams(max_new_tokens=5)))
    batch, _ = big.next_batch()
    assert pred.seconds(batch) > 4000 * 2 * 6.5e9 / 989e12  # compute bound: more than the ideal FLOP time


def test_roofline_over_tensor_parallel_devices_shares_the_work_and_pays_all_reduces():
    one = RooflinePredictor.named("a100", "llama-2-70b")
    two = RooflinePredictor.named("a100", "llama-2-70b", tensor_parallel=2)
    m = MODELS["llama-2-70b"]
    decode = (8, 8, 0, 8 * 1000, 8)  # 8 rows of 1,000 tokens of context
    collectives = 2 * m.layers * (10e-6 + 8 * (2 * 1 / 2) * m.hidden * 2 / 300e9)
    shared = (one.seconds_of_shape(decode) - 0.5e-3) / 2 + 0.5e-3
    assert two.seconds_of_shape(decode) == pytest.approx(shared + collectives, rel=1e-9)
    assert two.seconds_of_shape((0, 0, 0, 0, 0)) == pytest.approx(one.seconds_of_shape((0, 0, 0, 0, 0)) / 2 + 0.25e-3)
    with pytest.raises(ValueError, match="KV heads"):
        RooflinePredictor.named("a100", "llama-2-70b", tensor_parallel=3)
    with pytest.raises(ValueError):
        RooflinePredictor(Device(flops=1e12, bandwidth=1e12), m, tensor_parallel=2)  # no interconnect


def test_command_line_run_compare_and_replay(tmp_path):
    base = ["--hardware", "h100", "--model-shape", "llama-2-7b", "--num-requests", "300", "--rate", "20",
            "--no-progress", "--disable-radix-cache"]
    out = subprocess.run([sys.executable, "-m", "sim", "run", *base, "--dp-size", "2", "--out", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "300 requests on 2 replica(s)" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completed"] == 300
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == summary["steps"]
    assert (tmp_path / "run" / "latency.png").stat().st_size > 10_000
    assert len((tmp_path / "run" / "requests.csv").read_text().splitlines()) == 301
    out = subprocess.run([sys.executable, "-m", "sim", "compare", *base, "--vary", "batching_strategy=vllm,static",
                          "--out", str(tmp_path / "cmp")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    table = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert set(table) == {"batching_strategy=vllm", "batching_strategy=static"}
    # static batching waits for whole batches: its TTFT is worse at the same load
    assert table["batching_strategy=static"]["ttft_s"]["p50"] > table["batching_strategy=vllm"]["ttft_s"]["p50"]
    bad = subprocess.run([sys.executable, "-m", "sim", "run", "--num-requests", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--predictor" in bad.stderr


def test_profile_fits_this_machine_s_worker(tmp_path, default_model_dir):
    """python -m sim profile on a tiny model (a small grid), then a simulation on what it fitted."""
    from inproc import build_tiny_checkpoint, with_tokenizer

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=1), default_model_dir)
    out = subprocess.run([sys.executable, "-m", "sim", "profile", "--quick", "--model-path", str(path),
                          "--dtype", "float32", "--kv-cache-gb", "0.05", "--out", str(tmp_path / "p.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    fitted = json.loads((tmp_path / "p.json").read_text())
    assert len(fitted["samples"]) == fitted["meta"]["steps"] >= 8
    assert fitted["meta"]["kv_bytes_per_token"] > 0 and all(v >= 0 for v in fitted["coef"].values())
    run = subprocess.run([sys.executable, "-m", "sim", "run", "--predictor", str(tmp_path / "p.json"),
                          "--num-requests", "50", "--rate", "5", "--pd-ratio", "0", "--prompt-len", "8", "32",
                          "--output-len", "4", "8", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "50 requests on 1 replica(s)" in run.stdout


def test_the_scheduler_logs_every_step_for_the_fit(tmp_path, default_model_dir):
    """--step-log-file: one line per step with the shape the simulator predicts from; the prompt
    tokens and samples add up to the requests'; `python -m sim profile --step-log` fits them."""
    from inproc import build_tiny_checkpoint, with_tokenizer
    from launch import Engine
    from sim.profile import read_step_logs

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=1), default_model_dir)
    log = tmp_path / "steps.jsonl"
    prompts = [list(range(100 * k + 5, 100 * k + 5 + n)) for k, n in enumerate((7, 19, 40, 3))]  # no shared prefix
    with Engine(model_path=str(path), dtype="float32", kv_cache_gb=0.05, max_running_requests=4,
                step_log_file=str(log)) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "ignore_eos": True,
                                                                   "temperature": 0})
    assert all(o["meta_info"]["completion_tokens"] == 6 for o in outs)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    shapes, seconds, _ = read_step_logs([log])
    assert len(shapes) == len(steps) >= 6 and all(t > 0 for t in seconds)
    # (one step's wall share may be shorter than its forward: with overlap it ran while the one
    # before was still being applied; the worker's forwards all fit in the scheduler's time)
    assert sum(seconds) >= 0.8 * sum(s["forward_s"] for s in steps)
    tokens, sampled = sum(s[0] for s in shapes), sum(s[1] for s in shapes)
    assert sampled == 4 * 6 and tokens == sum(map(len, prompts)) + 4 * 5
    assert sum(s[3] for s in shapes) > 0 and max(s[4] for s in shapes) >= 2  # decode contexts; batched rows
    out = subprocess.run([sys.executable, "-m", "sim", "profile", "--step-log", str(log), "--out",
                          str(tmp_path / "p.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    fitted = json.loads((tmp_path / "p.json").read_text())
    assert fitted["meta"]["steps"] == len(steps) and fitted["meta"]["source"].startswith("step logs")


def test_profile_live_fits_a_serving_server_s_steps(tmp_path, default_model_dir):
    """python -m sim profile --live (a quick calibration load) on a tiny model; the fitted model
    carries what the simulator needs to size the pool."""
    from inproc import build_tiny_checkpoint, with_tokenizer
    from test_server import free_port

    # (the load's random prompts are drawn from the tokenizer's vocabulary: the model embeds it all)
    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=1, vocab_size=49152),
                          default_model_dir)
    out = subprocess.run([sys.executable, "-m", "sim", "profile", "--live", "--quick", "--port", str(free_port()),
                          "--model-path", str(path), "--dtype", "float32", "--kv-cache-gb", "0.05",
                          "--out", str(tmp_path / "p.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    fitted = json.loads((tmp_path / "p.json").read_text())
    meta = fitted["meta"]
    assert meta["source"] == "live server" and meta["dtype"] == "float32" and meta["kv_bytes_per_token"] > 0
    assert meta["steps"] >= 10 and all(v >= 0 for v in fitted["coef"].values())
