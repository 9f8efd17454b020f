"""The scheduler process: wraps SchedulerCore in an event loop between the tokenizer (or, with
--dp-size > 1, the DP controller), its workers and the detokenizer. One batch is in flight at a
time (overlap mode comes later)."""

from __future__ import annotations

import logging
import time

import msgspec
import regex
import zmq

from detokenizer_proc.decoder import load_decoder
from ipc.messages import (AbortReq, BatchResult, BatchTokenOut, FinishReason, FlushCacheReq, FlushCacheResp, FromWorker,
                          GenerateReq,
                          GenerateReqs, LoadReport, StatsReq, StatsResp, TokenDelta, ToScheduler, WorkerError,
                          WorkerReady)
from ipc.proc import ChildConfig, run_child
from ipc.sockets import PeerWatch, Receiver, Sender
from scheduler_proc.core import ReqOutput, SchedulerConfig, SchedulerCore
from scheduler_proc.event_loop import event_loop_normal, event_loop_overlap, event_loop_pipeline
from scheduler_proc.schedule_batch import ScheduleBatch
from scheduler_proc.step_metrics import StepMetrics, StepRecorder
from scheduler_proc.req import Req

log = logging.getLogger("loom.scheduler")


class StopChecker:
    """Decodes only the tail of a request's output to look for its stop strings and regexes;
    returns the matched text. A regex search has a time limit: a pattern that backtracks
    catastrophically ends its request (with why) instead of stalling every request's step."""

    REGEX_WINDOW = 64  # tokens a stop_regex match may span
    REGEX_TIMEOUT_S = 0.02

    def __init__(self, decoder):
        self.decoder = decoder
        self.patterns: dict[str, regex.Pattern] = {}

    def __call__(self, req: Req, produced: int) -> str | FinishReason | None:
        """The stop string or regex match in the request's first `produced` output tokens' tail
        (or the abort of a regex that ran out of time)."""
        sp = req.sampling
        # A token decodes to at least one byte, so this many tokens cover the longest stop.
        window = max([len(s.encode()) + 1 for s in sp.stop] + [self.REGEX_WINDOW if sp.stop_regex else 0])
        tail = self.decoder.decode(req.output_ids[max(0, produced - window) : produced],
                                   skip_special_tokens=sp.skip_special_tokens)
        for s in sp.stop:
            if s in tail:
                return s
        for pattern in sp.stop_regex:
            compiled = self.patterns.get(pattern) or self.patterns.setdefault(pattern, regex.compile(pattern))
            try:
                match = compiled.search(tail, timeout=self.REGEX_TIMEOUT_S)
            except TimeoutError:
                log.warning("request %s: stop_regex %r took over %g s on %d characters; ending the request",
                            req.rid, pattern[:80], self.REGEX_TIMEOUT_S, len(tail))
                return FinishReason("abort", message=f"stop_regex {pattern[:80]!r} took over "
                                                     f"{self.REGEX_TIMEOUT_S * 1000:g} ms to search the output")
            if match and match.group(0):
                return match.group(0)
        return None


def dllm_scheduling(args: dict, model_dir: str) -> dict:
    """The SchedulerConfig fields of block diffusion (none without --dllm-algorithm)."""
    if not args.get("dllm_algorithm"):
        return {}
    from worker_proc.model_config import ModelConfig, dllm_block_size, dllm_mask_token_id

    model = ModelConfig.from_dir(model_dir)
    return {"dllm_block_size": dllm_block_size(model, args.get("dllm_block_size")),
            "dllm_mask_id": dllm_mask_token_id(model), "dllm_fdfo": args.get("dllm_fdfo", True),
            "dllm_in_place": args.get("dllm_in_place", True)}


class SchedulerProcess:
    def __init__(self, config: ChildConfig, report_ready):
        args = config.server_args
        ep = config.endpoints
        ctx = zmq.Context()
        self.dp_rank = config.dp_rank
        self.requests = Receiver(ctx, zmq.PULL, ep.scheduler_in_of(self.dp_rank), ToScheduler)
        self.results = Receiver(ctx, zmq.PULL, ep.scheduler_results_of(self.dp_rank), FromWorker)
        # one socket per worker (tensor-parallel rank of each pipeline stage): every worker runs every step
        self.pp_size = args.get("pp_size", 1)
        self.workers = [Sender(ctx, zmq.PUSH, ep.worker_in_of(self.dp_rank, index), bind=True)
                        for index in range(args["tp_size"] * self.pp_size)]
        self.detokenizer = Sender(ctx, zmq.PUSH, ep.detokenizer_in)
        # data parallelism: this rank's load goes to the DP controller at a bounded rate
        self.controller = Sender(ctx, zmq.PUSH, ep.controller_in) if args["dp_size"] > 1 else None
        self.received = 0  # requests received since start
        self.metrics = StepMetrics(args.get("log_interval") or 0)
        step_log = args.get("step_log_file")
        if step_log and args["dp_size"] > 1:
            step_log = f"{step_log}.dp{self.dp_rank}"
        self.step_log = StepRecorder(step_log)
        # (a diffusion step's rows continue from its result: nothing to plan ahead; a pipeline
        # plans ahead its own way: event_loop_pipeline)
        self.overlap = (not args.get("disable_overlap_schedule", True) and not args.get("dllm_algorithm")
                        and self.pp_size == 1)
        self.stream_interval = args.get("stream_interval") or 1  # (ServerArgs.stream_interval)
        self.watchdog_timeout = args.get("watchdog_timeout") or 0  # seconds a step may take (0: no limit)
        self.share_samples = self.overlap and args["tp_size"] > 1  # every TP rank's future map needs them
        self.launched_after_idle: set[int] = set()  # steps whose worker gap is idle time, not overhead
        self.was_idle = True
        self.finished_since_report: list[str] = []
        self.last_report = (0.0, None)  # (when, what it said)
        self.encoder = msgspec.msgpack.Encoder()
        self.poller = zmq.Poller()
        self.poller.register(self.requests.socket, zmq.POLLIN)
        self.poller.register(self.results.socket, zmq.POLLIN)
        # workers on other hosts (tcp): a killed one only shows as its connection going away
        self.peer_watches = [PeerWatch(w.socket) for w in self.workers] if ep.tcp_host else []
        self.idle_poller = zmq.Poller()
        self.idle_poller.register(self.requests.socket, zmq.POLLIN)
        for watch in self.peer_watches:
            self.poller.register(watch.monitor, zmq.POLLIN)
            self.idle_poller.register(watch.monitor, zmq.POLLIN)

        readies = []
        while len(readies) < len(self.workers):
            ready = self.results.recv()
            if isinstance(ready, WorkerError):
                raise RuntimeError(f"worker failed to start: {ready.message}")
            if isinstance(ready, WorkerReady):
                readies.append(ready)
        # the ranks plan the same pool; the smallest is what they all hold
        ready = min(readies, key=lambda r: r.max_total_tokens)
        decoder = load_decoder(config.model_dir)
        eos = tuple(args.get("eos_token_ids") or ())
        self.core = SchedulerCore(
            SchedulerConfig.from_args(args, ready.max_total_tokens, ready.max_context_len, eos,
                                      pipeline_stages=self.pp_size, **dllm_scheduling(args, config.model_dir)),
            stop_checker=StopChecker(decoder),
        )
        self.clock = time.monotonic
        report_ready({"max_total_tokens": ready.max_total_tokens, "max_context_len": ready.max_context_len,
                      "dtype": ready.dtype, "device": ready.device})
        log.info("ready: %d KV slots, context %d, %s", ready.max_total_tokens, ready.max_context_len, ready.dtype)

    # ---- inputs ----------------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, GenerateReqs):
            for one in msg.reqs:
                self.add_request(one)
        elif isinstance(msg, AbortReq):
            self.emit(self.core.abort(msg.rid, msg.message))
        elif isinstance(msg, StatsReq):
            stats = {**self.core.stats(), "dp_rank": self.dp_rank, "requests_received": self.received,
                     "overlap_schedule": int(self.overlap), **self.metrics.stats()}
            self.detokenizer.send(StatsResp(msg.query_id, stats))
        elif isinstance(msg, FlushCacheReq):
            self.detokenizer.send(FlushCacheResp(msg.query_id, self.core.flush_cache() or ""))
        # None: a frame the receiver dropped (logged there)

    def add_request(self, msg: GenerateReq) -> None:
        self.received += 1
        req = Req(msg.rid, msg.input_ids, msg.sampling, arrival=self.clock(), priority=msg.priority,
                  routing_key=msg.routing_key, prefill_group=msg.prefill_group)
        ended = self.core.add_request(req)
        if ended is not None:
            self.emit([ended])

    def drain_requests(self) -> None:
        while self.requests.poll(0):
            self.handle(self.requests.recv())

    # ---- outputs ---------------------------------------------------------------------------

    def emit(self, outputs: list[ReqOutput]) -> None:
        items = []
        for o in outputs:
            r = o.req
            if not (o.finished or self._stream_due(r)):
                continue
            if o.finished and self.controller is not None:
                self.finished_since_report.append(r.rid)
            first, r.streamed_ids = r.streamed_ids, r.sent_ids
            items.append(TokenDelta(
                rid=r.rid, new_ids=r.output_ids[first:r.sent_ids], prompt_tokens=len(r.input_ids),
                completion_tokens=r.sent_ids, finish=r.finish if o.finished else None, stop=r.sampling.stop,
                skip_special_tokens=r.sampling.skip_special_tokens, retractions=r.retractions,
                logprobs=r.output_logprobs[first:r.sent_ids] if r.sampling.logprobs else [],
                cached_tokens=r.cached_tokens,
                prompt_logprobs=r.prompt_logprobs if first == 0 and r.sampling.prompt_logprobs is not None else [],
                embedding=r.embedding if first == 0 else b""))
        if items:
            self.detokenizer.send(BatchTokenOut(items))

    def _stream_due(self, r: Req) -> bool:
        """Whether a running request's tokens so far go on now: at every token with an interval
        of 1, else its first tokens at once and then every `interval` tokens."""
        interval = max(self.stream_interval, r.sampling.stream_interval or 1)
        return interval == 1 or r.streamed_ids == 0 or r.sent_ids - r.streamed_ids >= interval

    REPORT_INTERVAL = 0.02  # seconds between load reports to the DP controller, at most

    def report_load(self, idle: bool = False) -> None:
        """This rank's load to the DP controller: at most every REPORT_INTERVAL while busy, and
        once more when it goes idle (so the controller does not keep a stale busy figure)."""
        if self.controller is None:
            return
        core = self.core
        waiting_tokens = sum(len(r.input_ids) for r in core.waiting)
        held = core.token_pool.capacity - core.token_pool.num_free
        load = (self.received, len(core.running), core.stats()["num_waiting"], held + waiting_tokens)
        when, last = self.last_report
        now = self.clock()
        if (load == last and not self.finished_since_report) or (not idle and now - when < self.REPORT_INTERVAL):
            return
        self.controller.send(LoadReport(self.dp_rank, *load, self.finished_since_report))
        self.finished_since_report = []
        self.last_report = (now, load)

    # ---- the steps the event loops (event_loop.py) are made of ----------------------------------

    def run(self) -> None:
        if self.pp_size > 1:
            event_loop_pipeline(self, self.pp_size)
        else:
            (event_loop_overlap if self.overlap else event_loop_normal)(self)

    def plan(self) -> ScheduleBatch | None:
        """Queued requests in, then the core's next step (None: nothing to run)."""
        started = self.clock()
        self.drain_requests()
        batch, ended = self.core.next_batch(self.clock())
        self.emit(ended)
        self.report_load(idle=batch is None)
        if batch is not None:
            self.step_log.on_planned(batch, started)
        return batch

    def launch(self, batch: ScheduleBatch, after: ScheduleBatch | None = None) -> None:
        """Sends the step to every worker (while `after`, the step before, may still run)."""
        wire = batch.to_worker_batch()
        wire.share_samples = self.share_samples
        frame = self.encoder.encode(wire)
        for worker in self.workers:
            worker.send_encoded(frame)
        if self.was_idle:
            self.launched_after_idle.add(batch.step)
            self.was_idle = False

    def apply_result(self, batch: ScheduleBatch) -> None:
        result = self.wait_result()
        assert result.step == batch.step, (result.step, batch.step)
        after_idle = batch.step in self.launched_after_idle
        self.launched_after_idle.discard(batch.step)
        gap = 0.0 if after_idle else result.gap_s
        line = self.metrics.on_step(result.forward_s, gap, result.collective_s)
        if line:
            log.info(line)
        if result.dllm is not None:
            self.emit(self.core.on_dllm_result(batch, result.dllm))
        else:
            self.emit(self.core.on_result(batch, result.next_token_ids, result.logprobs, result.prompt_logprobs,
                                          result.embeddings))
        self.step_log.on_applied(batch, self.clock(), after_idle, result.forward_s)

    def idle_wait(self) -> None:
        leaks = self.core.idle_leaks()
        if leaks:
            log.error("IDLE SELF-CHECK FAILED: %s", "; ".join(leaks))
        # Idle: sleep until a request arrives (or a queued one's timeout may be due).
        self.idle_poller.poll(1000 if self.core.waiting or self.core.running else None)
        self.check_peers()
        self.was_idle = True
        self.step_log.on_idle()

    def check_peers(self) -> None:
        for rank, watch in enumerate(self.peer_watches):
            if watch.lost():
                raise RuntimeError(f"the tp rank {rank} worker of dp rank {self.dp_rank} disconnected (its process "
                                   "or host went away)")

    def wait_result(self) -> BatchResult:
        # Requests that arrive during the forward are queued now, so they join the next step.
        started = self.clock()
        while True:
            timeout_ms = None
            if self.watchdog_timeout:
                waited = self.clock() - started
                if waited >= self.watchdog_timeout:
                    raise RuntimeError(
                        f"watchdog: the worker of dp rank {self.dp_rank} has not answered a step in {waited:.1f} s "
                        f"(--watchdog-timeout {self.watchdog_timeout:g}): it is stalled or hung")
                timeout_ms = (self.watchdog_timeout - waited) * 1000
            for sock, _ in self.poller.poll(timeout_ms):
                if sock is not self.results.socket and sock is not self.requests.socket:
                    self.check_peers()
                    continue
                if sock is self.results.socket:
                    msg = self.results.recv()
                    if isinstance(msg, WorkerError):
                        raise RuntimeError(f"worker failed: {msg.message}")
                    if isinstance(msg, BatchResult):
                        return msg
                    continue
                self.handle(self.requests.recv())


def main(config: ChildConfig, report_ready) -> None:
    SchedulerProcess(config, report_ready).run()


if __name__ == "__main__":
    run_child(main)
