"""A request as the scheduler sees it: token ids, progress through its prompt, KV it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from ipc.messages import DllmAlgoState, FinishReason, SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    arrival: float = 0.0  # clock value when added, for policies and timeouts
    priority: int = 0  # higher first, with --enable-priority-scheduling
    routing_key: str | None = None  # groups requests under the routing-key policy
    started: float | None = None  # clock value of its first scheduled step (running timeout)
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish: FinishReason | None = None
    # KV held: the slot of every computed token, in order (kv_slots); the buffer grows by
    # doubling so a decode step appends in O(1).
    kv_buffer: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    num_computed: int = 0
    kv_reserve: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))  # slots its next decodes take
    req_pool_idx: int = -1
    retractions: int = 0
    sent_ids: int = 0  # output ids the core has handed out (ReqOutput.new_ids)
    streamed_ids: int = 0  # of those, sent on to the detokenizer (a stream interval holds some back)
    output_logprobs: list = field(default_factory=list)  # per output id, when the request asked
    embedding: bytes = b""  # with sampling.embedding: the prompt's (opaque here), from its first sample
    # with sampling.prompt_logprobs: entry p (opaque here) is prompt token p + 1's, None until a
    # step computed it; the prefix cache is not matched while any is missing
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_missing: int = 0
    # Requests of one prefill group (the n choices of a prompt) wait while another of the group
    # computes the prompt, then take it from the prefix cache.
    prefill_group: str | None = None
    cached_tokens: int = 0  # prompt tokens it did not compute (taken from the prefix cache)
    cache_node: object = None  # the prefix cache node it locks (radix_cache.TreeNode)
    prefix_table_due: bool = False  # its next row tells the worker where its cached prefix lies
    in_flight: bool = False  # in a step not yet applied (SchedulerConfig.pipeline_stages only)
    # Block diffusion (scheduler_proc/dllm.py): the block being denoised, as the last round left
    # it (None: the next block starts from masks), the algorithm's state for it (opaque here,
    # handed back verbatim), and how many leading positions have KV computed from their final ids
    # (whole blocks; kv_slots may reach further, over the block in progress).
    dllm_incomplete_ids: list[int] | None = None
    dllm_algo_state: DllmAlgoState | None = None
    dllm_kv_valid: int = 0

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs_missing = max(len(self.input_ids) - 1, 0)
            self.prompt_logprobs = [None] * self.prompt_logprobs_missing

    def fill_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole list."""
        n_in = len(self.input_ids)
        if end <= n_in:
            return self.input_ids[start:end]
        if start >= n_in:
            return self.output_ids[start - n_in : end - n_in]
        return self.input_ids[start:] + self.output_ids[: end - n_in]

    @property
    def kv_slots(self) -> np.ndarray:
        return self.kv_buffer[: self.num_computed]

    def append_kv(self, slots: np.ndarray) -> None:
        end = self.num_computed + len(slots)
        if end > len(self.kv_buffer):
            grown = np.empty(max(end, 2 * len(self.kv_buffer), 16), dtype=np.int32)
            grown[: self.num_computed] = self.kv_buffer[: self.num_computed]
            self.kv_buffer = grown
        self.kv_buffer[self.num_computed : end] = slots
        self.num_computed = end

    def clear_kv(self) -> None:
        self.kv_buffer = np.empty(0, dtype=np.int32)
        self.num_computed = 0

    @property
    def num_fill(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache: the prompt (or its rest) before the first sample,
        1 while decoding, input+output again after a retraction freed the KV."""
        return self.num_fill - self.num_computed

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)
