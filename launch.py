"""loom's entry points: `ServerArgs` (every flag), the process launcher with its watchdog,
the offline `Engine` API, and `python launch.py` to serve over HTTP and ZMQ."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import importlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import msgspec
import zmq

from ipc.messages import ProcFailed, ProcReady, ToLauncher
from ipc.proc import ChildConfig
from ipc.sockets import Endpoints, Receiver
from scheduler_proc.batching import BATCHING_STRATEGIES
from scheduler_proc.load_balancer import LOAD_BALANCE_METHODS
from scheduler_proc.policies import QUEUE_POLICIES
from scheduler_proc.prefill_adder import ADMISSION_POLICIES
from scheduler_proc.speculative import SPECULATIVE_ALGORITHMS
from tokenizer_proc.reasoning import REASONING_FORMATS
from tokenizer_proc.tool_calls import TOOL_CALL_FORMATS
from worker_proc.cpu_kernels import ISA_LEVELS
from worker_proc.dllm_algorithms import DLLM_ALGORITHMS
from worker_proc.dtype_probe import DTYPES
from worker_proc.kv_cache import KV_CACHE_DTYPES
from worker_proc.linear import QUANTIZATIONS
from worker_proc.model_config import ModelConfig, dllm_block_size, dllm_mask_token_id
from worker_proc.tensor_parallel import TPShard

log = logging.getLogger("loom")
ROOT = Path(__file__).resolve().parent


def _arg(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerArgs:
    model_path: str | None = _arg(None, "local Hugging Face checkpoint folder (Llama, Qwen2, Qwen3); "
                                        "default: the embedded SmolLM2-135M-Instruct")
    host: str = _arg("127.0.0.1", "HTTP and ZMQ bind address")
    port: int = _arg(30000, "HTTP port")
    zmq_port: int | None = _arg(None, "ZMQ client port (default: --port + 1; 0 picks a free port)")
    dtype: str = _arg("auto", "compute dtype (auto times a float32 and a bfloat16 linear on this CPU at start-up, on "
                              "the kernels the model will use)",
                      choices=("auto", *DTYPES))
    device: str = _arg("auto", "compute device (auto: cuda where a GPU is visible, else cpu)",
                       choices=("auto", "cpu", "cuda"))
    kv_cache_gb: float = _arg(2.0, "on the CPU: memory for the KV cache of the whole server, in GiB (the data- and "
                                   "tensor-parallel ranks share it)")
    mem_fraction_static: float = _arg(0.88, "on a GPU: the fraction of its memory for the weights and the KV cache "
                                            "(the KV pool takes what the weights leave of it; the rest is for "
                                            "activations and CUDA graphs)")
    attention_backend: str = _arg("auto", "attention kernels: triton (Triton, over the paged KV pool; the GPU's "
                                          "default), cpu (loom's compiled CPU kernel; the CPU's default) or torch "
                                          "(the reference)", choices=("auto", "triton", "cpu", "torch"))
    cuda_graph_max_bs: int = _arg(128, "on a GPU: decode steps of up to this many requests replay CUDA graphs "
                                       "captured at start (sizes 1, 2, 4, 8, 16, ... up to it; capped at "
                                       "--max-running-requests)")
    disable_cuda_graph: bool = _arg(False, "on a GPU: run every step eagerly (no CUDA graphs)")
    enable_deterministic_inference: bool = _arg(False, "on a GPU: batch-invariant kernels (fixed matmul tiles, fixed "
                                                       "decode split lengths), so a request's tokens do not depend on "
                                                       "what else runs in its batch; slower (docs/architecture.md)")
    max_running_requests: int = _arg(64, "requests decoding at once")
    max_prefill_tokens: int = _arg(1024, "prompt tokens computed per step")
    chunked_prefill_size: int = _arg(1024, "most prompt tokens of one request per step; longer prompts are split "
                                           "across steps (-1: no chunking)")
    enable_mixed_chunk: bool = _arg(True, "decodes ride in the same forward as prompts/chunks "
                                          "(--no-enable-mixed-chunk: prompt steps and decode steps alternate)")
    decode_first: bool = _arg(False, "latency knob: decodes count against the step token budget (mixed), or a "
                                     "pending decode step runs before the next prompt step (unmixed)")
    batching_strategy: str = _arg("loom", "how a step is composed and what KV a request must find to be admitted: "
                                          "loom (continuous batching, chunked prefill), sarathi (a token budget, "
                                          "decodes first), vllm (whole prompts first, preempt the latest), orca "
                                          "(reserve max_new_tokens), lightllm (peak-KV admission check), static "
                                          "(no joins until the whole batch ends); see docs/architecture.md",
                                  choices=tuple(BATCHING_STRATEGIES.names()))
    max_waiting_iters: int = _arg(10, "lightllm batching: decode steps between two prompt steps while requests decode")
    watermark: float = _arg(0.01, "vllm batching: fraction of the KV pool a new prompt must leave free")
    prefill_admission_policy: str = _arg("fifo", "which waiting prompts a step admits: fifo, or pack (fill the "
                                                 "step budget with the cheapest prompts in the look-ahead window)",
                                         choices=tuple(ADMISSION_POLICIES.names()))
    admission_lookahead: int = _arg(16, "waiting requests the pack policy considers")
    force_fifo_every: int = _arg(0, "with pack: the queue head goes first after this many admissions passed it "
                                    "over (0: never forced)")
    enable_priority_scheduling: bool = _arg(False, "higher request `priority` first, the policy's order within")
    disable_overlap_schedule: bool = _arg(False, "plan each step only after the previous step's result is "
                                                 "applied (the normal loop) instead of while it runs (overlap: "
                                                 "the scheduler's CPU work hides behind the forward pass)")
    stream_interval: int = _arg(1, "output tokens a request gathers before they go on to its stream (its first "
                                   "token and its last go at once): larger chunks cost the tokenizer, detokenizer "
                                   "and HTTP processes less per token, beside the workers on the same cores; a "
                                   "request's own stream_interval may raise it")
    log_interval: int = _arg(0, "log the step metrics (forward, worker gap, scheduler CPU, busy fraction) every "
                                "this many steps (0: never)")
    waiting_timeout: float | None = _arg(None, "abort requests queued longer than this (seconds)")
    running_timeout: float | None = _arg(None, "abort requests running longer than this (seconds)")
    kernel_backend: str = _arg("auto", "loom's CPU kernels (cpu: attention, fused norms, weight-streaming "
                                       "linears; compiled on first use) or plain torch ops; auto falls back to "
                                       "torch where no compiler is available", choices=("auto", "torch", "cpu"))
    kernel_isa: str = _arg("native", "instruction-set level the CPU kernels are compiled for: native (all this "
                                     "CPU has), or a portable level below it (avx512: x86-64-v4, avx2: x86-64-v3, "
                                     "scalar: x86-64)", choices=ISA_LEVELS)
    quantization: str = _arg("none", "weight quantization of the linear layers: fp16 (float16 weights; on CPUs "
                                     "with AVX512-FP16 the products in float16 too, about 2x float32's rate), "
                                     "int8 (per output row) or int4 (groups of 32, as GGUF Q4_1)",
                             choices=QUANTIZATIONS)
    kv_cache_dtype: str = _arg("auto", "dtype of the KV cache: auto (the compute dtype; float16 with --quantization "
                                       "fp16, and with int8 / int4 under float32 compute), or a narrower one than "
                                       "the compute dtype: float16 or bfloat16 halve a float32 cache's memory and "
                                       "the bytes each decode step reads; int8 (CPU) keeps each head row as int8 "
                                       "codes and a float32 scale: 0.53x a bfloat16 cache's bytes",
                               choices=("auto", *KV_CACHE_DTYPES))
    context_length: int | None = _arg(None, "maximum prompt + output length (default: the model's)")
    schedule_policy: str = _arg("fcfs", "waiting-queue order (lpm: longest cached prefix first; dfs-weight: the "
                                        "prefix tree depth first, heaviest subtree first)",
                                choices=tuple(QUEUE_POLICIES.names()))
    disable_radix_cache: bool = _arg(False, "no prefix cache: every prompt is computed in full, and the n choices of "
                                            "a prompt compute it each")
    page_size: int = _arg(1, "tokens per page of the prefix cache: matches and inserts cover whole pages")
    in_batch_prefix_threshold: int = _arg(32, "a waiting request that shares at least this many uncached prompt "
                                              "tokens with one being computed waits a step, then takes them from "
                                              "the prefix cache (0: never)")
    speculative_algorithm: str | None = _arg(None, "speculative decoding: ngram proposes each decoding request's next "
                                                   "tokens from the latest earlier occurrence of its last tokens "
                                                   "(prompt lookup); a step computes them with the last token and keeps "
                                                   "those the model's own samples confirm, plus one (greedy outputs "
                                                   "unchanged, sampled ones from the same distribution)",
                                             choices=tuple(SPECULATIVE_ALGORITHMS.names()))
    speculative_num_draft_tokens: int = _arg(4, "speculative decoding: draft tokens per request and step")
    speculative_ngram_min: int = _arg(2, "ngram: the shortest run of last tokens looked up")
    speculative_ngram_max: int = _arg(4, "ngram: the longest run of last tokens looked up (the longest that recurs wins)")
    speculative_max_batch_size: int = _arg(4, "speculative decoding: drafts only in steps of at most this many "
                                              "decoding requests (larger steps are compute-bound: drafts cost more "
                                              "than they save)")
    num_threads: int | None = _arg(None, "torch threads in each worker (default: the cores divided among the "
                                         "tensor-parallel ranks)")
    tp_size: int = _arg(1, "tensor-parallel ranks: worker processes that each hold a shard of the model (heads, "
                           "MLP columns, vocabulary rows) and run every step together (their collectives through "
                           "shared memory on one CPU host, torch.distributed's gloo across hosts, NCCL on GPUs); "
                           "it must divide the attention heads and the MLP size")
    pp_size: int = _arg(1, "pipeline stages: the layers split into this many worker processes (each with --tp-size "
                           "ranks) that pass each step's hidden states on (torch.distributed point-to-point); the "
                           "scheduler keeps up to this many disjoint micro-batches in flight so every stage works "
                           "at once")
    dp_size: int = _arg(1, "data-parallel ranks: whole replicas of the model, each a scheduler with its own "
                           "tensor-parallel workers and KV pool, fed by a DP controller process")
    nnodes: int = _arg(1, "hosts that serve together: node 0 runs the HTTP server, tokenizer, DP controller, "
                          "schedulers and detokenizer, and every node its share of each data-parallel rank's "
                          "workers (--tp-size x --pp-size must be a multiple of --nnodes)")
    node_rank: int = _arg(0, "this host's rank among --nnodes (0: the one that serves)")
    dist_init_addr: str | None = _arg(None, "HOST:PORT of node 0, needed with --nnodes > 1: the workers meet there "
                                            "(torch.distributed) and reach their schedulers on HOST, at PORT and "
                                            "the ports after it (2 x dp + dp x tp x pp of them); bound to HOST only")
    load_balance_method: str = _arg("round_robin", "how the DP controller picks a rank for each request (a "
                                                   "request's routed_dp_rank overrides it)",
                                    choices=tuple(LOAD_BALANCE_METHODS.names()))
    dllm_algorithm: str | None = _arg(None, "serve a block-diffusion model (its config.json names mask_token_id) with "
                                            "this algorithm: low_confidence fills the masked positions whose top "
                                            "token clears --dllm-threshold (at least one per round); "
                                            "joint_threshold also edits filled positions (--dllm-edit-threshold, "
                                            "--dllm-max-post-edit-steps)", choices=tuple(DLLM_ALGORITHMS.names()))
    dllm_block_size: int | None = _arg(None, "positions per diffusion block (default: the checkpoint's block_size, "
                                             "else 32); --page-size must be a multiple of it")
    dllm_threshold: float = _arg(0.95, "diffusion: a masked position whose top token is at least this likely is "
                                       "filled")
    dllm_edit_threshold: float = _arg(0.9, "joint_threshold: a filled output position changes to a different top "
                                           "token at least this likely")
    dllm_max_post_edit_steps: int = _arg(4, "joint_threshold: edit-only rounds a block may run after its last mask")
    dllm_fdfo: bool = _arg(True, "diffusion: first done, first out: the scheduler takes each round's finished "
                                 "blocks at once (commit, stream, admit) while the others continue "
                                 "(--no-dllm-fdfo: sync, a step runs rounds until every block of the batch is done)")
    dllm_in_place: bool = _arg(True, "diffusion with FDFO: an unfinished block keeps its KV and request slots between "
                                     "rounds, and the worker re-runs rounds that finish no block without a scheduler "
                                     "round-trip (off: its KV is freed and allocated again each round)")
    served_model_name: str | None = _arg(None, "model name the OpenAI routes answer to (default: the folder name)")
    api_key: str | None = _arg(None, "when set, every route but /health needs 'Authorization: Bearer <key>'")
    tool_call_parser: str = _arg("auto", "how chat replies write function calls (`tools`): hermes (<tool_call> JSON "
                                         "blocks), llama3_json (the reply a JSON call), mistral ([TOOL_CALLS] and a "
                                         "JSON list); auto: the one the chat template teaches (hermes, with the tools "
                                         "in a system message, where it teaches none)",
                                 choices=("auto", *TOOL_CALL_FORMATS.names()))
    generation_config: str = _arg("auto", "default sampling of the OpenAI routes' requests (the fields a request "
                                          "leaves unset): auto, the temperature / top_p / top_k / min_p / "
                                          "repetition_penalty the model folder's generation_config.json sets (as "
                                          "vLLM does); none, loom's own defaults", choices=("auto", "none"))
    reasoning_parser: str | None = _arg(None, "a reasoning model's chat replies: the thinking in <think> ... </think> "
                                              "returned as reasoning_content beside the answer's content (streamed "
                                              "too), and structured output applied to the answer after it; "
                                              "deepseek_r1: replies think from their first token, qwen3: where the "
                                              "template opens the block in the prompt or the reply opens it",
                                        choices=tuple(REASONING_FORMATS.names()))
    max_queued_requests: int | None = _arg(None, "requests in flight beyond this are refused at once (HTTP 503)")
    max_request_bytes: int = _arg(32 * 1024 * 1024, "largest HTTP request body (and ZMQ client message) accepted; "
                                                    "larger ones are refused with HTTP 413")
    watchdog_timeout: float = _arg(300.0, "a step the workers have not answered after this many seconds means a "
                                          "stalled or hung worker: the server logs it and shuts down (0: no watchdog)")
    graceful_shutdown_timeout: float = _arg(2.0, "on SIGTERM or SIGINT: new requests get HTTP 503, requests in flight "
                                                 "get this many seconds to finish, then end with an error")
    step_trace_dir: str | None = _arg(None, "each worker writes its forward passes into this folder as a Chrome "
                                            "trace (chrome://tracing, Perfetto): when each computed which step, "
                                            "with its collective and pipeline-wait times")
    step_log_file: str | None = _arg(None, "the scheduler appends every step's shape and wall time to this file as a "
                                           "JSON line (with --dp-size N, one file per rank: FILE.dpK); "
                                           "`python -m sim profile --step-log FILE` fits the simulator to them")
    log_level: str = _arg("info", "log level", choices=("debug", "info", "warning", "error"))
    startup_timeout_s: float = _arg(600.0, "give up if the processes are not ready by then")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices and value not in choices and value is not None:
                raise ValueError(f"{f.name}={value!r}: choose one of {', '.join(choices)}")
        if self.device == "auto":
            self.device = "cuda" if _cuda_available() else "cpu"
        elif self.device == "cuda" and not _cuda_available():
            raise ValueError("device='cuda': no CUDA device is visible to torch here")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static}: between 0 and 1")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs={self.cuda_graph_max_bs}: at least 0 (0: no CUDA graphs)")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark}: a fraction in [0, 1)")
        for name in ("tp_size", "pp_size", "dp_size", "nnodes", "page_size", "max_waiting_iters", "max_request_bytes",
                     "stream_interval", "speculative_num_draft_tokens", "speculative_ngram_min",
                     "speculative_max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: at least 1")
        for name in ("watchdog_timeout", "graceful_shutdown_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)}: at least 0")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError(f"speculative_ngram_max={self.speculative_ngram_max}: at least speculative_ngram_min "
                             f"({self.speculative_ngram_min})")
        if self.speculative_algorithm and (self.dllm_algorithm or self.pp_size > 1):
            raise ValueError("speculative_algorithm: not with --dllm-algorithm or --pp-size above 1")
        if self.zmq_port == self.port and self.port:
            raise ValueError(f"zmq_port={self.zmq_port}: the HTTP server's --port; give the ZMQ client another")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank}: choose one of 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1:
            if (self.tp_size * self.pp_size) % self.nnodes:
                raise ValueError(f"tp_size={self.tp_size}: with --nnodes {self.nnodes}, tp_size x pp_size must be a "
                                 "multiple of it (each host runs its share of every data-parallel rank's workers)")
            if not re.fullmatch(r"[\w.-]+:\d+", self.dist_init_addr or ""):
                raise ValueError(f"dist_init_addr={self.dist_init_addr!r}: with --nnodes > 1 give node 0's HOST:PORT")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Every field as its flag (the server's command line, and the simulator's)."""
        types = {"int | None": int, "str | None": str, "float | None": float, "float": float, "int": int, "str": str}
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
            else:
                parser.add_argument(flag, type=types[f.type], default=f.default, help=f.metadata["help"],
                                    choices=f.metadata["choices"])

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        parser = argparse.ArgumentParser(description="Serve a model with loom (OpenAI-style HTTP + ZMQ).")
        cls.add_arguments(parser)
        return cls(**vars(parser.parse_args(argv)))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def flags_markdown() -> str:
    """docs/flags.md: every ServerArgs field as its flag, from the dataclass itself (regenerate with
    `python -c "import launch; print(launch.flags_markdown(), end='')" > docs/flags.md`)."""
    rows = ["# Flags", "",
            "Every flag of `python launch.py` (`--help` prints the same); `Engine(**kwargs)` takes the same",
            "names with underscores (`--max-running-requests` is `Engine(max_running_requests=...)`).",
            "Generated from `ServerArgs` in `launch.py`.", "",
            "| flag | default | values | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            flag += f" / --no-{f.name.replace('_', '-')}"
        values = ", ".join(f.metadata["choices"] or ()) or {"bool": "", "int": "integer", "int | None": "integer",
                                                            "float": "number", "float | None": "number", "str": "text", "str | None": "text"}.get(f.type, "")
        help_text = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{flag}` | `{f.default}` | {values} | {help_text} |")
    return "\n".join(rows) + "\n"


def check_dllm(args: ServerArgs, config: ModelConfig) -> None:
    """A diffusion set-up that cannot work is refused before anything starts."""
    if args.dllm_algorithm is None:
        return
    block = dllm_block_size(config, args.dllm_block_size)
    dllm_mask_token_id(config)
    if args.page_size % block:
        raise ValueError(f"--page-size {args.page_size} is not a multiple of the diffusion block size {block}: the "
                         f"prefix cache must hold whole blocks (pass --page-size {block})")


def check_pipeline(args: ServerArgs, config: ModelConfig) -> None:
    """A pipeline set-up that cannot work is refused before anything starts."""
    if args.pp_size == 1:
        return
    if args.pp_size > config.num_layers:
        raise ValueError(f"--pp-size {args.pp_size}: the model has only {config.num_layers} layers to split")
    if args.dllm_algorithm is not None:
        raise ValueError("--pp-size > 1 with --dllm-algorithm: diffusion rounds run on one pipeline stage only")


def _eos_token_ids(model_dir: Path, tokenizer: Any = None) -> list[int] | None:
    """EOS ids from config.json, generation_config.json and the tokenizer's eos token (chat models
    often end turns with a token the base config does not list). Without `tokenizer` its eos token
    comes from its files (tokenizer_config.json's eos_token looked up in tokenizer.json; the
    processes then start while the tokenizer loads): None where those do not say it plainly."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = model_dir / name
        if p.exists():
            eos = json.loads(p.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is None:
        token_eos = _eos_id_from_tokenizer_files(model_dir)
        if token_eos is None:
            return None
        ids.add(token_eos)
    elif getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


GENERATION_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path, mode: str) -> dict[str, float | int]:
    """The default sampling of OpenAI requests (--generation-config): with auto, the sampling
    fields the model folder's generation_config.json sets (as vLLM's default takes them); with
    none, {} (loom's own defaults)."""
    path = model_dir / "generation_config.json"
    if mode != "auto" or not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return {}
    return {name: config[name] for name in GENERATION_CONFIG_SAMPLING
            if isinstance(config.get(name), (int, float)) and not isinstance(config[name], bool)}


def _eos_id_from_tokenizer_files(model_dir: Path) -> int | None:
    config, vocab = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    # (a special_tokens_map.json may name other special tokens: the tokenizer itself decides then)
    if not config.exists() or not vocab.exists() or (model_dir / "special_tokens_map.json").exists():
        return None
    eos = json.loads(config.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(vocab)).token_to_id(eos)


# ---- processes ------------------------------------------------------------------------------

class Launcher:
    """Spawns the detokenizer, scheduler and worker, waits until each is ready, and watches
    them: any child's death takes the whole tree down. `shutdown()` (also run at interpreter
    exit) ends every child and removes the ipc folder."""

    def children(self) -> list[tuple[str, str, int, int, int]]:
        """(name, module, data-parallel rank, tensor-parallel rank, pipeline stage) of every child
        process this host runs: on node 0 the detokenizer, the DP controller (with --dp-size > 1),
        the schedulers, and every node its share of each data-parallel rank's workers (stage by
        stage, tensor-parallel ranks in order, split evenly over the nodes). Names carry the ranks
        there are: worker, worker_tp1, worker_pp1, scheduler_dp1, worker_dp1_pp0_tp1, ..."""
        dp, tp, pp, node = self.args.dp_size, self.args.tp_size, self.args.pp_size, self.args.node_rank
        per_node = tp * pp // self.args.nnodes

        def named(base: str, d: int, r: int | None = None, p: int | None = None) -> str:
            return (base + (f"_dp{d}" if dp > 1 else "") + (f"_pp{p}" if p is not None and pp > 1 else "")
                    + (f"_tp{r}" if r is not None and tp > 1 else ""))

        out = [("detokenizer", "detokenizer_proc.process", 0, 0, 0)] if node == 0 else []
        if dp > 1 and node == 0:
            out.append(("dp_controller", "scheduler_proc.dp_controller", 0, 0, 0))
        for d in range(dp):
            out += [(named("worker", d, r, p), "worker_proc.process", d, r, p)
                    for p in range(pp) for r in range(tp) if (p * tp + r) // per_node == node]
            if node == 0:
                out.append((named("scheduler", d), "scheduler_proc.process", d, 0, 0))
        return out

    def __init__(self, args: ServerArgs, model_dir: Path, extra: dict[str, Any]):
        self.args = args
        self.model_dir = model_dir
        tcp = None
        if args.nnodes > 1:  # the sockets between schedulers and workers cross hosts
            host, port = args.dist_init_addr.rsplit(":", 1)
            tcp = (host, int(port))
        self.endpoints = Endpoints.create(tcp, args.dp_size, args.tp_size * args.pp_size)
        self.extra = extra
        self.procs: dict[str, subprocess.Popen] = {}
        self.ready_info: dict[str, dict] = {}
        self.failures: dict[str, str] = {}  # child name -> what it reported before it died
        self._stopping = False
        self._shut_down = False
        self._ctx = zmq.Context()
        self._inbox = Receiver(self._ctx, zmq.PULL, self.endpoints.launcher, ToLauncher)
        self._inbox_lock = threading.Lock()  # the watchdog thread polls it; shutdown closes it
        atexit.register(self.shutdown)

    def start(self) -> None:
        """Spawns every child and waits until each is ready."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Starts every child process of this host (children()); wait_ready() then waits for them."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        server_args = {**dataclasses.asdict(self.args), **self.extra}
        if self.args.tp_size * self.args.pp_size > 1:  # where each rank's workers meet (torch.distributed's store)
            server_args["dist_init_addrs"] = [
                self.endpoints.dist_init_addr_of(d) if self.args.nnodes > 1 else f"127.0.0.1:{_free_port()}"
                for d in range(self.args.dp_size)]
        children = self.children()
        for name, module, dp_rank, tp_rank, pp_rank in children:
            cfg = ChildConfig(name, self.endpoints, str(self.model_dir), server_args, dp_rank=dp_rank, tp_rank=tp_rank,
                              pp_rank=pp_rank)
            self.procs[name] = subprocess.Popen([sys.executable, "-m", module, msgspec.json.encode(cfg).decode()],
                                                env=env, cwd=str(ROOT))

    def wait_ready(self) -> None:
        """Waits until every child spawned has reported ready; on a failure or the start-up timeout
        shuts them all down and raises."""
        inbox = self._inbox
        try:
            deadline = time.monotonic() + self.args.startup_timeout_s
            while len(self.ready_info) < len(self.procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"loom processes not ready after {self.args.startup_timeout_s:.0f} s")
                dead = self._dead_child()
                if dead:
                    raise RuntimeError(f"the {dead} process exited during start-up (see its log above)")
                if inbox.poll(200):
                    msg = inbox.recv()
                    if isinstance(msg, ProcFailed):
                        raise RuntimeError(f"the {msg.name} process failed to start: {msg.message}")
                    if isinstance(msg, ProcReady):
                        self.ready_info[msg.name] = dict(msg.info)
        except BaseException:
            self.shutdown()
            raise

    def _dead_child(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return name
        return None

    def _read_failures(self, timeout_ms: int) -> None:
        """Collects what children reported before dying (ProcFailed: why, e.g. the watchdog's message)."""
        with self._inbox_lock:
            while not self._shut_down and self._inbox.poll(timeout_ms):
                msg = self._inbox.recv()
                if isinstance(msg, ProcFailed):
                    self.failures[msg.name] = msg.message
                timeout_ms = 0

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Calls on_death(message) from a watchdog thread when a child dies unexpectedly; the
        message names the process, how it ended and, if it said, why."""

        def loop():
            while not self._stopping:
                self._read_failures(100)
                dead = self._dead_child()
                if dead and not self._stopping:
                    self._read_failures(200)  # a dying child reports first: give its report time to land
                    code = self.procs[dead].returncode
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                    why = f" ({self.failures[dead]})" if dead in self.failures else ""
                    on_death(f"the {dead} process (pid {self.procs[dead].pid}) {how}{why}; shutting loom down")
                    return

        threading.Thread(target=loop, name="loom-watchdog", daemon=True).start()

    def shutdown(self) -> None:
        """Ends every child and removes the ipc folder; safe to call more than once and from any
        thread. Children hold nothing to flush (requests were drained before), so SIGKILL: it also
        ends a stopped or hung child, and children ignore SIGTERM (see ipc/proc.py)."""
        if self._shut_down:
            return
        self._stopping = self._shut_down = True
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()
        shutil.rmtree(self.endpoints.directory, ignore_errors=True)
        with self._inbox_lock:
            self._inbox.socket.close()
        self._ctx.term()
        atexit.unregister(self.shutdown)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare(args: ServerArgs, preload: tuple[str, ...] = ()):
    """Set up logging, resolve (and on first use convert) the model, start the processes, load
    its tokenizer (and import the `preload` modules) while they start, wait until they are ready.
    Returns the model folder, tokenizer, launcher and the server info."""
    from worker_proc.model_loader import resolve_model_path

    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(levelname)s %(message)s")
    model_dir = resolve_model_path(args.model_path)
    model_config = ModelConfig.from_dir(model_dir)
    TPShard.of(model_config, 0, args.tp_size)  # a size that does not divide the model: refused now
    check_pipeline(args, model_config)
    check_dllm(args, model_config)
    # the processes start first (the worker's model load is most of a start-up); the tokenizer
    # loads meanwhile, where its files name the eos token
    eos_ids = _eos_token_ids(model_dir)
    launcher = None if eos_ids is None else Launcher(args, model_dir, {"eos_token_ids": eos_ids})
    try:
        if launcher is not None:
            launcher.spawn()
        for module in preload:
            importlib.import_module(module)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer_eos_ids = _eos_token_ids(model_dir, tokenizer)
        if eos_ids != tokenizer_eos_ids:
            if launcher is not None:
                log.warning("the tokenizer's eos token is not the one its files name: restarting the processes")
                launcher.shutdown()
            launcher = Launcher(args, model_dir, {"eos_token_ids": tokenizer_eos_ids})
            launcher.spawn()
        launcher.wait_ready()
    except BaseException:
        if launcher is not None:
            launcher.shutdown()
        raise
    first_scheduler, first_worker = (next(info for name, info in launcher.ready_info.items() if name.startswith(kind))
                                     for kind in ("scheduler", "worker"))
    info = {"model_path": str(model_dir), "vocab_size": model_config.vocab_size, **first_scheduler, **first_worker,
            "tp_size": args.tp_size,
            "pp_size": args.pp_size, "dp_size": args.dp_size}
    if args.dp_size > 1:  # every scheduler plans its own pool: the server holds them all
        info["max_total_tokens"] = sum(i["max_total_tokens"] for name, i in launcher.ready_info.items()
                                       if name.startswith("scheduler"))
    return model_dir, tokenizer, launcher, info


# ---- offline Engine ---------------------------------------------------------------------------

class Engine:
    """In-process entry point: `Engine(**ServerArgs fields)`; generate / async_generate /
    streaming, chat (OpenAI chat completions), encode (embeddings); use as a context manager or
    call shutdown()."""

    def __init__(self, **kwargs: Any):
        from tokenizer_proc.manager import TokenizerManager

        self.args = ServerArgs(**kwargs)
        if self.args.node_rank > 0:
            raise ValueError("node_rank > 0: the Engine runs on node 0; start the other nodes with launch.py")
        self.model_dir, self.tokenizer, self.launcher, self.server_info = _prepare(self.args)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="loom-engine-loop", daemon=True)
        self._thread.start()

        async def make_manager():
            m = TokenizerManager(self.launcher.endpoints, self.tokenizer, self.server_info["max_context_len"],
                                 self.args.max_queued_requests, self.args.dp_size,
                                 self.args.dllm_algorithm is not None, self.server_info["vocab_size"])
            m.start()
            return m

        self.manager = self._run(make_manager())
        self.launcher.watch(self._on_child_death)
        self._closed = False
        self._chat = None  # the OpenAI chat route's logic, for chat()

    def _on_child_death(self, message: str) -> None:
        log.error("loom: %s", message)
        self.loop.call_soon_threadsafe(self.manager.fail_all, message)

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ---- generation ----------------------------------------------------------------------

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 rid: str | None = None, **extra: Any) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> a dict; a list of prompts -> a list of dicts, in order. With
        stream=True (one prompt) an iterator of cumulative dicts. `extra`: priority, routing_key,
        routed_dp_rank."""
        if stream:
            return self._stream(prompt, sampling_params, input_ids, rid, extra)
        return self._run(self._generate_all(prompt, sampling_params, input_ids, rid, extra))

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                             rid: str | None = None, **extra: Any):
        """Awaitable from any event loop; with stream=True returns an async iterator."""
        if stream:
            return self._astream(prompt, sampling_params, input_ids, rid, extra)
        coro = self._generate_all(prompt, sampling_params, input_ids, rid, extra)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _generate_all(self, prompt, sampling_params, input_ids, rid, extra):
        prompts = _as_prompt_list(prompt, input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts[0])
        texts, ids_list, single = prompts
        if len(params) != len(texts):
            raise ValueError(f"{len(params)} sampling_params for {len(texts)} prompts")

        rids = [rid] if single else [None] * len(texts)
        outs = await asyncio.gather(*(self.manager.generate_final(text=t, input_ids=i, sampling=p, rid=r, **extra)
                                      for t, i, p, r in zip(texts, ids_list, params, rids)))
        return outs[0] if single else list(outs)

    def _open_stream(self, prompt, sampling_params, input_ids, rid, extra):
        texts, ids_list, single = _as_prompt_list(prompt, input_ids)
        if not single:
            raise ValueError("stream=True takes one prompt")
        return self.manager.generate(text=texts[0], input_ids=ids_list[0], sampling=sampling_params, rid=rid,
                                     stream=True, **extra)

    def _stream(self, prompt, sampling_params, input_ids, rid, extra) -> Iterator[dict]:
        agen = self._open_stream(prompt, sampling_params, input_ids, rid, extra)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    async def _astream(self, prompt, sampling_params, input_ids, rid, extra) -> AsyncIterator[dict]:
        agen = self._open_stream(prompt, sampling_params, input_ids, rid, extra)

        def call(coro):
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

        try:
            while True:
                try:
                    yield await call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            await call(agen.aclose())

    def chat(self, messages: list[dict] | list[list[dict]], **request: Any) -> dict | list[dict]:
        """OpenAI chat completions in-process: one conversation (a list of messages) -> the
        chat.completion dict /v1/chat/completions returns; a list of conversations -> a list of
        them, in order, run together. `request`: the route's other fields (max_tokens, temperature,
        n, tools, tool_choice, logprobs, ...). A wrong field is a ValueError naming it."""
        from tokenizer_proc.openai_api import ApiError, OpenAIServing

        if request.get("stream"):
            raise ValueError("stream: Engine.chat returns whole replies; stream with generate(stream=True)")
        if self._chat is None:
            self._chat = OpenAIServing(self.manager, self.args.served_model_name or self.model_dir.name,
                                       self.manager.context_len, self.args.tool_call_parser,
                                       self.args.reasoning_parser,
                                       sampling_defaults(self.model_dir, self.args.generation_config))
        single = bool(messages) and isinstance(messages[0], dict)
        bodies = [{**request, "messages": m} for m in ([messages] if single else messages)]

        async def one(body):
            try:
                return await self._chat.chat(body)
            except ApiError as e:
                raise ValueError(e.message) from None

        async def run_all():
            return await asyncio.gather(*(one(b) for b in bodies))

        outs = self._run(run_all())
        return outs[0] if single else list(outs)

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
               normalize: bool = True) -> list[float] | list[list[float]]:
        """Embeddings, as /v1/embeddings computes them: the model's final hidden state at each
        prompt's last token (L2-normalized unless `normalize` is False). One prompt -> a vector; a
        list -> a list of vectors, in order."""
        import numpy as np

        from tokenizer_proc.openai_api import unit_vectors

        outs = self.generate(prompt, {"embedding": True}, input_ids)
        vectors = np.asarray([o["embedding"] for o in (outs if isinstance(outs, list) else [outs])], dtype=np.float32)
        vectors = (unit_vectors(vectors) if normalize else vectors).tolist()
        return vectors if isinstance(outs, list) else vectors[0]

    def abort(self, rid: str = "") -> None:
        self._run(self.manager.abort(rid))

    def flush_cache(self) -> str | None:
        """Empties the prefix cache; the reason if refused (requests running or queued)."""
        return self._run(self.manager.flush_cache())

    def get_stats(self) -> dict:
        """Scheduler counters: running/waiting requests and free/total KV and request slots."""
        return self._run(self.manager.get_stats())

    # ---- lifetime --------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.launcher.shutdown()
        try:
            self._run(self.manager.close(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()


def _as_prompt_list(prompt, input_ids) -> tuple[list, list, bool]:
    if prompt is not None and input_ids is not None:
        raise ValueError("give prompt or input_ids, not both")
    if isinstance(prompt, list):
        return list(prompt), [None] * len(prompt), False
    if input_ids is not None and input_ids and isinstance(input_ids[0], list):
        return [None] * len(input_ids), list(input_ids), False
    return [prompt], [input_ids], True


# ---- server ---------------------------------------------------------------------------------------

def serve_worker_node(args: ServerArgs) -> None:
    """A host other than node 0 (--node-rank > 0): it runs only its workers, which join their
    groups at --dist-init-addr, and goes down when they do (or node 0 does: they notice)."""
    from worker_proc.model_loader import resolve_model_path

    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(levelname)s %(message)s")
    model_dir = resolve_model_path(args.model_path)
    TPShard.of(ModelConfig.from_dir(model_dir), 0, args.tp_size)
    check_pipeline(args, ModelConfig.from_dir(model_dir))
    launcher = Launcher(args, model_dir, {})
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"loom: node {args.node_rank} of {args.nnodes}: starting {len(launcher.children())} workers, "
          f"joining {args.dist_init_addr}", flush=True)
    exit_code = []
    try:
        launcher.start()
        print(f"loom: node {args.node_rank} of {args.nnodes} ready", flush=True)

        def on_death(message: str) -> None:
            print(f"loom: {message}", file=sys.stderr, flush=True)
            exit_code.append(1)
            done.set()

        launcher.watch(on_death)
        done.wait()
    finally:
        launcher.shutdown()
    if exit_code:
        sys.exit(1)


def serve(args: ServerArgs) -> None:
    if args.node_rank > 0:
        return serve_worker_node(args)

    def on_signal(signum: int, _frame) -> None:
        # SIGTERM / SIGINT outside uvicorn's own handling (start-up, or re-raised by uvicorn once it
        # has drained): leave through the finally clauses and atexit, which end the children and
        # remove the ipc folder (the default action would kill this process before they run)
        print(f"loom: {signal.Signals(signum).name}: shutting down", file=sys.stderr, flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # (xgrammar: the first structured-output request would otherwise import it in the event loop)
    server_modules = ("uvicorn", "uvloop", "tokenizer_proc.http_server", "tokenizer_proc.zmq_frontend", "xgrammar")
    model_dir, tokenizer, launcher, info = _prepare(args, preload=server_modules)
    import uvicorn  # (imported while the processes started)
    import uvloop

    from tokenizer_proc.http_server import build_app
    from tokenizer_proc.manager import TokenizerManager
    from tokenizer_proc.zmq_frontend import ZmqFrontend

    def on_death(message: str) -> None:
        print(f"loom: {message}", file=sys.stderr, flush=True)
        launcher.shutdown()
        os._exit(1)

    launcher.watch(on_death)

    class GracefulServer(uvicorn.Server):
        """On SIGTERM / SIGINT uvicorn stops accepting connections and waits for the open ones;
        loom refuses new requests (503) and ends those still running after the grace period with
        an error, so every stream gets its last event and the server exits within seconds."""

        manager: TokenizerManager

        async def shutdown(self, sockets=None) -> None:
            self.manager.drain(args.graceful_shutdown_timeout)
            await super().shutdown(sockets)

    async def run() -> None:
        manager = TokenizerManager(launcher.endpoints, tokenizer, info["max_context_len"], args.max_queued_requests,
                                   args.dp_size, args.dllm_algorithm is not None, info["vocab_size"])
        manager.start()
        zmq_port = args.port + 1 if args.zmq_port is None else args.zmq_port
        frontend = ZmqFrontend(manager, f"tcp://{args.host}:{zmq_port}", args.max_request_bytes)
        frontend.start()
        defaults = sampling_defaults(model_dir, args.generation_config)
        if defaults:
            log.info("the model's generation_config.json sets the OpenAI routes' default sampling: %s "
                     "(--generation-config none: loom's own)", defaults)
        app = build_app(manager, {**info, "zmq_endpoint": frontend.address},
                        args.served_model_name or model_dir.name, args.api_key, args.max_request_bytes,
                        args.tool_call_parser, args.reasoning_parser, defaults)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.graceful_shutdown_timeout + 1, access_log=False)
        print(f"loom: serving {model_dir.name} ({info['dtype']}, {info['max_total_tokens']} KV tokens "
              f"in {info['kv_cache_dtype']}, "
              f"kernels {info['kernel_isa']}) on http://{args.host}:{args.port}  zmq: {frontend.address}",
              flush=True)
        server = GracefulServer(config)
        server.manager = manager
        await server.serve()

    try:
        uvloop.run(run())
    finally:
        launcher.shutdown()


def main(argv: list[str] | None = None) -> None:
    serve(ServerArgs.from_cli(argv))


if __name__ == "__main__":
    main()
