"""Every message that crosses a process boundary.

Each channel decodes a tagged union of Structs, so a frame of the wrong type or shape is
rejected by msgspec, never executed. Token and slot arrays travel as raw int32 bytes.
"""

from __future__ import annotations

import json

import msgspec


STRUCTURED_OUTPUT_FIELDS = ("json_schema", "json_object", "regex", "ebnf", "choice")  # of SamplingParams


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_regex: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    logprobs: bool = False  # return each output token's logprob (of the raw model distribution)
    top_logprobs: int = 0  # and this many most likely alternatives per position
    # the logprob of each prompt token after the first (given the tokens before it) and this many
    # most likely alternatives at each position; None: not computed
    prompt_logprobs: int | None = None
    # output tokens gathered before they are sent on (the first and the last go at once); None:
    # the server's --stream-interval (a request may raise it, not lower it)
    stream_interval: int | None = None
    # Structured output (at most one): the output must match a JSON schema (its JSON text), be a
    # JSON object, match a regular expression or an EBNF grammar, or be one of the choices
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] = []
    # the grammar applies after the output's first run of these tokens (a reasoning model's end of
    # thinking: its answer is what must match); empty: from the first output token
    grammar_after: list[int] = []
    # return the prompt's embedding: the model's final hidden state (after its last norm) at the
    # last prompt position, as float32 (TokenDelta.embedding); last-token pooling
    embedding: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_grammar(self) -> bool:
        return (self.json_schema is not None or self.json_object or self.regex is not None or self.ebnf is not None
                or bool(self.choice))

    @property
    def structured_fields(self) -> list[str]:
        """The structured-output fields this request sets (a valid one sets at most one)."""
        return [name for name in STRUCTURED_OUTPUT_FIELDS if getattr(self, name) not in (None, False, [])]

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The structured output asked for as (kind, text): ("json_schema", schema), ("json_object",
        ""), ("regex", pattern) or ("ebnf", grammar), choices as an EBNF grammar of their literals;
        None when the output is free."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.ebnf is not None:
            return "ebnf", self.ebnf
        if self.choice:  # (JSON's string escapes are the grammar's)
            return "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        return None

    @property
    def uses_token_history(self) -> bool:
        """Penalties, or a grammar, that read the prompt and output tokens so far."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.has_grammar)


class FinishReason(msgspec.Struct, omit_defaults=True):
    type: str  # "length" | "stop" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None

    def to_dict(self) -> dict:
        return msgspec.structs.asdict(self)


# ---- tokenizer -> scheduler -------------------------------------------------------------

class GenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    routing_key: str | None = None
    # Requests of one group with identical input_ids share one prefill (the n choices of a prompt).
    prefill_group: str | None = None
    routed_dp_rank: int | None = None  # the data-parallel rank that must serve it (None: the controller picks)


class GenerateReqs(msgspec.Struct, tag=True):
    """Requests made together, in one frame, so the scheduler sees them all before it plans the
    next step (the n choices of a prompt then share its prefill)."""

    reqs: list[GenerateReq]


class AbortReq(msgspec.Struct, tag=True):
    rid: str  # "" aborts every request
    message: str = "aborted by client"


class StatsReq(msgspec.Struct, tag=True):
    query_id: str


class FlushCacheReq(msgspec.Struct, tag=True):
    """Empty the prefix cache (every data-parallel rank answers, through the detokenizer)."""

    query_id: str


ToScheduler = GenerateReq | GenerateReqs | AbortReq | StatsReq | FlushCacheReq


class LoadReport(msgspec.Struct, tag=True):
    """A data-parallel rank's load, sent to the DP controller at a bounded rate."""

    dp_rank: int
    received: int  # requests this rank has received since it started
    running: int
    waiting: int
    tokens: int  # KV tokens held + prompt tokens waiting
    finished: list[str] = []  # ids of the requests finished since the last report


ToController = GenerateReq | GenerateReqs | AbortReq | StatsReq | FlushCacheReq | LoadReport


# ---- scheduler -> worker ----------------------------------------------------------------

class ModelWorkerBatch(msgspec.Struct, tag=True):
    """One forward step. Requests are ordered as the scheduler built them; each row extends
    request `req_pool_indices[i]` from `prefix_lens[i]` by `extend_lens[i]` tokens whose KV goes
    to the matching run of `out_cache_loc`. The worker updates its req_to_token mirror from it."""

    step: int
    input_ids: bytes  # int32, sum(extend_lens)
    out_cache_loc: bytes  # int32, sum(extend_lens)
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    prompt_lens: list[int]  # positions >= prompt_len are output tokens (penalties count them)
    sample_rows: list[int]  # rows whose last position is sampled (prompt complete)
    sampling: list[SamplingParams]  # one per sample row
    output_lens: list[int]  # tokens each sampled request has generated so far (seeded noise)
    # Requests whose first rows start after a prefix cache hit: where their cached prefix lies.
    prefix_tables: list["PrefixTable"] = []
    # Some request in the batch (or parked behind one, to share its prefill) has penalties that
    # read its token history: the worker records the rows' tokens. Off, it skips that work.
    track_tokens: bool = True
    # Per sample entry: the future-map entry its sampled id is stored in. An input id -k - 1 < 0
    # is entry k's id, sampled by an earlier step (overlap: a step is planned before the result
    # of the one before it is known). Entries are reused after future_capacity(...) samples.
    future_slots: list[int] = []
    # tensor parallelism under overlap: rank 0 shares the sampled ids so every rank's map has them
    share_samples: bool = False
    dllm: DllmStep | None = None  # a step of diffusion rounds instead of one sampled token per row
    # rows whose every prompt position's logprobs are asked (SamplingParams.prompt_logprobs), with
    # the prompt token that follows each one's chunk (-1: the chunk ends the prompt) and the
    # number of alternatives
    prompt_logprob_rows: list[int] = []
    prompt_logprob_next: list[int] = []
    prompt_logprob_top: list[int] = []
    # speculative decoding, per sample entry: draft tokens at the end of its row (empty: none). Each
    # such row samples its last 1 + drafts positions, in order, as consecutive sample entries of
    # the result (the first at output index output_lens[i], the next one on, ...).
    draft_lens: list[int] = []


class JointThresholdState(msgspec.Struct, tag="joint_threshold", array_like=True):
    """The joint-threshold algorithm's private state for one block (worker_proc/dllm_algorithms.py)."""

    prompt_mask: list[bool]  # block positions that hold prompt tokens: never edited
    post_edit_steps: int = 0  # edit-only rounds run since the block's last mask was filled


# A diffusion algorithm's per-block state, carried opaquely on the scheduler's Req between rounds
# (one Struct per stateful algorithm, decoded by tag: no pickle).
DllmAlgoState = JointThresholdState


class DllmStep(msgspec.Struct, array_like=True):
    """A step of block-diffusion rounds (--dllm-algorithm): each row's last block_size positions
    are its block being denoised (its other positions, block-aligned, are committed tokens whose
    KV is computed from their final ids); attention is block-causal."""

    block_size: int
    # return as soon as a round finishes some block (first done, first out); False: run rounds
    # until every block of the step is done
    fdfo: bool
    # (fdfo) a round that finishes no block is followed by another on the same rows, in the
    # worker, without returning; False: return after one round
    reloop: bool
    algo_states: list[DllmAlgoState | None]  # per row, as the last round left it (None: a new block)


class PrefixTable(msgspec.Struct, array_like=True):
    """A request's KV slots for its first len(slots) tokens (a prefix cache hit), written into
    the worker's req_to_token row before the step; with the prefix's token ids (int32) when the
    request's penalties read its token history (its counts and prompt mask start from them)."""

    req_pool_idx: int
    slots: bytes  # int32
    token_ids: bytes = b""  # int32


def future_capacity(max_running_requests: int) -> int:
    """Entries of the future map: a step samples at most one token per running request, and an
    entry is read at most one step after it is written; room for four steps."""
    return 4 * max_running_requests + 16


class Shutdown(msgspec.Struct, tag=True):
    pass


ToWorker = ModelWorkerBatch | Shutdown


# ---- worker -> scheduler ----------------------------------------------------------------

class WorkerReady(msgspec.Struct, tag=True):
    max_total_tokens: int  # KV slots the memory planner gave the pool
    max_context_len: int
    dtype: str
    device: str


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float  # of the chosen token
    top: list[tuple[int, float]] = []  # (token id, logprob), most likely first


class BatchResult(msgspec.Struct, tag=True):
    step: int
    next_token_ids: list[int]  # one per sample row (1 + its drafts for a row with drafts)
    forward_s: float
    logprobs: list[TokenLogprobs | None] = []  # one per sample row when any row asked
    collective_s: float = 0.0  # of forward_s, rank 0's time in tensor-parallel collectives
    gap_s: float = 0.0  # the worker's wait between the end of its previous forward and this one
    dllm: "DllmResult | None" = None  # the rounds' outcome, for a DllmStep
    # per prompt_logprob_rows entry: the logprobs of the prompt tokens after its chunk's positions
    prompt_logprobs: list[list[TokenLogprobs]] = []
    # one per sample row when any row asked (SamplingParams.embedding): its final hidden state as
    # float32 bytes, b"" for the others
    embeddings: list[bytes] = []


class DllmResult(msgspec.Struct, array_like=True):
    """What a DllmStep's rounds left, per row: its block's ids (int32), the accept length
    (block_size: the block is done and commits; 0: not done, it continues next step from these
    ids and its algorithm state) and the state; how many forward rounds ran, and how many blocks
    they computed in all (the rounds' work: a done block leaves the later rounds)."""

    blocks: list[bytes]
    accept_lens: list[int]
    algo_states: list[DllmAlgoState | None]
    rounds: int
    block_rounds: int = 0


class WorkerError(msgspec.Struct, tag=True):
    message: str


FromWorker = WorkerReady | BatchResult | WorkerError


# ---- scheduler -> detokenizer -> tokenizer ------------------------------------------------

class TokenDelta(msgspec.Struct, omit_defaults=True):
    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish: FinishReason | None = None
    stop: list[str] = []
    skip_special_tokens: bool = True
    retractions: int = 0
    logprobs: list[TokenLogprobs] = []  # one per new id when the request asked
    cached_tokens: int = 0  # prompt tokens it did not compute (shared from another request)
    prompt_logprobs: list[TokenLogprobs] = []  # (once, with the first output) of prompt tokens 2..n
    embedding: bytes = b""  # (once, with the first output) float32, where SamplingParams.embedding asked


class BatchTokenOut(msgspec.Struct, tag=True):
    items: list[TokenDelta]


class TextDelta(msgspec.Struct, omit_defaults=True):
    rid: str
    text: str  # new text since the previous delta
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish: FinishReason | None = None
    retractions: int = 0
    logprobs: list[TokenLogprobs] = []
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = []
    embedding: bytes = b""


class BatchTextOut(msgspec.Struct, tag=True):
    items: list[TextDelta]


class StatsResp(msgspec.Struct, tag=True):
    query_id: str
    stats: dict[str, int | float | str]


class FlushCacheResp(msgspec.Struct, tag=True):
    query_id: str
    refused: str = ""  # why the cache was not flushed ("" when it was)


ToDetokenizer = BatchTokenOut | StatsResp | FlushCacheResp
ToTokenizer = BatchTextOut | StatsResp | FlushCacheResp


# ---- children -> launcher ---------------------------------------------------------------

class ProcReady(msgspec.Struct, tag=True):
    name: str
    info: dict[str, int | float | str] = {}


class ProcFailed(msgspec.Struct, tag=True):
    name: str
    message: str


ToLauncher = ProcReady | ProcFailed


# ---- ZMQ client <-> server ----------------------------------------------------------------

class ClientGenerate(msgspec.Struct, tag=True):
    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    priority: int = 0
    routing_key: str | None = None
    routed_dp_rank: int | None = None


class ClientAbort(msgspec.Struct, tag=True):
    rid: str


class ClientOutput(msgspec.Struct, tag=True):
    rid: str
    text: str  # cumulative text
    output_ids: list[int]
    meta_info: dict
    finished: bool
    error: str | None = None


FromClient = ClientGenerate | ClientAbort
