"""The worker process: loads the model and KV pool, then runs every batch it is sent."""

from __future__ import annotations

import logging
import os
import time

import zmq

from ipc.messages import BatchResult, ModelWorkerBatch, Shutdown, ToWorker, WorkerError, WorkerReady
from ipc.proc import ChildConfig, run_child
from ipc.sockets import Receiver, Sender

log = logging.getLogger("loom.worker")


def main(config: ChildConfig, report_ready) -> None:
    args = config.server_args
    ctx = zmq.Context()
    batches = Receiver(ctx, zmq.PULL, config.endpoints.worker_in, ToWorker, bind=False)
    results = Sender(ctx, zmq.PUSH, config.endpoints.scheduler_results)

    import torch  # after the sockets: a failure to import still reaches the scheduler

    from worker_proc.dtype_probe import resolve_dtype
    from worker_proc.model_runner import ModelRunner, RunnerConfig

    torch.set_num_threads(args.get("num_threads") or os.cpu_count() or 1)
    try:
        dtype, why = resolve_dtype(args["dtype"], args["device"])
        runner = ModelRunner(RunnerConfig(
            model_dir=config.model_dir, dtype=dtype, kv_cache_gb=args["kv_cache_gb"],
            max_running_requests=args["max_running_requests"], context_length=args.get("context_length"),
            device=args["device"], kernel_backend=args["kernel_backend"],
            kernel_isa=args["kernel_isa"], quantization=args["quantization"],
            eos_token_ids=tuple(args.get("eos_token_ids") or ())))
    except Exception as e:
        results.send(WorkerError(f"{type(e).__name__}: {e}"))
        raise
    dtype_name = str(dtype).removeprefix("torch.")
    log.info("%s; %d threads; KV pool %d tokens; kernels %s; quantization %s", why, torch.get_num_threads(),
             runner.num_slots, runner.kernel_isa, args["quantization"])
    results.send(WorkerReady(runner.num_slots, runner.context_len, dtype_name, args["device"]))
    report_ready({"kv_slots": runner.num_slots, "dtype": dtype_name, "dtype_reason": why,
                  "threads": torch.get_num_threads(), "kernel_backend": runner.kernel_backend,
                  "kernel_isa": runner.kernel_isa,
                  "quantization": args["quantization"]})
    while True:
        msg = batches.recv()
        if isinstance(msg, Shutdown):
            return
        assert isinstance(msg, ModelWorkerBatch)
        t = time.perf_counter()
        try:
            ids, logprobs = runner.forward_with_logprobs(msg)
        except Exception as e:
            results.send(WorkerError(f"forward failed at step {msg.step}: {type(e).__name__}: {e}"))
            raise
        results.send(BatchResult(msg.step, ids, time.perf_counter() - t, logprobs))


if __name__ == "__main__":
    run_child(main)
