"""The benchmark tooling's own logic (probes, rooflines, baseline lists, plots, rounds), on tiny
inputs and no server; a few tests run a bench end to end for a few steps of the embedded model."""

from __future__ import annotations

import os
import statistics
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_offline import llama_cpp_installed, parse_baselines
from benchmarks.common import (AVX2_ONLY_ENV, avx2_only_vllm_env, measure_rounds, vllm_engine_args, vllm_env,
                               vllm_preloads, vllm_server_command, vllm_version)
from benchmarks.bench_one_batch import Step, WeightStats, add_rooflines, probed_rounds, summarize_steps
from benchmarks.bench_serving_compare import loom_server_command
from benchmarks.probes import (gemm_gflops, gemv_gbs, header_lines, load_loom_gemv, probe_gemm, probe_gemv,
                               probe_machine)
from worker_proc import cpu_kernels


def test_probe_machine_small_shapes_and_header():
    machine = probe_machine(["float32", "bfloat16"], kernel=False, gemm_shape=(16, 32, 64), gemv_shape=(256, 32),
                            gemv_working_set=1 << 20)
    for dtype in ("float32", "bfloat16"):
        assert gemm_gflops(machine, dtype) > 0
        assert gemv_gbs(machine, dtype) == machine["gemv"][dtype]["torch_gbs"] > 0
        assert machine["gemv"][dtype]["working_set_bytes"] >= 1 << 20
    text = "\n".join(header_lines(machine, {"loom": "bfloat16"}, ["model      x"]))
    for needle in ("CPU", "avx512f", "threads", "dtype loom bfloat16", "GEMM", "GEMV float32", "GEMV bfloat16",
                   "model      x"):
        assert needle in text


def test_probes_take_loom_packed_kernel_where_it_packs():
    kernel = load_loom_gemv()[0]
    if kernel is None:
        pytest.skip("loom's CPU kernels did not compile here")
    module = cpu_kernels.load()
    for dtype, pack in (("float32", module.pack_dense_f32), ("bfloat16", module.pack_dense_bf16)):
        packs = pack(torch.zeros(64, 64, dtype=getattr(torch, dtype))).numel() > 0
        gemm = probe_gemm(dtype, (64, 64, 64), kernel)
        assert (gemm["loom_gflops"] is not None) == packs
        assert gemm["gflops"] == max(gemm["torch_gflops"], gemm["loom_gflops"] or 0.0)
        gemv = probe_gemv(dtype, kernel, shape=(64, 64), working_set=1 << 16, rounds=1)
        assert (gemv["loom_packed_gbs"] is not None) == packs
        assert gemv["best_gbs"] == max(r for r in (gemv["torch_gbs"], gemv["loom_gbs"], gemv["loom_packed_gbs"]) if r)


def test_header_without_probes():
    machine = {"cpu": {"model_name": "cpu", "cores": 2, "flags": {"avx2": True}},
               "torch": {"version": "2", "threads": 2}}
    assert any("probes     skipped" in line for line in header_lines(machine))
    assert gemm_gflops(machine, "float32") is None and gemv_gbs(machine, "float32") is None


def test_parse_baselines():
    assert parse_baselines("none") == []
    assert parse_baselines("hf-cb,hf,hf") == ["hf", "hf-cb"]
    assert parse_baselines("hf,llamacpp-if-installed") == (["hf", "llamacpp"] if llama_cpp_installed() else ["hf"])
    with pytest.raises(ValueError, match="unknown"):
        parse_baselines("sglang")


def test_vllm_baseline_is_skipped_or_refused_without_its_python(tmp_path, capsys):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    assert parse_baselines("hf,vllm-if-installed", missing) == ["hf"]
    assert "vllm baseline skipped" in capsys.readouterr().out
    with pytest.raises(ValueError, match="does not exist"):
        parse_baselines("vllm", missing)
    # a python that runs but cannot import vllm
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    python.chmod(0o755)
    assert vllm_version(str(python)) == (None, f"{python} cannot import vllm: ModuleNotFoundError: "
                                               "No module named 'vllm'")


def test_vllm_command_and_environment(tmp_path):
    venv, libs = tmp_path / "venv", tmp_path / "libs"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    libs.mkdir()
    python = str(venv / "bin" / "python")
    assert vllm_preloads(python, [str(libs)]) == ([], ["tcmalloc", "libiomp5.so"])
    (libs / "libtcmalloc_minimal.so.4").touch()
    (venv / "lib" / "libiomp5.so").touch()
    found, missing = vllm_preloads(python, [str(libs)])
    assert found == [str(libs / "libtcmalloc_minimal.so.4"), str(venv / "lib" / "libiomp5.so")] and missing == []

    env = vllm_env(found, "0-3", base={"LD_PRELOAD": "/x/libother.so", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and env["PATH"] == "/bin"
    assert env["LD_PRELOAD"] == ":".join(found + ["/x/libother.so"])
    assert "LD_PRELOAD" not in vllm_env([], "0-3", base={})

    cmd = vllm_server_command(python, tmp_path / "model", 8123, "bfloat16",
                              {"max_num_seqs": 32, "kv_cache_memory_bytes": 2**31})
    assert cmd[:3] == [python, "-m", "vllm.entrypoints.openai.api_server"]
    args = [a for a in cmd[3:] if a != "--disable-uvicorn-access-log"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags == {"--model": str(tmp_path / "model"), "--dtype": "bfloat16", "--host": "127.0.0.1",
                     "--port": "8123", "--max-num-seqs": "32", "--kv-cache-memory-bytes": str(2**31)}

    # vLLM's KV cache dtype goes to its engine only where asked for (its fp8 against loom's int8)
    assert vllm_engine_args(32, 1056, 2.0) == {"max_num_seqs": 32, "max_num_batched_tokens": 1056,
                                               "kv_cache_memory_bytes": 2 * 2**30}
    engine = vllm_engine_args(32, 1056, 2.0, "fp8")
    assert engine["kv_cache_dtype"] == "fp8"
    assert "--kv-cache-dtype" in vllm_server_command(python, tmp_path / "model", 8123, "bfloat16", engine)


def test_weight_stats_counts_a_tied_head_once_and_skips_an_untied_embedding():
    config = SimpleNamespace(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                             num_layers=1, vocab_size=32)

    def model(tied: bool) -> torch.nn.Module:
        m = torch.nn.Module()
        m.embed_tokens = torch.nn.Embedding(32, 8)
        m.proj = torch.nn.Linear(8, 8, bias=False)
        m.lm_head = torch.nn.Linear(8, 32, bias=False)
        if tied:
            m.lm_head.weight = m.embed_tokens.weight
        return m.to(torch.bfloat16)

    per_layer = 8 * (2 + 2) * 4 + 2 * 4 * 8 + 8 * 2 * 16 + 16 * 8
    for tied in (True, False):
        stats = WeightStats.of(model(tied), config)
        assert stats.matmul_params == per_layer + 32 * 8
        assert stats.flops_per_token == 2 * stats.matmul_params
        assert stats.head_flops_per_token == 2 * 32 * 8
        assert stats.bytes == (8 * 8 + 32 * 8) * 2  # proj + head in bfloat16; the embedding never on its own


def test_weight_stats_count_packed_panels_instead_of_the_weight():
    """A linear whose weight is also packed for the kernel streams the panels plus the rows past the
    last whole panel of 16, not the [N, K] weight as well."""
    config = SimpleNamespace(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                             num_layers=1, vocab_size=32)
    m = torch.nn.Module()
    m.proj = torch.nn.Linear(8, 40, bias=False)  # 2 panels of 16 rows + 8 rows on their own
    m.proj.register_buffer("packed", torch.zeros(2, 8, 16), persistent=False)
    stats = WeightStats.of(m, config)
    assert stats.bytes == (2 * 8 * 16 + 8 * 8) * 4


def test_an_int4_layer_streams_its_panels_or_its_codes_by_the_row_count():
    """An int4 linear holds its weights twice (plain codes with scales and mins, and the integer
    GEMM's panels); a step reads the panels from int4_panel_rows() rows and the codes below."""
    from benchmarks.bench_one_batch import streamed_bytes
    from worker_proc.linear import Int4Linear
    from worker_proc.ops import Ops

    kernels = cpu_kernels.load("native")
    if kernels is None or not kernels.integer_panels():
        pytest.skip("this build has no integer panels")
    layer = Int4Linear(torch.randn(64, 128), None, Ops(kernels))
    assert layer.panels is not None
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    codes, panels = size(layer.qweight, layer.scale, layer.minimum), size(layer.panels)
    from_rows = kernels.int4_panel_rows()
    assert streamed_bytes(layer, rows=from_rows) == panels
    if from_rows > 1:
        assert streamed_bytes(layer, rows=1) == codes


def test_step_summary_and_rooflines():
    steps = [Step(False, 4, 4 * 100, forward_s=0.5, step_s=1.0)] + \
            [Step(True, 4, 4, forward_s=0.09, step_s=0.1) for _ in range(3)]
    row = summarize_steps(4, 100, steps)
    assert row["prefill_steps"] == 1 and row["prefill_tok_s"] == pytest.approx(400.0)
    assert row["decode_steps"] == 3 and row["decode_tok_s"] == pytest.approx(40.0)
    assert row["decode_step_ms_median"] == pytest.approx(100.0) and row["busy_fraction"] == pytest.approx(0.9)

    weights = WeightStats(matmul_params=1000, bytes=1_000_000_000, flops_per_token=2e9, head_flops_per_token=0.5e9)
    add_rooflines(row, weights, gemv_rate_gbs=10.0, gemm_rate_gflops=100.0, input_len=100)
    assert row["bandwidth_roof_tok_s"] == pytest.approx(40.0)  # 4 rows x 10 GB/s / 1 GB
    assert row["gemm_roof_tok_s"] == pytest.approx(50.0)  # 100 GFLOP/s / 2 GFLOP
    assert row["roof_tok_s"] == pytest.approx(40.0)
    assert row["decode_pct_of_bandwidth_roof"] == pytest.approx(100.0)
    assert row["decode_pct_of_gemm_roof"] == pytest.approx(80.0)
    # a prompt token: 2 GFLOP less the head's 0.5 but for 1 token in 100 -> 1.505 GFLOP
    assert row["prefill_gemm_roof_tok_s"] == pytest.approx(100.0 / 1.505)
    assert row["prefill_pct_of_gemm_roof"] == pytest.approx(400.0 * 1.505)
    # the batch's KV reads count with the weights: 4 rows x 10 GB/s / (1 + 0.25) GB
    add_rooflines(row, weights, gemv_rate_gbs=10.0, gemm_rate_gflops=100.0, input_len=100, kv_bytes_per_step=0.25e9)
    assert row["bandwidth_roof_tok_s"] == pytest.approx(32.0) and row["roof_tok_s"] == pytest.approx(32.0)


def test_probed_rounds_judge_each_round_by_the_probes_either_side():
    """probe, run, probe, ...: each round's share uses the mean of its own two probes, so one
    phase change moves one round and the median keeps the rest."""
    probes = iter([100.0, 100.0, 300.0, 300.0, 300.0])
    runs = iter([50.0, 100.0, 150.0, 150.0])
    rounds = probed_rounds(lambda: next(runs), lambda: next(probes), 4, roof_per_rate=1.0)
    assert rounds["probes"] == [100.0, 100.0, 300.0, 300.0, 300.0]
    assert rounds["pct_of_roof"] == pytest.approx([50.0, 50.0, 50.0, 50.0])
    assert rounds["median_pct_of_roof"] == pytest.approx(50.0)


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import plot_latency_cdf, plot_throughput_vs_batch

    assert plot_latency_cdf([0.1, 0.2, None], [0.5, 0.7, 0.9], tmp_path / "cdf.png").stat().st_size > 0
    rows = [{"batch_size": b, "decode_tok_s": 10.0 * b, "prefill_tok_s": 100.0 * b, "roof_tok_s": 20.0 * b,
             "prefill_gemm_roof_tok_s": 1000.0} for b in (1, 4)]
    assert plot_throughput_vs_batch(rows, tmp_path / "tput.png").stat().st_size > 0


def test_one_batch_rooflines_come_from_probes_paired_with_each_batch(default_model_dir, tmp_path):
    """End to end on the embedded model, a few steps: every batch size probes right before and after
    its timed steps, and its roofs are the mean of those two probes, not the start-up probe's."""
    from benchmarks import bench_one_batch

    result = bench_one_batch.main(["--batch-sizes", "1,2", "--input-len", "8", "--output-len", "3", "--dtype",
                                   "float32", "--no-plot", "--probe-working-set-mb", "64",
                                   "--json", str(tmp_path / "one_batch.json")])
    weights = result["model"]["weight_bytes"]
    # SmolLM2 in float32: 30 layers x K and V x 3 heads x 64 x 4 bytes a token, 8 + 3 / 2 tokens a row
    kv_per_row = 30 * 2 * 3 * 64 * 4 * 9.5
    assert result["rooflines"]["paired_probes"]
    for row in result["results"]:
        gemv, gemm = row["paired_probes"]["gemv_gbs"], row["paired_probes"]["gemm_gflops"]
        assert len(gemv) == len(gemm) == 2 and min(gemv + gemm) > 0
        assert row["kv_bytes_per_step"] == pytest.approx(row["batch_size"] * kv_per_row)
        assert row["bandwidth_roof_tok_s"] == pytest.approx(
            row["batch_size"] * sum(gemv) / 2 * 1e9 / (weights + row["batch_size"] * kv_per_row))
        assert row["gemm_roof_tok_s"] == pytest.approx(sum(gemm) / 2 * 1e9 / result["model"]["flops_per_token"])
        assert row["decode_steps"] == 2 and row["decode_tok_s"] > 0


def test_one_batch_decode_rounds_judge_each_batch_by_gemv_probes_either_side(default_model_dir, tmp_path):
    """--decode-rounds: the batch runs N more times between GEMV probes; its %BW roof becomes the
    rounds' median share, each round's roof from the mean of its two probes."""
    from benchmarks import bench_one_batch

    result = bench_one_batch.main(["--batch-sizes", "1", "--input-len", "8", "--output-len", "3", "--dtype",
                                   "float32", "--no-plot", "--probe-working-set-mb", "64", "--decode-rounds", "2",
                                   "--json", str(tmp_path / "one_batch.json")])
    [row] = result["results"]
    rounds = row["decode_rounds"]
    assert len(rounds["tok_s"]) == 2 and len(rounds["probes"]) == 3 and min(rounds["probes"]) > 0
    step_bytes = result["model"]["weight_bytes"] + row["kv_bytes_per_step"]
    for tok_s, pct, a, b in zip(rounds["tok_s"], rounds["pct_of_roof"], rounds["probes"], rounds["probes"][1:]):
        assert pct == pytest.approx(100.0 * tok_s / ((a + b) / 2 * 1e9 / step_bytes))
    assert row["decode_pct_of_bandwidth_roof"] == pytest.approx(statistics.median(rounds["pct_of_roof"]))
    assert row["decode_pct_of_bandwidth_roof_own_probes"] > 0
    with pytest.raises(SystemExit):
        bench_one_batch.parse_args(["--decode-rounds", "2", "--no-probe"])


def test_parallel_benchmark_reports_each_configuration_and_its_collectives(default_model_dir, tmp_path, capsys):
    from benchmarks.bench_parallel import main, parse_configs

    assert parse_configs("dp1-tp1, dp2-tp3, dp1-tp2-pp2") == [(1, 1, 1), (2, 3, 1), (1, 2, 2)]
    with pytest.raises(SystemExit):
        parse_configs("tp2")
    out = main(["--configs", "dp1-tp1,dp2-tp1,dp1-tp3", "--num-requests", "4", "--input-range", "8,16",
                "--output-range", "4,8", "--kv-cache-gb", "0.3", "--json", str(tmp_path / "p.json")])
    single, dp2, tp3 = out["results"]
    assert [len(r["ranks"]) for r in out["results"]] == [1, 2, 1]
    assert all(r["output_tokens"] == single["output_tokens"] > 0 for r in out["results"])
    assert sum(rank["requests"] for rank in dp2["ranks"]) == 4
    assert single["ranks"][0]["collective_ms_per_step"] == 0  # no collectives without tensor parallelism
    assert 0 < tp3["ranks"][0]["collective_ms_per_step"] < tp3["ranks"][0]["forward_ms_per_step"]
    assert "collective ms/step" in capsys.readouterr().out and (tmp_path / "p.json").exists()


def test_shared_prefix_and_multi_turn_datasets(smollm2_tokenizer):
    from benchmarks.bench_serving import multi_turn_conversations, shared_prefix_requests, ttft_by_turn, RequestResult

    reqs = shared_prefix_requests(smollm2_tokenizer, groups=3, per_group=4, system_len=50, question_len=5,
                                  output_len=7, seed=0)
    assert len(reqs) == 12 and all(r.input_len == 55 and r.output_len == 7 for r in reqs)
    systems = {tuple(r.input_ids[:50]) for r in reqs}
    assert len(systems) == 3 and len({tuple(r.input_ids) for r in reqs}) == 12
    assert [tuple(r.input_ids[:50]) for r in reqs[:4]] != [tuple(reqs[0].input_ids[:50])] * 4  # interleaved
    convs = multi_turn_conversations(smollm2_tokenizer, num=2, turns=3, user_len=6, output_len=4, seed=1)
    assert [len(c.user_turns) for c in convs] == [3, 3] and all(len(u) == 6 for c in convs for u in c.user_turns)
    results = [RequestResult(1, 1, success=True, ttft=t, turn=k) for k, t in ((0, 0.1), (1, 0.2), (0, 0.3))]
    assert [(t["turn"], t["completed"], t["ttft_ms"]["median"]) for t in ttft_by_turn(results)] == \
        [(0, 2, pytest.approx(200.0)), (1, 1, pytest.approx(200.0))]


def test_one_batch_with_the_hf_baseline_writes_its_result(tmp_path, default_model_dir):
    """The loom runner is freed before the baseline runs; the result still names its kernels."""
    from benchmarks import bench_one_batch
    from inproc import build_tiny_checkpoint, with_tokenizer

    # (the prompts are drawn from the tokenizer's vocabulary: the model embeds it all)
    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=1, vocab_size=49152),
                          default_model_dir)
    result = bench_one_batch.main(["--model-path", str(path), "--batch-sizes", "1", "--input-len", "8",
                                   "--output-len", "4", "--dtype", "float32", "--no-probe", "--no-plot",
                                   "--hf-baseline", "--json", str(tmp_path / "one_batch.json")])
    # (a tiny model's timings are noise: only that the baseline ran and the result was written)
    assert result["model"]["kernel_isa"] and "decode_tok_s" in result["hf_batch1"]
    assert (tmp_path / "one_batch.json").exists()


def test_one_batch_runs_the_kv_cache_dtype_it_is_given(tmp_path, default_model_dir):
    """--kv-cache-dtype reaches the runner (as launch.py's flag does): the pool is int8 and each
    row's KV reads a step are counted in int8 codes plus their scales."""
    from benchmarks import bench_one_batch
    from inproc import build_tiny_checkpoint, with_tokenizer
    from worker_proc.kv_cache import KVPool
    from worker_proc.model_config import ModelConfig

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=2, vocab_size=49152),
                          default_model_dir)
    result = bench_one_batch.main(["--model-path", str(path), "--batch-sizes", "2", "--input-len", "8",
                                   "--output-len", "4", "--dtype", "float32", "--kv-cache-dtype", "int8",
                                   "--no-probe", "--no-plot", "--json", str(tmp_path / "one_batch.json")])
    config = ModelConfig.from_dir(path)
    per_token = KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, torch.int8)
    assert result["model"]["kv_cache_dtype"] == "int8"
    assert per_token < KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32)
    [row] = result["results"]
    assert row["kv_bytes_per_step"] == pytest.approx(2 * (8 + 4 / 2) * per_token)
    assert row["decode_steps"] == 3 and row["decode_tok_s"] > 0


def test_kernel_and_one_batch_benches_take_launch_pys_model_flags_alike():
    """Both benches load the model as launch.py would, through one set of flags: every value the
    one takes the other takes, `auto` included."""
    from benchmarks import bench_kernels, bench_one_batch

    flags = ["--dtype", "auto", "--kv-cache-dtype", "auto", "--quantization", "int8", "--kernel-isa", "avx2"]
    kernels, one_batch = bench_kernels.parse_args(flags), bench_one_batch.parse_args(flags)
    for name in ("model_path", "dtype", "kv_cache_dtype", "quantization", "kernel_isa"):
        assert getattr(kernels, name) == getattr(one_batch, name)
    assert kernels.kv_cache_dtype == "auto" and kernels.quantization == "int8"


def test_kernel_bench_slots_keep_prompts_contiguous_and_interleave_decoded_tokens():
    from benchmarks.bench_kernels import decode_slots

    table = decode_slots(batch=3, context=6, decoded=2)
    assert table.dtype == torch.int32 and table.shape == (3, 6)
    assert table.unique().numel() == 18  # every token its own slot
    assert table[1, :4].tolist() == [4, 5, 6, 7]  # row 1's first tokens in a run of its own
    assert table[:, 4].tolist() == [12, 13, 14] and table[:, 5].tolist() == [15, 16, 17]  # a step's rows side by side


def test_kernel_bench_times_every_linear_and_attention_of_the_model(tmp_path, default_model_dir):
    """End to end on a tiny random Llama: a row per linear per row count and per attention batch,
    with the bytes and products of that op's shape, both timings, and the rates they give."""
    from benchmarks import bench_kernels
    from inproc import build_tiny_checkpoint, with_tokenizer
    from worker_proc.model_config import ModelConfig

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=3, vocab_size=49152),
                          default_model_dir)
    result = bench_kernels.main(["--model-path", str(path), "--rows", "1,3", "--batch-sizes", "2", "--context", "40",
                                 "--decoded", "8", "--rounds", "1", "--dtype", "float32", "--no-probe",
                                 "--json", str(tmp_path / "kernels.json")])
    c = ModelConfig.from_dir(path)
    rows = {(r["op"], r["rows"]): r for r in result["results"]}
    assert set(rows) == {(op, n) for op in bench_kernels.LINEARS for n in (1, 3)} | {("decode_attention", 2)}
    qkv = rows["qkv_proj", 3]
    assert qkv["shape_nk"] == [(c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size]
    assert qkv["flops"] == 2 * 3 * qkv["shape_nk"][0] * c.hidden_size
    assert qkv["bytes"] >= qkv["shape_nk"][0] * c.hidden_size * 4  # float32 weights (and any bias)
    assert rows["gate_up_proj", 1]["shape_nk"] == [2 * c.intermediate_size, c.hidden_size]
    assert rows["lm_head", 1]["cached_s"] is None  # one head: no other layer's copy to compare
    attention = rows["decode_attention", 2]
    assert attention["bytes"] == 2 * 40 * 2 * c.num_kv_heads * c.head_dim * 4  # float32 K and V of 80 tokens
    for row in result["results"]:
        assert row["memory_s"] > 0 and row["memory_gbs"] == pytest.approx(row["bytes"] / row["memory_s"] / 1e9)
        assert row["memory_pct_gemv"] is None  # (no probes)


def test_kernel_bench_times_quantized_linears_by_the_configs_shapes(tmp_path, default_model_dir):
    """int4 layers keep no [N, K] weight: the shapes come from the config, and a call's bytes are
    one form of its weights: the integer panels or the plain codes, not both."""
    from benchmarks import bench_kernels
    from inproc import build_tiny_checkpoint, with_tokenizer
    from worker_proc.model_config import ModelConfig

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=6, vocab_size=49152),
                          default_model_dir)
    result = bench_kernels.main(["--model-path", str(path), "--ops", "linears", "--rows", "2", "--rounds", "1",
                                 "--dtype", "float32", "--quantization", "int4", "--no-probe",
                                 "--json", str(tmp_path / "int4.json")])
    c = ModelConfig.from_dir(path)
    down = {r["op"]: r for r in result["results"]}["down_proj"]
    assert down["shape_nk"] == [c.hidden_size, c.intermediate_size]
    # 4 bits a weight plus scales: well under float32's 4 bytes, over the codes' half byte
    assert c.hidden_size * c.intermediate_size / 2 <= down["bytes"] < c.hidden_size * c.intermediate_size


def test_kernel_bench_steps_with_the_models_weights_and_with_layer_0s(tmp_path, default_model_dir):
    """--ops step: decode steps through the model's compiled stack and through one with layer 0's
    weights in every layer, which computes the same shapes: both give a time, and the model's own
    stack is back in place after."""
    from benchmarks import bench_kernels
    from benchmarks.bench_one_batch import WeightStats
    from inproc import build_tiny_checkpoint, with_tokenizer

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=4, vocab_size=49152),
                          default_model_dir)
    result = bench_kernels.main(["--model-path", str(path), "--ops", "step", "--batch-sizes", "2", "--context", "12",
                                 "--decoded", "4", "--rounds", "1", "--dtype", "float32", "--no-probe",
                                 "--json", str(tmp_path / "steps.json")])
    [row] = result["results"]
    assert row["op"] == "decode_step" and row["rows"] == 2
    assert row["memory_s"] > 0 and row["cached_s"] > 0
    assert row["memory_gflops"] == pytest.approx(row["flops"] / row["memory_s"] / 1e9)


def test_layer0_stack_gives_the_logits_of_a_model_whose_layers_all_hold_layer_0s_weights(tmp_path, default_model_dir):
    from benchmarks.bench_kernels import layer0_stack
    from inproc import build_tiny_checkpoint, with_tokenizer
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    path = with_tokenizer(build_tiny_checkpoint("llama", tmp_path / "llama", seed=5, vocab_size=49152),
                          default_model_dir)
    runner = ModelRunner(RunnerConfig(str(path), torch.float32, 0.01, 2))
    model = runner.model
    if model.layer_stack is None:
        pytest.skip("this build runs no compiled layer stack")
    stack = layer0_stack(model, model.ops.kernels)
    first = model.layers[0].state_dict()
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.load_state_dict(first)
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                linear.pack_weight()
    model.build_layer_stack()
    args = (torch.tensor([5, 7]), torch.tensor([0, 1]), torch.tensor([0, 0]), model.rotary.cos, model.rotary.sin,
            runner.pool.kv, torch.tensor([1, 2]), runner.pool.req_to_token, torch.tensor([0, 1]), torch.tensor([0, 1]),
            torch.tensor([1, 1]), torch.tensor([1, 1]), model.config.head_dim**-0.5)
    torch.testing.assert_close(stack.forward(*args), model.layer_stack.forward(*args))


def test_sim_scale_times_loom_and_reads_vidur_metrics(tmp_path, capsys):
    from benchmarks.bench_sim_scale import main, vidur_summary

    result = main(["--num-requests", "300", "--rate", "20", "--replicas", "2", "--hardware", "a100",
                   "--model-shape", "llama-2-70b", "--tp-size", "2", "--json", str(tmp_path / "scale.json")])
    loom = result["runs"]["loom"]
    assert loom["wall_s"] > 0 and loom["peak_rss_mb"] > 10 and loom["simulated"]["output_tok_s"] > 0
    assert "300 requests, 2 replicas of llama-2-70b on 2x a100" in capsys.readouterr().out
    metrics = tmp_path / "vidur" / "run" / "request_metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("Request Id,prefill_e2e_time,request_e2e_time,request_num_decode_tokens\n"
                       "0,0.1,2,10\n1,0.3,3,30\n")
    assert vidur_summary(tmp_path / "vidur") == {"ttft_p50_s": pytest.approx(0.2), "e2e_p50_s": 2.5}


def test_strategy_rows_compare_medians_of_repeated_live_runs():
    from benchmarks.bench_strategies import row

    def summary(measured, simulated):
        fidelity = {k: {"simulated": simulated, "measured": measured, "error": simulated / measured - 1}
                    for k in ("ttft_p50_s", "e2e_p50_s", "output_tok_s")}
        return {"fidelity": fidelity, "ttft_s": {}, "tbt_s": {}, "e2e_s": {}, "preemptions": 0, "steps": 1}

    r = row("vllm", [summary(1.0, 1.0), summary(1.5, 1.0), summary(1.1, 1.0)])
    f = r["fidelity"]["e2e_p50_s"]
    assert r["runs"] == 3 and f["measured"] == 1.1 and f["error"] == pytest.approx(1.0 / 1.1 - 1)
    assert f["live_spread"] == pytest.approx(0.5 / 1.1) and f["measured_runs"] == [1.0, 1.5, 1.1]


def test_serving_rounds_alternate_which_side_runs_first_and_take_each_rounds_ratio():
    calls, loom, vllm = [], iter([300.0, 330.0]), iter([200.0, 300.0])

    def run_loom():
        calls.append("loom")
        return next(loom)

    def run_vllm():
        calls.append("vllm")
        return next(vllm)

    rounds = measure_rounds(3, {"loom_http": 450.0, "vllm_http": 300.0},
                            {"loom_http": run_loom, "vllm_http": run_vllm})
    assert calls == ["vllm", "loom", "loom", "vllm"]
    assert [r["ratio"] for r in rounds] == [1.5, 1.5, 1.1]
    assert [(r["loom_http"], r["vllm_http"]) for r in rounds] == [(450.0, 300.0), (300.0, 200.0), (330.0, 300.0)]


def test_rounds_of_three_sides_keep_the_middle_one_next_to_both_and_take_named_ratios():
    calls = []

    def side(name, values):
        values = iter(values)

        def run():
            calls.append(name)
            return next(values)
        return run

    rounds = measure_rounds(3, {"offline": 100.0, "http": 90.0, "vllm": 60.0},
                            {"offline": side("offline", [200.0, 110.0]), "http": side("http", [190.0, 99.0]),
                             "vllm": side("vllm", [95.0, 90.0])},
                            {"ratio": ("http", "vllm"), "http_over_offline": ("http", "offline")})
    assert calls == ["vllm", "http", "offline", "offline", "http", "vllm"]
    assert [r["ratio"] for r in rounds] == pytest.approx([1.5, 2.0, 1.1])
    assert [r["http_over_offline"] for r in rounds] == pytest.approx([0.9, 0.95, 0.9])


def test_loom_server_gets_the_offline_sides_settings():
    args = SimpleNamespace(port=30700, dtype="float32", quantization="none", kv_cache_dtype="auto",
                           kernel_isa="avx2", concurrency=32)
    cmd = loom_server_command(args)
    settings = dict(zip(cmd[2::2], cmd[3::2]))
    assert cmd[1].endswith("launch.py")
    assert settings["--dtype"] == "float32" and settings["--kernel-isa"] == "avx2"
    assert settings["--max-running-requests"] == "32" and settings["--port"] == "30700"


def test_avx2_only_vllm_environment_hides_avx512_from_its_kernel_choice(tmp_path, monkeypatch):
    env = avx2_only_vllm_env(tmp_path, {"PYTHONPATH": "/elsewhere", "HOME": "/root"})
    assert {k: env[k] for k in AVX2_ONLY_ENV} == AVX2_ONLY_ENV and env["HOME"] == "/root"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    probes = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")
    for name in probes:  # (so that monkeypatch puts back what the sitecustomize replaces in this process)
        monkeypatch.setattr(torch.cpu, name, getattr(torch.cpu, name))
    exec(compile((tmp_path / "sitecustomize.py").read_text(), "sitecustomize.py", "exec"), {})
    assert all(getattr(torch.cpu, name)() is False for name in probes)


def test_random_checkpoint_has_the_shape_asked_for_and_runs(default_model_dir, tmp_path):
    """A random-weight checkpoint of the embedded model's shape, made smaller by overrides: its
    config has them, its tokenizer is the model's, and loom's runner loads and decodes it."""
    from transformers import AutoTokenizer

    from benchmarks import bench_one_batch
    from benchmarks.random_checkpoint import main as random_checkpoint
    from worker_proc.model_config import ModelConfig

    sizes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    out = tmp_path / "random"
    info = random_checkpoint(["--out", str(out), "--like", str(default_model_dir), "--dtype", "float32",
                              *[f"--set={k}={v}" for k, v in sizes.items()]])
    config = ModelConfig.from_dir(out)
    assert (config.num_layers, config.hidden_size, config.num_kv_heads, config.head_dim) == (2, 64, 2, 16)
    assert config.vocab_size == 49152 and info["parameters"] < 5e6
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.encode("hello") == AutoTokenizer.from_pretrained(str(default_model_dir)).encode("hello")
    args = bench_one_batch.parse_args(["--model-path", str(out), "--batch-sizes", "2", "--kv-cache-gb", "0.05",
                                       "--device", "cpu"])
    runner = bench_one_batch.load_runner(args, torch.float32, out)
    requests = bench_one_batch.fixed_length_requests(tokenizer, [12, 12], [5, 5], 0)
    steps = bench_one_batch.run_batch(runner, requests)
    assert sum(s.decode for s in steps) == 4
    with pytest.raises(SystemExit, match="no_such_field"):
        random_checkpoint(["--out", str(tmp_path / "x"), "--like", str(default_model_dir), "--set", "no_such_field=1"])


def test_speculative_benchmark_reports_both_configurations(tmp_path, capsys):
    from benchmarks.bench_speculative import main

    result = main(["--rounds", "1", "--requests", "1", "--concurrency", "1", "--max-tokens", "6",
                   "--workloads", "copy", "--dtype", "float32", "--json", str(tmp_path / "spec.json")])
    cell = result["cells"]["copy@1"]
    assert cell["off_tok_s"] > 0 and cell["ngram_tok_s"] > 0 and cell["drafts"] >= cell["kept"] >= 0
    assert "ngram tok/s" in capsys.readouterr().out and (tmp_path / "spec.json").exists()
