"""Wire messages decode only as the typed union each channel expects; the worker builds the same
step from a batch by either of its paths."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from ipc.messages import (AbortReq, GenerateReq, ModelWorkerBatch, SamplingParams, StatsReq, ToScheduler, ToWorker)
from worker_proc.forward_batch import ForwardBatch


def test_round_trip_and_tagged_union():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToScheduler)
    for msg in (GenerateReq("a", [1, 2, 3], SamplingParams(temperature=0.0, stop=["x"])), AbortReq("a"), StatsReq("q")):
        assert dec.decode(enc.encode(msg)) == msg


@pytest.mark.parametrize("frame", [
    b"\x80\x04\x95",  # a pickle header
    msgspec.msgpack.encode({"type": "os.system", "rid": "x"}),
    msgspec.msgpack.encode({"type": "GenerateReq", "rid": "x", "input_ids": "not a list", "sampling": {}}),
    msgspec.msgpack.encode(ModelWorkerBatch(0, b"", b"", [], [], [], [], [], [], [])),  # right wire, wrong channel
])
def test_malformed_or_foreign_frames_are_rejected(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        msgspec.msgpack.Decoder(ToScheduler).decode(frame)


def test_worker_channel_accepts_only_worker_messages():
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(ToWorker).decode(msgspec.msgpack.encode(AbortReq("a")))


def test_decode_step_fast_path_builds_what_the_general_path_builds():
    rng = np.random.default_rng(0)
    for n in (1, 3, 17):
        arrays = (rng.integers(-5, 1000, n).astype(np.int32), rng.integers(0, 4096, n).astype(np.int32),
                  rng.permutation(n).astype(np.int64), rng.integers(1, 500, n).astype(np.int64),
                  np.ones(n, dtype=np.int64), rng.permutation(n)[: max(1, n // 2)].astype(np.int64))
        fast, general = ForwardBatch._decodes_only(*arrays), ForwardBatch._rows(*arrays, block=0)
        for field in ForwardBatch.__slots__:
            a, b = getattr(fast, field), getattr(general, field)
            if isinstance(a, (torch.Tensor, np.ndarray)):
                assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
            else:
                assert a == b, field
