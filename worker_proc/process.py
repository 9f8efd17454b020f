"""The worker process: loads the model (or its tensor-parallel rank's shard) and KV pool, then
runs every batch it is sent. Every rank runs every step; rank 0 returns the sampled ids."""

from __future__ import annotations

import logging
import os
import time

import zmq

from ipc.messages import BatchResult, ModelWorkerBatch, Shutdown, ToWorker, WorkerError, WorkerReady
from ipc.proc import ChildConfig, run_child
from ipc.sockets import PeerWatch, Receiver, Sender

log = logging.getLogger("loom.worker")


def main(config: ChildConfig, report_ready) -> None:
    args = config.server_args
    rank, tp_size = config.tp_rank, args["tp_size"]
    ctx = zmq.Context()
    batches = Receiver(ctx, zmq.PULL, config.endpoints.worker_in_of(config.dp_rank, rank), ToWorker, bind=False)
    results = Sender(ctx, zmq.PUSH, config.endpoints.scheduler_results_of(config.dp_rank))

    import torch  # after the sockets: a failure to import still reaches the scheduler

    from worker_proc.dtype_probe import DTYPES, resolve_dtype
    from worker_proc.model_runner import ModelRunner, RunnerConfig
    from worker_proc.tensor_parallel import TPGroup

    torch.set_num_threads(args.get("num_threads") or max(1, (os.cpu_count() or 1) // (tp_size * args["dp_size"])))
    try:
        if args["device"] == "cuda":  # one GPU per worker of this host, in launch order
            torch.cuda.set_device((config.dp_rank * tp_size + rank) % torch.cuda.device_count())
        tp = (TPGroup.connect(rank, tp_size, args["dist_init_addrs"][config.dp_rank], args["device"])
              if tp_size > 1 else TPGroup())
        dtypes = list(DTYPES.values())
        dtype, why = resolve_dtype(args["dtype"], args["device"]) if rank == 0 else (None, "")
        dtype = dtypes[tp.broadcast_index(dtypes.index(dtype) if rank == 0 else 0)]  # rank 0's choice
        why = why or f"dtype {str(dtype).removeprefix('torch.')} (as tp rank 0)"
        runner = ModelRunner(RunnerConfig(
            model_dir=config.model_dir, dtype=dtype, kv_cache_gb=args["kv_cache_gb"] / args["dp_size"],
            max_running_requests=args["max_running_requests"], context_length=args.get("context_length"),
            device=args["device"], kernel_backend=args["kernel_backend"],
            kernel_isa=args["kernel_isa"], quantization=args["quantization"],
            eos_token_ids=tuple(args.get("eos_token_ids") or ()), attention_backend=args["attention_backend"],
            mem_fraction_static=args["mem_fraction_static"],
            cuda_graph_max_bs=0 if args["disable_cuda_graph"] else args["cuda_graph_max_bs"],
            deterministic=args["enable_deterministic_inference"],
            dllm_algorithm=args.get("dllm_algorithm"), dllm_block_size=args.get("dllm_block_size"),
            dllm_threshold=args.get("dllm_threshold", 0.95), dllm_edit_threshold=args.get("dllm_edit_threshold", 0.9),
            dllm_max_post_edit_steps=args.get("dllm_max_post_edit_steps", 4)), tp)
    except Exception as e:
        results.send(WorkerError(f"tp rank {rank}: {type(e).__name__}: {e}"))
        raise
    dtype_name = str(dtype).removeprefix("torch.")
    log.info("%s; %d threads; KV pool %d tokens; kernels %s; attention %s; quantization %s%s", why,
             torch.get_num_threads(), runner.num_slots, runner.kernel_isa, runner.attention_backend, args["quantization"],
             f"; tp rank {rank} of {tp_size}" if tp_size > 1 else "")
    results.send(WorkerReady(runner.num_slots, runner.context_len, dtype_name, args["device"]))
    report_ready({"kv_slots": runner.num_slots, "dtype": dtype_name, "dtype_reason": why,
                  "threads": torch.get_num_threads(), "kernel_backend": runner.kernel_backend,
                  "kernel_isa": runner.kernel_isa, "attention_backend": runner.attention_backend,
                  "cuda_graph_max_bs": runner.graphs.max_bs if runner.graphs is not None else 0,
                  "quantization": args["quantization"],
                  "tp_rank": rank, "weight_bytes": runner.weight_bytes})
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
            tp.close()
            return
        assert isinstance(msg, ModelWorkerBatch)
        t, collective = time.perf_counter(), tp.collective_s
        gap = t - last_end if last_end is not None else 0.0
        try:
            if msg.dllm is not None:
                ids, logprobs, dllm = [], [], runner.forward_dllm(msg)
            else:
                (ids, logprobs), dllm = runner.forward_with_logprobs(msg), None
        except Exception as e:
            results.send(WorkerError(f"tp rank {rank}: forward failed at step {msg.step}: {type(e).__name__}: {e}"))
            raise
        last_end = time.perf_counter()
        if rank == 0:
            results.send(BatchResult(msg.step, ids, last_end - t, logprobs, tp.collective_s - collective, gap, dllm))


if __name__ == "__main__":
    run_child(main)
