"""Owns the model, the KV pool and the sampler; turns one ModelWorkerBatch into sampled ids."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

import torch

from ipc.messages import ModelWorkerBatch, TokenLogprobs
from worker_proc import cpu_kernels
from worker_proc.attention import PagedKernelAttention, TorchAttention
from worker_proc.forward_batch import ForwardBatch, HostStaging
from worker_proc.future_map import FutureMap
from worker_proc.grammar import GrammarMasks
from worker_proc.kv_cache import KVPool, resolve_kv_dtype
from worker_proc.linear import pack_dense_weights, quantize_linears
from worker_proc.malloc_policy import keep_freed_memory
from worker_proc.model_config import ModelConfig, dllm_block_size, dllm_mask_token_id
from worker_proc.model_loader import iter_checkpoint_tensors
from worker_proc.models import MODEL_CLASSES
from worker_proc.ops import Ops
from worker_proc.pipeline_parallel import PPGroup, stage_layers
from worker_proc.penalties import OutputTokenCounts, PenaltyBatch, PromptTokenMask, logprobs
from worker_proc.sampler import SamplingBatch, sample
from worker_proc.tensor_parallel import TPGroup, TPShard

log = logging.getLogger("loom.worker")


@dataclass(slots=True)
class RunnerConfig:
    model_dir: str
    dtype: torch.dtype
    kv_cache_gb: float
    max_running_requests: int
    context_length: int | None = None
    device: str = "cpu"
    kernel_backend: str = "auto"  # auto | torch | cpu
    kernel_isa: str = "native"  # cpu_kernels.ISA_LEVELS: which build of the CPU kernels
    quantization: str = "none"  # none | fp16 | int8 | int4
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | int8 (kv_cache.resolve_kv_dtype)
    eos_token_ids: tuple[int, ...] = ()
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    mem_fraction_static: float = 0.88  # on a GPU: its memory for weights and KV pool together
    cuda_graph_max_bs: int = 0  # decode steps up to this many rows replay CUDA graphs (0: none)
    deterministic: bool = False  # batch-invariant kernels (fixed tiles and split lengths)
    # block diffusion (--dllm-algorithm): the algorithm, block size (None: the model config's) and
    # its thresholds
    dllm_algorithm: str | None = None
    dllm_block_size: int | None = None
    dllm_threshold: float = 0.95
    dllm_edit_threshold: float = 0.9
    dllm_max_post_edit_steps: int = 4


def plan_kv_slots(config: ModelConfig, dtype: torch.dtype, kv_cache_gb: float, shard: TPShard | None = None,
                  num_layers: int | None = None, pp_size: int = 1) -> int:
    """KV slots that fit the memory budget (`--kv-cache-gb` on CPU: all tensor-parallel ranks and
    pipeline stages together, each holding its KV heads' part of every slot for its `num_layers`)."""
    shard = shard or TPShard.of(config)
    per_token = KVPool.bytes_per_token(num_layers or config.num_layers, shard.num_kv_heads, config.head_dim, dtype)
    slots = int(kv_cache_gb / (shard.size * pp_size) * (1 << 30)) // per_token
    if slots < 16:
        raise ValueError(f"--kv-cache-gb {kv_cache_gb} holds only {slots} tokens ({per_token} bytes each)")
    return slots


def plan_kv_slots_gpu(config: ModelConfig, dtype: torch.dtype, mem_fraction: float, shard: TPShard,
                      device: torch.device | str) -> int:
    """KV slots that fit in `mem_fraction` of the GPU's memory, less what is in use now (the
    weights, and anything else on the GPU); the rest is left to activations and CUDA graphs."""
    free, total = torch.cuda.mem_get_info(device)
    budget = total * mem_fraction - (total - free)
    per_token = KVPool.bytes_per_token(config.num_layers, shard.num_kv_heads, config.head_dim, dtype)
    slots = int(max(budget, 0)) // per_token
    if slots < 16:
        raise ValueError(f"--mem-fraction-static {mem_fraction}: {(total - free) / 2**30:.1f} of the GPU's "
                         f"{total / 2**30:.1f} GiB are in use, which leaves only {slots} KV tokens; raise it")
    return slots


# In deterministic mode a decode split spans this many tokens (or more for long contexts: the
# grid stays within 64 splits), whatever the batch.
DETERMINISTIC_SPLIT_TOKENS = 256


def deterministic_split_tokens(context_len: int) -> int:
    split = DETERMINISTIC_SPLIT_TOKENS
    while -(-context_len // split) > 64:
        split *= 2
    return split


def resolve_attention_backend(name: str, device: str, kernels) -> str:
    """auto: triton on a GPU, loom's CPU kernel where it is loaded, torch otherwise."""
    if name not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"--attention-backend {name!r}: choose auto, torch, cpu or triton")
    if name == "auto":
        return "triton" if device != "cpu" else ("cpu" if kernels is not None else "torch")
    if name == "cpu" and kernels is None:
        raise ValueError("--attention-backend cpu needs loom's CPU kernels (--device cpu, --kernel-backend auto or cpu)")
    if name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton runs on a GPU (on the CPU only through Triton's "
                         "interpreter, TRITON_INTERPRET=1, for tests)")
    return name


# Linears with up to this many input rows stream their weights through loom's kernel; above it
# torch's GEMM is faster (measured on AVX2 and AVX-512 CPUs). With bf16 dot products (AVX512-BF16)
# bfloat16 linears stay faster than torch's GEMM up to DENSE_BF16_ROWS rows (AMD Zen 4: 32 beat it,
# 48 tie).
SMALL_M_ROWS = 8
DENSE_BF16_ROWS = 32


def cpu_ops(kernels) -> Ops:
    """The ops a CPU model runs on `kernels` (None: plain torch)."""
    return Ops(kernels, SMALL_M_ROWS, DENSE_BF16_ROWS)


def load_kernels(backend: str, device: str, isa: str):
    """loom's compiled CPU kernels of level `isa` as --kernel-backend asks, or None where plain
    torch ops run (the torch backend, a GPU)."""
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"--kernel-backend {backend!r}: choose auto, torch or cpu")
    if backend == "cpu" and device != "cpu":
        raise ValueError(f"--kernel-backend cpu: loom's compiled kernels run on the CPU, not on --device {device}")
    if backend == "torch" or device != "cpu":
        return None
    kernels = cpu_kernels.load(isa)
    if kernels is None and backend == "cpu":
        raise RuntimeError("--kernel-backend cpu: the CPU kernels failed to compile (see the log)")
    return kernels


class ModelRunner:
    """One worker's model, KV pool and sampler: the whole model, or with `tp` one tensor-parallel
    rank's shard (rank 0 samples; the other ranks' forward returns no ids), or with `pp` one
    pipeline stage's layers (the last stage samples; the others pass their hidden states on)."""

    def __init__(self, rc: RunnerConfig, tp: TPGroup | None = None, pp: PPGroup | None = None):
        self.config = ModelConfig.from_dir(rc.model_dir)
        self.dtype = rc.dtype
        self.device = rc.device
        self.context_len = min(rc.context_length or self.config.max_position_embeddings,
                               self.config.max_position_embeddings)
        kernels = load_kernels(rc.kernel_backend, rc.device, rc.kernel_isa)
        self.kernel_backend = "cpu" if kernels is not None else "torch"
        # which build runs, and the instruction sets its code paths use
        self.on_gpu = rc.device != "cpu"
        if self.on_gpu:
            from worker_proc.triton_ops import GpuOps

            ops = GpuOps(rc.deterministic)
            self.kernel_isa = "triton (GPU)" + (", deterministic" if rc.deterministic else "")
        else:
            ops = cpu_ops(kernels)
            self.kernel_isa = ("none (plain torch ops)" if kernels is None
                               else cpu_kernels.describe(rc.kernel_isa, kernels.target_macros()))
        self.tp = tp = tp or TPGroup()
        self.shard = shard = TPShard.of(self.config, tp.rank, tp.size)
        self.pp = pp = pp or PPGroup()
        stage = stage_layers(self.config.num_layers, pp.size, pp.rank)
        model = MODEL_CLASSES[self.config.architecture](self.config, self.context_len, ops, shard, tp, stage)
        model.load_weights(iter_checkpoint_tensors(rc.model_dir))
        self.model = model.to(dtype=rc.dtype, device=rc.device).eval()
        quantize_linears(self.model, rc.quantization, tp)  # after the cast: scales stay float32
        pack_dense_weights(self.model)
        self.model.build_layer_stack()
        if not self.on_gpu:
            keep_freed_memory()  # (after loading: its transient copies go back to the kernel)
        self.weight_bytes = sum(t.numel() * t.element_size()
                                for t in {id(t): t for t in (*self.model.parameters(), *self.model.buffers())
                                          if t is not None}.values())
        self.kv_dtype = resolve_kv_dtype(rc.kv_cache_dtype, rc.dtype, rc.quantization)
        if self.on_gpu:
            self.num_slots = plan_kv_slots_gpu(self.config, self.kv_dtype, rc.mem_fraction_static, shard, rc.device)
        else:
            self.num_slots = plan_kv_slots(self.config, self.kv_dtype, rc.kv_cache_gb, shard, len(stage), pp.size)
        self.pool = KVPool(len(stage), self.num_slots, shard.num_kv_heads, self.config.head_dim,
                           self.kv_dtype, rc.max_running_requests, self.context_len, rc.device)
        self.attention_backend = resolve_attention_backend(rc.attention_backend, rc.device, kernels)
        if rc.deterministic and not (self.on_gpu and self.attention_backend == "triton"):
            raise ValueError("--enable-deterministic-inference: the batch-invariant kernels are the GPU's "
                             "(--device cuda with --attention-backend triton)")
        # per-step tables reach the device (or the Triton interpreter) through one staging buffer
        self.staging = HostStaging(rc.device) if self.on_gpu or self.attention_backend == "triton" else None
        if self.attention_backend == "cpu":
            self.attn = PagedKernelAttention(self.pool, self.config.head_dim, kernels)
        elif self.attention_backend == "triton":
            from worker_proc.attention import TritonAttention

            num_sms = torch.cuda.get_device_properties(rc.device).multi_processor_count if self.on_gpu else 1
            split = deterministic_split_tokens(self.context_len) if rc.deterministic else 0
            self.attn = TritonAttention(self.pool, self.config.head_dim, self.staging, num_sms, split)
        else:
            self.attn = TorchAttention(self.pool, shard.num_heads, self.config.head_dim)
        # Greedy rows need only the index of each row's largest logit.
        self.argmax = kernels.argmax_rows if kernels is not None else lambda logits: logits.float().argmax(dim=-1)
        self.eos_token_ids = tuple(rc.eos_token_ids) or self.config.eos_token_ids
        # Per request slot: output token counts and prompt tokens, for the penalties.
        self.output_counts = OutputTokenCounts(rc.max_running_requests, self.config.vocab_size, rc.device)
        self.prompt_tokens = PromptTokenMask(rc.max_running_requests, self.config.vocab_size, rc.device)
        self.futures = FutureMap(rc.max_running_requests)  # sampled ids a later step references
        # speculative drafts counted as outputs (a row's inputs are): slot -> (the row's prefix_len,
        # its drafts); the next step of the slot takes back those its scheduler did not keep
        self.counted_drafts: dict[int, tuple[int, list[int]]] = {}
        self.grammars = GrammarMasks(rc.model_dir, self.config.vocab_size, self.eos_token_ids)
        self.prompt_logprobs: list[list[TokenLogprobs]] = []  # the last step's (forward_with_logprobs)
        self.embeddings: list[bytes] = []  # the last step's, per sample row where any asked (float32 bytes)
        self.graphs = None
        if self.on_gpu and rc.cuda_graph_max_bs > 0 and self.attention_backend == "triton":
            if tp.size > 1 or pp.size > 1:
                log.info("CUDA graphs are off with tensor or pipeline parallelism (collectives are not captured)")
            else:
                from worker_proc.cuda_graph import DecodeGraphs

                self.graphs = DecodeGraphs(self.model, self.attn, min(rc.cuda_graph_max_bs, rc.max_running_requests),
                                           rc.device)
                self.graphs.capture()
        self.dllm = None
        if rc.dllm_algorithm is not None:
            from worker_proc.dllm import DllmRunner
            from worker_proc.dllm_algorithms import DllmAlgoConfig

            self.dllm = DllmRunner(self, rc.dllm_algorithm, DllmAlgoConfig(
                mask_id=dllm_mask_token_id(self.config), block_size=dllm_block_size(self.config, rc.dllm_block_size),
                threshold=rc.dllm_threshold, edit_threshold=rc.dllm_edit_threshold,
                max_post_edit_steps=rc.dllm_max_post_edit_steps))

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch) -> list[int]:
        return self.forward_with_logprobs(batch)[0]

    @torch.inference_mode()
    def forward_with_logprobs(self, batch: ModelWorkerBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sampled ids (one per sample row; 1 + drafts for a row with drafts) and, when any row
        asked, their logprobs; they are also kept in the future map, where a later step's input
        references find them. The prompt logprobs of the step's prompt_logprob_rows are left in
        `prompt_logprobs`, and the sample rows' embeddings, where any asked, in `embeddings`."""
        self.prompt_logprobs, self.embeddings = [], []
        ids, logprobs = self._forward(batch)
        if self.tp.size > 1 and batch.share_samples:  # every rank's map needs them
            ids = self.tp.broadcast_ids(ids, len(batch.future_slots) + sum(batch.draft_lens))
        if len(ids) == len(batch.future_slots):  # (a tensor-parallel rank other than 0 has none otherwise)
            self.futures.store(batch.future_slots, ids)
        return ids, logprobs

    def _forward(self, batch: ModelWorkerBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        fb = ForwardBatch.from_worker_batch(batch)
        self.futures.resolve(fb.input_ids)
        if self.grammars.active:  # (a record holds its slot's current request only)
            self.grammars.reset(fb.req_pool_indices[fb.prefix_lens == 0].tolist())
        if batch.prefix_tables:
            self._apply_prefix_tables(batch, fb)
        if self.counted_drafts:
            self._settle_drafts(fb, batch)
        if batch.track_tokens:
            self._record_tokens(fb, batch.prompt_lens, self._draft_inputs(batch, fb) if batch.draft_lens else None)
        hidden = None if self.pp.is_first else self.pp.recv(len(fb.input_ids), self.config.hidden_size, self.dtype)
        params, output_lens, sample_slots = batch.sampling, batch.output_lens, fb.req_pool_indices[batch.sample_rows]
        later_drafts, ahead, base_lens = None, None, output_lens
        if batch.draft_lens:  # rows with speculative drafts sample each of their last 1 + drafts positions
            params, output_lens, sample_slots, later_drafts, ahead = self._draft_positions(batch, fb, batch.track_tokens)
            base_lens = np.repeat(np.asarray(batch.output_lens), np.asarray(batch.draft_lens) + 1).tolist()
        input_ids, sampled_rows = fb.input_ids, len(fb.logit_rows)
        if batch.prompt_logprob_rows:  # (every position of those rows: their logits follow the sampled rows')
            fb.logit_rows = torch.cat([fb.logit_rows] + [
                torch.arange(int(fb.token_starts[r]), int(fb.token_starts[r] + fb.extend_lens[r]))
                for r in batch.prompt_logprob_rows])
        embed = any(p.embedding for p in params)
        if self.staging is None:
            self.pool.record(fb.req_pool_indices, fb.prefix_lens, fb.extend_lens, fb.token_starts, fb.slots)
            self.attn.prepare(fb)
            model_logits = self.model(fb.input_ids, fb.positions, self.attn, fb.logit_rows, hidden, embed)
        else:
            model_logits = self._forward_on_device(fb, hidden, embed)
        if not self.pp.is_last:
            self.pp.send(*model_logits)
            return [], []
        if embed:
            model_logits, final_hidden = model_logits
            rows = final_hidden[:sampled_rows].float().cpu().numpy()
            self.embeddings = [rows[i].tobytes() if p.embedding else b"" for i, p in enumerate(params)]
        if model_logits is None:  # (a tensor-parallel rank other than 0)
            return [], []
        if batch.prompt_logprob_rows:
            self.prompt_logprobs = self._prompt_logprobs(batch, fb, input_ids, model_logits[sampled_rows:])
            model_logits = model_logits[:sampled_rows]
        if not params:
            return [], []
        pb = PenaltyBatch.build(params, output_lens, self.config.vocab_size, model_logits.device, self.eos_token_ids)
        masks = self.grammars.masks(params, sample_slots, base_lens, ahead)
        if pb.is_noop and masks is None and pb.top_logprobs is None and all(p.is_greedy for p in params):
            return self.argmax(model_logits).tolist(), []
        raw = logits = model_logits.float()
        if not pb.is_noop:
            counts = self.output_counts.gather(sample_slots) if pb.needs_counts else None
            if counts is not None and later_drafts is not None and len(later_drafts[0]):
                # (a position counts the row's tokens up to its own input: not the drafts after it)
                counts.index_put_(later_drafts, torch.tensor(-1, dtype=counts.dtype), accumulate=True)
            logits = pb.apply(raw, counts, self.prompt_tokens.gather(sample_slots) if pb.needs_prompt_mask else None)
        if masks is not None:
            if logits is raw and pb.top_logprobs is not None:  # (the raw logits stay as they are, for logprobs)
                logits = raw.clone()
            self.grammars.apply(logits, masks)
        sb = SamplingBatch.build(params, output_lens, self.config.vocab_size, logits.device)
        ids = sample(logits, sb)
        if pb.top_logprobs is None:
            return ids.tolist(), []
        chosen, top_ids, top_lps = logprobs(raw, ids, pb.top_logprobs)
        chosen, top_ids, top_lps = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
        out = [TokenLogprobs(chosen[i], list(zip(top_ids[i][: p.top_logprobs], top_lps[i][: p.top_logprobs])))
               if p.logprobs else None for i, p in enumerate(params)]
        return ids.tolist(), out

    def _draft_positions(self, batch: ModelWorkerBatch, fb: ForwardBatch, counted: bool):
        """Every sampled position of a step with speculative drafts, in order (a row's last token
        and its drafts each predict the next): the logit rows (set on fb); per position the
        request's sampling parameters, its output index and its request slot; and (position,
        token) index arrays of the drafts after each position, which its output counts must
        leave out. With `counted` (the step counted its inputs as outputs), each row's drafts
        are remembered, to take back those the scheduler does not keep."""
        drafts = np.asarray(batch.draft_lens, dtype=np.int64)
        last = fb.logit_rows.numpy()
        counts = drafts + 1
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        fb.logit_rows = torch.from_numpy(np.repeat(last - drafts, counts) + within)
        params = [p for p, n in zip(batch.sampling, counts) for _ in range(n)]
        output_lens = (np.repeat(np.asarray(batch.output_lens, dtype=np.int64), counts) + within).tolist()
        later_rows, later_tokens, ahead, first = [], [], [], 0
        for row, n, end in zip(batch.sample_rows, drafts, last):
            tokens = fb.input_ids[end - n + 1:end + 1].tolist() if n else []
            ahead += [tokens[:j] for j in range(n + 1)]  # (a grammar's matcher takes them in, then back)
            for j in range(n):  # position j (after j drafts) leaves out drafts j..n-1
                later_rows += [first + j] * (n - j)
                later_tokens += tokens[j:]
            if n and counted:
                self.counted_drafts[int(fb.req_pool_indices[row])] = (int(fb.prefix_lens[row]), tokens)
            first += n + 1
        later = (torch.tensor(later_rows, dtype=torch.int64), torch.tensor(later_tokens, dtype=torch.int64))
        return params, output_lens, np.repeat(fb.req_pool_indices[batch.sample_rows], counts), later, ahead

    @staticmethod
    def _draft_inputs(batch: ModelWorkerBatch, fb: ForwardBatch) -> np.ndarray:
        """Which of the step's tokens are speculative drafts (a grammar's record takes them only
        once kept)."""
        mask = np.zeros(len(fb.input_ids), dtype=bool)
        for row, n in zip(batch.sample_rows, batch.draft_lens):
            end = int(fb.token_starts[row] + fb.extend_lens[row])
            mask[end - n:end] = True
        return mask

    def _settle_drafts(self, fb: ForwardBatch, batch: ModelWorkerBatch) -> None:
        """A slot whose last step had drafts: its row now starts after the ones the scheduler kept
        (prefix_len = that step's + 1 + kept); the rest come off its output counts, the kept ones
        go onto its grammar record. (A slot starting a request, prefix 0 or a cached prefix, drops
        the entry: its counts and record start over.)"""
        restarted = {t.req_pool_idx for t in batch.prefix_tables}
        for slot, prefix in zip(fb.req_pool_indices.tolist(), fb.prefix_lens.tolist()):
            entry = self.counted_drafts.pop(slot, None)
            if entry is not None and prefix > entry[0] and slot not in restarted:
                kept = prefix - entry[0] - 1
                rejected = entry[1][kept:]
                self.output_counts.add([slot] * len(rejected), rejected, times=-1)
                self.grammars.record([slot] * kept, entry[1][:kept])

    @staticmethod
    def _prompt_logprobs(batch: ModelWorkerBatch, fb: ForwardBatch, input_ids: torch.Tensor,
                         logits: torch.Tensor) -> list[list[TokenLogprobs]]:
        """Per prompt_logprob_rows entry, of each prompt token after one of its positions: its
        logprob there (log_softmax of the raw logits) and the `top` most likely tokens'."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out, at = [], 0
        for row, following, top in zip(batch.prompt_logprob_rows, batch.prompt_logprob_next,
                                        batch.prompt_logprob_top):
            start, n = int(fb.token_starts[row]), int(fb.extend_lens[row])
            targets = input_ids[start + 1:start + n].tolist() + ([following] if following >= 0 else [])
            rows = logprobs[at:at + len(targets)].cpu()
            at += n
            chosen = rows.gather(1, torch.tensor(targets, dtype=torch.int64)[:, None])[:, 0].tolist()
            if top:
                top_lps, top_ids = rows.topk(top, dim=-1)
                alternatives = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lps.tolist())]
            else:
                alternatives = [[] for _ in targets]
            out.append([TokenLogprobs(c, a) for c, a in zip(chosen, alternatives)])
        return out

    def _forward_on_device(self, fb: ForwardBatch, hidden=None, return_hidden: bool = False):
        """The forward pass with the step's tensors on the device: one upload of its tables, one
        scatter into req_to_token, then a CUDA graph's replay (a decode step it covers) or the
        eager model."""
        self.staging.begin_step()
        n = len(fb.extend_lens)
        req_of_token = np.repeat(fb.req_pool_indices, fb.extend_lens)
        if self.graphs is not None and n <= self.graphs.max_bs and len(fb.input_ids) == n and not return_hidden:
            bs = self.graphs.padded_size(n)
            pad = bs - n
            ids, positions, loc, reqs, lens, logit_rows = self.staging.upload([
                np.pad(fb.input_ids.numpy(), (0, pad)), np.pad(fb.positions.numpy(), (0, pad)),
                np.pad(fb.slots, (0, pad)), np.pad(fb.req_pool_indices, (0, pad)),
                np.pad(fb.prefix_lens + 1, (0, pad), constant_values=1), fb.logit_rows.numpy()])
            self.pool.write_rows(reqs[:n], positions[:n], loc[:n])
            logits = self.graphs.replay(bs, ids, positions, loc, reqs, lens)
            return logits.index_select(0, logit_rows)
        ids, positions, loc, logit_rows, reqs = self.staging.upload([
            fb.input_ids.numpy(), fb.positions.numpy(), fb.slots, fb.logit_rows.numpy(), req_of_token])
        self.pool.write_rows(reqs, positions, loc)
        fb.input_ids, fb.positions, fb.out_cache_loc, fb.logit_rows = ids, positions, loc, logit_rows
        self.attn.prepare(fb)
        return self.model(ids, positions, self.attn, logit_rows, hidden, return_hidden)
    @torch.inference_mode()
    def forward_dllm(self, batch: ModelWorkerBatch):
        """A step of block-diffusion rounds (worker_proc/dllm.py): the rows' blocks, accept
        lengths and algorithm states (None on tensor-parallel ranks other than 0)."""
        if self.dllm is None:
            raise RuntimeError("a diffusion step reached a worker started without --dllm-algorithm")
        return self.dllm.run(batch)

    def _apply_prefix_tables(self, batch: ModelWorkerBatch, fb: ForwardBatch) -> None:
        """Requests that start on a cached prefix: their req_to_token rows learn its slots, and
        (where their penalties read the history) their counts and prompt mask start from its
        tokens, prompt and output told apart by position as _record_tokens does."""
        prompt_len = dict(zip(batch.req_pool_indices, batch.prompt_lens))
        for table in batch.prefix_tables:
            slots = np.frombuffer(table.slots, dtype=np.int32)
            self.pool.set_prefix(table.req_pool_idx, slots)
            self.grammars.reset([table.req_pool_idx])
            if table.token_ids:
                tokens = torch.from_numpy(np.frombuffer(table.token_ids, dtype=np.int32).astype(np.int64))
                row = [table.req_pool_idx]
                self.output_counts.reset(row)
                self.prompt_tokens.reset(row)
                n_prompt = prompt_len[table.req_pool_idx]
                self.prompt_tokens.add(row * min(n_prompt, len(tokens)), tokens[:n_prompt])
                self.output_counts.add(row * max(len(tokens) - n_prompt, 0), tokens[n_prompt:])
                self.grammars.record(row * max(len(tokens) - n_prompt, 0), tokens[n_prompt:].tolist())

    def _record_tokens(self, fb: ForwardBatch, prompt_lens: list[int], drafts: np.ndarray | None = None) -> None:
        """Keep each slot's prompt-token mask and output-token counts current from the tokens it is
        fed: every output token is fed exactly once (the step after it is sampled, or again in a
        re-prefill after a retraction, which starts the slot over), so counts at sampling time
        cover the whole output so far."""
        starts = torch.from_numpy(fb.req_pool_indices[fb.prefix_lens == 0])  # (a cache hit starts in _apply_prefix_tables)
        if len(starts):
            self.output_counts.reset(starts)
            self.prompt_tokens.reset(starts)
        slot_of_token = torch.from_numpy(np.repeat(fb.req_pool_indices, fb.extend_lens))
        prompt_len_of_token = torch.from_numpy(np.repeat(np.asarray(prompt_lens, dtype=np.int64), fb.extend_lens))
        is_output = fb.positions >= prompt_len_of_token
        self.output_counts.add(slot_of_token[is_output], fb.input_ids[is_output])
        self.prompt_tokens.add(slot_of_token[~is_output], fb.input_ids[~is_output])
        if drafts is not None and drafts.any():  # (a draft goes on the grammar record once kept: _settle_drafts)
            is_output = is_output & ~torch.from_numpy(drafts)
        self.grammars.record(slot_of_token[is_output].tolist(), fb.input_ids[is_output].tolist())
