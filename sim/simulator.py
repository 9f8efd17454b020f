"""A discrete-event simulator over loom's own scheduling core: N replicas, each a SchedulerCore
with the server's configuration (batching strategy, policies, prefix cache, chunking: the same
flags), behind the DP controller's load balancer, on a virtual clock. A step's duration comes
from a predictor (predictor.py); its sampled tokens are placeholders that never stop a request
(a request ends at its output length). Nothing of the scheduler is re-implemented here.

Pipeline stages (--pp-stages K): a step passes K stages of 1/K of its time each; a replica keeps
up to K steps of disjoint requests in flight (the core leaves requests in flight out of its next
plans: SchedulerConfig.pipeline_stages), so stage s works on micro-batch i while stage s+1 works on
micro-batch i-1.

Overlap scheduling (overlap=True, the server's default): as the live overlap loop, the next step
is planned as soon as a step starts (the core plans around the step in flight), unless the core's
overlap_blocker says to wait for its result; a request that arrives while a step runs therefore
joins the step after next, as it does live.

Block diffusion (a config with dllm_block_size): the core plans diffusion steps as it does live;
how many rounds each block needs comes from sim/dllm.py (BlockRounds), and a step lasts its
rounds' predicted times.
"""

from __future__ import annotations

import heapq
import time
from array import array
from dataclasses import asdict, dataclass, field, replace

from ipc.messages import LoadReport, SamplingParams
from scheduler_proc.core import SchedulerConfig, SchedulerCore
from scheduler_proc.load_balancer import LoadBalancer
from scheduler_proc.req import Req
from sim.dllm import BlockRounds
from sim.predictor import Predictor
from sim.workload import SimRequest

ARRIVAL, STEP_DONE, STAGE_FREE = 0, 1, 2


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline on the virtual clock."""

    rid: str
    replica: int
    arrival: float
    prompt_len: int
    output_len: int
    scheduled: float = -1.0  # first admitted
    first_token: float = -1.0
    last_token: float = -1.0
    finished: float = -1.0
    tokens: int = 0
    tbt_max: float = 0.0
    restarts: int = 0
    preempted_at: float = -1.0  # retracted, not yet producing again
    preempted_s: float = 0.0  # time from each retraction to its next token
    finish_reason: str = ""


@dataclass
class StepLog:
    """Every step, column-wise (array('d'): a million steps stay small)."""

    replica: array = field(default_factory=lambda: array("i"))
    start: array = field(default_factory=lambda: array("d"))
    duration: array = field(default_factory=lambda: array("d"))
    rows: array = field(default_factory=lambda: array("i"))
    tokens: array = field(default_factory=lambda: array("i"))
    decodes: array = field(default_factory=lambda: array("i"))
    kv_used: array = field(default_factory=lambda: array("i"))
    waiting: array = field(default_factory=lambda: array("i"))

    def __len__(self) -> int:
        return len(self.start)


@dataclass
class SimResult:
    records: list[RequestRecord]
    steps: StepLog
    tbts: array  # every time between two tokens of a request
    end_time: float  # virtual seconds until the last request finished
    wall_s: float
    replicas: int
    kv_slots: int
    predictor: str
    config: dict


class _Replica:
    __slots__ = ("index", "core", "stage_free", "in_flight", "received", "finished", "planned")

    def __init__(self, index: int, core: SchedulerCore, stages: int):
        self.index = index
        self.core = core
        self.stage_free = [0.0] * stages  # when each pipeline stage is next free
        self.in_flight = 0  # steps planned and not yet applied
        self.received = 0
        self.finished: list[str] = []  # since the last load report
        self.planned = None  # overlap: the step planned while the one in flight runs


class _Routed:
    """What a load balancing method reads of a request."""

    __slots__ = ("input_ids", "routed_dp_rank")

    def __init__(self, prompt_len: int):
        self.input_ids = range(prompt_len)
        self.routed_dp_rank = None


class Simulator:
    def __init__(self, config: SchedulerConfig, predictor: Predictor, replicas: int = 1, pp_stages: int = 1,
                 load_balance_method: str = "round_robin", seed: int = 0, progress: bool = True,
                 dllm_rounds: tuple[int, int] = (4, 12), overlap: bool = False):
        if replicas < 1 or pp_stages < 1:
            raise ValueError("replicas and pipeline stages: at least 1 each")
        if config.dllm_block_size and pp_stages > 1:
            raise ValueError("block diffusion runs on one pipeline stage only")
        self.block_rounds = BlockRounds(*dllm_rounds, seed=seed) if config.dllm_block_size else None
        # as the live scheduler: no overlap loop for diffusion steps or pipeline stages
        self.overlap = overlap and not config.dllm_block_size and pp_stages == 1
        self.config = replace(config, pipeline_stages=pp_stages)
        self.predictor = predictor
        self.stages = pp_stages
        self.balancer = LoadBalancer(load_balance_method, replicas, seed)
        self.needs_tokens = load_balance_method == "total_tokens"
        self.replicas = [_Replica(i, SchedulerCore(replace(self.config)), pp_stages) for i in range(replicas)]
        self.progress = progress

    def run(self, requests: list[SimRequest]) -> SimResult:
        wall0 = time.perf_counter()
        events: list[tuple] = []
        seq = 0
        for i, r in enumerate(requests):
            events.append((r.arrival, seq, ARRIVAL, i))
            seq += 1
        heapq.heapify(events)
        records: list[RequestRecord] = []
        by_rid: dict[str, RequestRecord] = {}
        steps, tbts = StepLog(), array("d")
        predict = self.predictor.seconds
        stage_count = self.stages
        overlap = self.overlap
        bar = _progress(len(requests)) if self.progress else None
        done = 0
        now = 0.0

        def plan(rep: _Replica, now: float):
            """The core's next step (None: nothing to run), with the records' bookkeeping."""
            core = rep.core
            retractions = core.num_retractions
            batch, ended = core.next_batch(now)
            for out in ended:
                finish(out.req, now, rep)
            if core.num_retractions != retractions:
                for req in core.waiting:
                    rec = by_rid[req.rid]
                    if req.retractions > rec.restarts:
                        rec.restarts, rec.preempted_at = req.retractions, now
            if batch is not None:
                for row in batch.rows:
                    rec = by_rid[row.req.rid]
                    if rec.scheduled < 0:
                        rec.scheduled = now
            return batch

        def launch(rep: _Replica, batch, now: float) -> None:
            nonlocal seq
            core = rep.core
            if batch.dllm_block_size:
                duration, dllm_result = self.block_rounds.run(batch, self.predictor)
            else:
                duration, dllm_result = predict(batch), None
            stage_s = duration / stage_count
            t = now
            for s in range(stage_count):  # each stage starts when it is free and the last is done
                t = max(t, rep.stage_free[s]) + stage_s
                rep.stage_free[s] = t
            rep.in_flight += 1
            steps.replica.append(rep.index)
            steps.start.append(now)
            steps.duration.append(t - now)
            steps.rows.append(len(batch.rows))
            steps.tokens.append(batch.num_tokens)
            steps.decodes.append(batch.num_decode)
            steps.kv_used.append(core.token_pool.capacity - core.token_pool.num_free)
            steps.waiting.append(len(core.waiting))
            heapq.heappush(events, (t, seq, STEP_DONE, (rep, batch, dllm_result)))
            seq += 1
            if stage_count > 1:
                heapq.heappush(events, (rep.stage_free[0], seq, STAGE_FREE, rep))
                seq += 1
            if overlap:  # the live overlap loop plans the next step as this one starts
                rep.planned = None if core.overlap_blocker(batch) is not None else plan(rep, now)

        def start_steps(rep: _Replica, now: float) -> None:
            """Launches steps while the replica's first stage is free and it has fewer than K in
            flight; with overlap, the step planned while the last one ran goes first."""
            while rep.in_flight < stage_count and rep.stage_free[0] <= now:
                batch, rep.planned = rep.planned, None
                if batch is None:
                    batch = plan(rep, now)
                if batch is None:
                    return
                launch(rep, batch, now)

        def finish(req: Req, now: float, rep: _Replica) -> None:
            nonlocal done
            rec = by_rid.pop(req.rid)
            rec.finished = now
            rec.finish_reason = req.finish.type if req.finish else ""
            rep.finished.append(req.rid)
            done += 1
            if bar is not None:
                bar.update(1)

        def report(rep: _Replica) -> None:
            core = rep.core
            tokens = 0
            if self.needs_tokens:
                tokens = core.token_pool.capacity - core.token_pool.num_free + sum(len(r.input_ids) for r in core.waiting)
            self.balancer.on_report(LoadReport(rep.index, rep.received, len(core.running), len(core.waiting), tokens,
                                               rep.finished))
            rep.finished = []

        kick: list[_Replica] = []  # replicas to plan for once every event of this instant is in
        while events:
            now, _, kind, what = heapq.heappop(events)
            if kind == ARRIVAL:
                spec = requests[what]
                routed = _Routed(spec.prompt_len)
                index = self.balancer.pick(routed)
                self.balancer.on_sent(index, routed)
                rep = self.replicas[index]
                rep.received += 1
                rec = RequestRecord(spec.rid, index, spec.arrival, spec.prompt_len, spec.output_len)
                records.append(rec)
                by_rid[spec.rid] = rec
                req = Req(spec.rid, spec.prompt_ids(what),
                          SamplingParams(max_new_tokens=spec.output_len, ignore_eos=True), arrival=now)
                refused = rep.core.add_request(req)
                if refused is not None:
                    finish(req, now, rep)
                    continue
                kick.append(rep)
            elif kind == STEP_DONE:
                rep, batch, dllm_result = what
                rep.in_flight -= 1
                if dllm_result is not None:
                    outputs = rep.core.on_dllm_result(batch, dllm_result)
                else:
                    outputs = rep.core.on_result(batch, [1] * sum(1 for r in batch.rows if r.samples))
                for out in outputs:
                    if out.new_ids:
                        rec = by_rid[out.req.rid]
                        if rec.tokens == 0:
                            rec.first_token = now
                        else:
                            gap = now - rec.last_token
                            tbts.append(gap)
                            if gap > rec.tbt_max:
                                rec.tbt_max = gap
                        if rec.preempted_at >= 0:
                            rec.preempted_s += now - rec.preempted_at
                            rec.preempted_at = -1.0
                        rec.tokens += len(out.new_ids)
                        rec.last_token = now
                    if out.finished:
                        finish(out.req, now, rep)
                report(rep)
                kick.append(rep)
            else:  # STAGE_FREE
                kick.append(what)
            if kick and (not events or events[0][0] > now):
                for rep in kick:
                    start_steps(rep, now)
                kick.clear()
        if bar is not None:
            bar.close()
        for rep in self.replicas:
            leaks = rep.core.idle_leaks()
            if leaks or rep.core.waiting or rep.core.running:
                raise RuntimeError(f"replica {rep.index} ended with work or leaks: {leaks}")
        return SimResult(records, steps, tbts, now, time.perf_counter() - wall0, len(self.replicas),
                         self.config.max_total_tokens, self.predictor.description, asdict(self.config))


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="simulated requests", unit="req", mininterval=0.5)

