"""Wire messages decode only as the typed union each channel expects."""

from __future__ import annotations

import msgspec
import pytest

from ipc.messages import (AbortReq, GenerateReq, ModelWorkerBatch, SamplingParams, StatsReq, ToScheduler, ToWorker)


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
