"""The worker process: loads the model (or its tensor-parallel rank's shard of its pipeline
stage's layers) and KV pool, then runs every batch it is sent. Every worker runs every step;
tensor-parallel rank 0 of the last stage returns the sampled ids."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import zmq

from ipc.messages import BatchResult, ModelWorkerBatch, Shutdown, ToWorker, WorkerError, WorkerReady
from ipc.proc import ChildConfig, run_child
from ipc.sockets import PeerWatch, Receiver, Sender

log = logging.getLogger("loom.worker")


def main(config: ChildConfig, report_ready) -> None:
    args = config.server_args
    rank, tp_size = config.tp_rank, args["tp_size"]
    pp_rank, pp_size = config.pp_rank, args.get("pp_size", 1)
    index = pp_rank * tp_size + rank  # among its data-parallel rank's workers
    ctx = zmq.Context()
    batches = Receiver(ctx, zmq.PULL, config.endpoints.worker_in_of(config.dp_rank, index), ToWorker, bind=False)
    results = Sender(ctx, zmq.PUSH, config.endpoints.scheduler_results_of(config.dp_rank))

    import torch  # after the sockets: a failure to import still reaches the scheduler

    from worker_proc.dtype_probe import DTYPES, resolve_dtype
    from worker_proc.model_runner import ModelRunner, RunnerConfig, load_kernels
    from worker_proc.pipeline_parallel import PPGroup
    from worker_proc.tensor_parallel import TPGroup

    group_size = tp_size * pp_size
    torch.set_num_threads(args.get("num_threads") or max(1, (os.cpu_count() or 1) // (group_size * args["dp_size"])))
    try:
        if args["device"] == "cuda":  # one GPU per worker of this host, in launch order
            torch.cuda.set_device((config.dp_rank * group_size + index) % torch.cuda.device_count())
        tp, pp = TPGroup(), PPGroup()
        init_addr = args["dist_init_addrs"][config.dp_rank] if group_size > 1 else ""
        if pp_size > 1:
            tp, pp = PPGroup.connect(rank, tp_size, pp_rank, pp_size, init_addr, args["device"])
        elif tp_size > 1:
            tp = TPGroup.connect(rank, tp_size, init_addr, args["device"])
        kernels = load_kernels(args["kernel_backend"], args["device"], args["kernel_isa"])
        # a group all on this CPU host passes its collectives through shared memory (every rank decides alike)
        if kernels is not None and tp.size > 1 and args["nnodes"] == 1 and not tp.share_memory(
                f"{Path(config.endpoints.directory).name}-dp{config.dp_rank}-pp{pp_rank}", kernels):
            log.warning("no shared memory (/dev/shm) for the tensor-parallel ranks: their collectives take gloo")
        dtypes = list(DTYPES.values())
        dtype, why = resolve_dtype(args["dtype"], args["device"], kernels) if index == 0 else (None, "")
        # the first worker's choice, on all (the whole world: every stage holds the same dtype)
        world = TPGroup(index, group_size, args["device"])
        dtype = dtypes[world.broadcast_index(dtypes.index(dtype) if index == 0 else 0)]
        why = why or f"dtype {str(dtype).removeprefix('torch.')} (as the first worker)"
        runner = ModelRunner(RunnerConfig(
            model_dir=config.model_dir, dtype=dtype, kv_cache_gb=args["kv_cache_gb"] / args["dp_size"],
            max_running_requests=args["max_running_requests"], context_length=args.get("context_length"),
            device=args["device"], kernel_backend=args["kernel_backend"],
            kernel_isa=args["kernel_isa"], quantization=args["quantization"],
            kv_cache_dtype=args["kv_cache_dtype"],
            eos_token_ids=tuple(args.get("eos_token_ids") or ()), attention_backend=args["attention_backend"],
            mem_fraction_static=args["mem_fraction_static"],
            cuda_graph_max_bs=0 if args["disable_cuda_graph"] else args["cuda_graph_max_bs"],
            deterministic=args["enable_deterministic_inference"],
            dllm_algorithm=args.get("dllm_algorithm"), dllm_block_size=args.get("dllm_block_size"),
            dllm_threshold=args.get("dllm_threshold", 0.95), dllm_edit_threshold=args.get("dllm_edit_threshold", 0.9),
            dllm_max_post_edit_steps=args.get("dllm_max_post_edit_steps", 4)), tp, pp)
    except Exception as e:
        results.send(WorkerError(f"{config.name}: {type(e).__name__}: {e}"))
        raise
    dtype_name = str(dtype).removeprefix("torch.")
    log.info("%s; %d threads; KV pool %d tokens (%s); kernels %s; attention %s; quantization %s%s", why,
             torch.get_num_threads(), runner.num_slots, str(runner.kv_dtype).removeprefix("torch."), runner.kernel_isa,
             runner.attention_backend, args["quantization"],
             (f"; tp rank {rank} of {tp_size}" if tp_size > 1 else "")
             + (f"; pipeline stage {pp_rank} of {pp_size}: layers {runner.model.stage.start}-"
                f"{runner.model.stage.stop - 1}" if pp_size > 1 else ""))
    kernels = getattr(runner.model.ops, "kernels", None) if rank == 0 and args["quantization"] == "none" else None
    # (not where bfloat16 runs on AMX tiles: there bf16 prompts are several times faster than fp16's)
    if kernels is not None and kernels.half_products() and not kernels.amx_bf16():
        log.info("this CPU multiplies float16 at about twice float32's rate: --quantization fp16 (float16 "
                 "weights and products, closer to float32 than bfloat16) serves faster")
    results.send(WorkerReady(runner.num_slots, runner.context_len, dtype_name, args["device"]))
    report_ready({"kv_slots": runner.num_slots, "dtype": dtype_name, "dtype_reason": why,
                  "threads": torch.get_num_threads(), "kernel_backend": runner.kernel_backend,
                  "kernel_isa": runner.kernel_isa, "attention_backend": runner.attention_backend,
                  "cuda_graph_max_bs": runner.graphs.max_bs if runner.graphs is not None else 0,
                  "quantization": args["quantization"], "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
                  "tp_rank": rank, "pp_rank": pp_rank, "weight_bytes": runner.weight_bytes})
    trace = StepTrace(args.get("step_trace_dir"), config.name, config.dp_rank, pp_rank, rank)
    returns_results = rank == 0 and pp.is_last
    last_end = None  # when the previous forward ended: the gap before the next is the scheduler's
    # a scheduler on another host (tcp): its going away only shows as the connection closing
    watch = PeerWatch(batches.socket) if config.endpoints.tcp_host else None
    poller = zmq.Poller()
    poller.register(batches.socket, zmq.POLLIN)
    if watch is not None:
        poller.register(watch.monitor, zmq.POLLIN)
    while True:
        if watch is not None and dict(poller.poll()).get(batches.socket) is None:
            if watch.lost():
                raise RuntimeError(f"the scheduler of dp rank {config.dp_rank} disconnected (node 0 went away)")
            continue
        msg = batches.recv()
        if msg is None:  # a frame the receiver dropped (logged there)
            continue
        if isinstance(msg, Shutdown):
            trace.close()
            tp.close()
            pp.close()
            return
        assert isinstance(msg, ModelWorkerBatch)
        t, collective, pp_wait = time.perf_counter(), tp.collective_s, pp.wait_s
        gap = t - last_end if last_end is not None else 0.0
        try:
            if msg.dllm is not None:
                ids, logprobs, dllm = [], [], runner.forward_dllm(msg)
            else:
                (ids, logprobs), dllm = runner.forward_with_logprobs(msg), None
        except Exception as e:
            results.send(WorkerError(f"{config.name}: forward failed at step {msg.step}: {type(e).__name__}: {e}"))
            raise
        last_end = time.perf_counter()
        trace.add(msg.step, t + pp.wait_s - pp_wait, last_end, tp.collective_s - collective, pp.wait_s - pp_wait)
        if returns_results:
            # (forward_s leaves out the wait for the previous stage: the stages' times overlap)
            results.send(BatchResult(msg.step, ids, last_end - t - (pp.wait_s - pp_wait), logprobs,
                                     tp.collective_s - collective, gap, dllm,
                                     runner.prompt_logprobs if msg.dllm is None else [],
                                     runner.embeddings if msg.dllm is None else []))


class StepTrace:
    """With --step-trace-dir: this worker's forward passes as a Chrome trace (one file per worker,
    in the JSON array form, written as it goes: chrome://tracing and Perfetto open a file cut
    short). A pass's interval starts once its input is here (after the previous pipeline stage's
    hidden state arrived): it is the time the worker computes, collectives included."""

    def __init__(self, folder: str | None, name: str, dp_rank: int, pp_rank: int, tp_rank: int):
        self.file = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(folder) / f"{name}.trace.json", "w", buffering=1)
            self.file.write("[\n")
            self.where = {"pid": f"dp {dp_rank}", "tid": f"stage {pp_rank} tp {tp_rank}"}

    def add(self, step: int, start: float, end: float, collective_s: float, wait_s: float) -> None:
        if self.file is not None:  # (perf_counter is the host's monotonic clock: the workers' traces line up)
            self.file.write(json.dumps({
                "name": f"step {step}", "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6, **self.where,
                "args": {"step": step, "collective_ms": collective_s * 1e3, "stage_wait_ms": wait_s * 1e3}}) + ",\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


if __name__ == "__main__":
    run_child(main)
