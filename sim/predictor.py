"""How long a step takes, from its shape. Two predictors behind one call, `seconds(batch)`:

  FittedPredictor    a linear model over the step's shape, fitted (scikit-learn, non-negative
                     coefficients) to steps of loom's own worker timed on this machine by
                     `python -m sim profile`; evaluated as a dot product (the simulator calls it
                     once per step).
  RooflinePredictor  for hardware loom is not on: a device's peak FLOP/s and memory bandwidth and a
                     model's per-layer shapes. A step takes max(FLOPs / (peak x mfu), bytes /
                     (bandwidth x mbu)) + a fixed per-step overhead: FLOPs of every linear for
                     every token, the LM head for sampled rows, attention (QK and PV) over each
                     token's context; bytes of every weight once plus the KV each row reads and
                     writes. mfu/mbu are the fractions of peak a well-tuned engine reaches.
                     Over --tp-size devices each holds 1/tp of the weights, heads and KV and does
                     1/tp of the arithmetic, and every layer adds two all-reduces of the step's
                     activations over the interconnect (a ring: 2 (tp-1)/tp of the bytes each way,
                     plus a fixed latency per collective).

The step's shape: scheduler_proc.step_metrics.STEP_FEATURES (the live scheduler logs the same
features with --step-log-file).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from scheduler_proc.step_metrics import STEP_FEATURES, step_features


class Predictor:
    description = ""

    def seconds(self, batch) -> float:
        return self.seconds_of_shape(step_features(batch))

    def seconds_of_shape(self, shape: tuple) -> float:
        """A forward's time from its STEP_FEATURES (a diffusion step's later rounds have no batch)."""
        raise NotImplementedError


class FittedPredictor(Predictor):
    """intercept + coef . STEP_FEATURES + knee_coef x min(tokens, knee): the knee term lets the
    first few tokens of a step cost more than the rest (a step of a few rows streams every weight
    for little arithmetic; past the knee its time grows with its tokens' compute), which a
    straight line through small and large steps gets wrong at both ends."""

    KNEES = (0, 2, 4, 8, 16, 32, 64)  # candidates the fit picks from (0: no knee term)

    def __init__(self, intercept: float, coef: dict[str, float], meta: dict | None = None, knee: int = 0,
                 knee_coef: float = 0.0):
        self.intercept = intercept
        self.coef = coef
        self.meta = meta or {}
        self.knee, self.knee_coef = knee, knee_coef
        self._w = tuple(coef[f] for f in STEP_FEATURES)
        self.description = f"fitted on {self.meta.get('cpu', 'this machine')} ({self.meta.get('dtype', '?')})"

    def seconds_of_shape(self, shape: tuple) -> float:
        w0, w1, w2, w3, w4 = self._w
        t, s, pa, dc, r = shape
        return (self.intercept + w0 * t + w1 * s + w2 * pa + w3 * dc + w4 * r
                + self.knee_coef * (t if t < self.knee else self.knee))

    @classmethod
    def load(cls, path: str | Path) -> "FittedPredictor":
        data = json.loads(Path(path).read_text())
        return cls(data["intercept"], data["coef"], data.get("meta"), data.get("knee", 0), data.get("knee_coef", 0.0))

    @classmethod
    def fit(cls, shapes: list[tuple], seconds: list[float], meta: dict | None = None) -> "FittedPredictor":
        """Least squares of the relative error (a 20 ms decode step counts as much as a 1 s
        prompt step), with non-negative coefficients (time never falls as work grows); the knee
        is the candidate with the smallest mean relative error on these steps."""
        import numpy as np
        from sklearn.linear_model import LinearRegression

        x = np.asarray(shapes, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        best = None
        for knee in cls.KNEES:
            features = np.column_stack([x, np.minimum(x[:, 0], knee)]) if knee else x
            model = LinearRegression(positive=True).fit(features, y, sample_weight=1.0 / y**2)
            error = float(np.mean(np.abs(model.predict(features) - y) / y))
            if best is None or error < best[0] - 1e-9:
                best = (error, knee, model)
        _, knee, model = best
        coef = dict(zip(STEP_FEATURES, (float(c) for c in model.coef_)))
        return cls(max(0.0, float(model.intercept_)), coef, meta, knee, float(model.coef_[-1]) if knee else 0.0)

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        Path(path).write_text(json.dumps({"intercept": self.intercept, "coef": self.coef, "features": STEP_FEATURES,
                                          "knee": self.knee, "knee_coef": self.knee_coef, "meta": self.meta,
                                          **(extra or {})}, indent=1))


@dataclass(frozen=True)
class Device:
    flops: float  # peak dense FLOP/s in the model's dtype
    bandwidth: float  # memory bytes/s
    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 0.5e-3  # launch, scheduling, sampling not hidden
    interconnect: float = 0.0  # bytes/s each way between the devices of a tensor-parallel group
    collective_latency_s: float = 10e-6  # a small all-reduce's fixed cost


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @property
    def linear_params_per_layer(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def weight_bytes(self) -> int:
        return (self.layers * self.linear_params_per_layer + 2 * self.vocab * self.hidden) * self.dtype_bytes


DEVICES = {
    "h100": Device(flops=989e12, bandwidth=3.35e12, interconnect=450e9),  # SXM, bf16 dense, NVLink 4
    "h200": Device(flops=989e12, bandwidth=4.8e12, interconnect=450e9),
    "a100": Device(flops=312e12, bandwidth=2.0e12, interconnect=300e9),  # SXM 80 GB, NVLink 3
    "l40s": Device(flops=362e12, bandwidth=0.864e12, interconnect=32e9),  # PCIe 4 x16
}

MODELS = {
    "llama-2-7b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                             vocab=32000),
    "llama-2-70b": ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                              vocab=32000),
    "llama-3-8b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                             vocab=128256),
    "qwen2.5-7b": ModelShape(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
                             vocab=152064),
    "smollm2-135m": ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                               vocab=49152),
}


class RooflinePredictor(Predictor):
    def __init__(self, device: Device, model: ModelShape, device_name: str = "", model_name: str = "",
                 tensor_parallel: int = 1):
        if tensor_parallel < 1 or model.kv_heads % tensor_parallel and tensor_parallel % model.kv_heads:
            raise ValueError(f"--tp-size {tensor_parallel} does not split {model.kv_heads} KV heads")
        if tensor_parallel > 1 and not device.interconnect:
            raise ValueError(f"{device_name or 'this device'} has no interconnect for tensor parallelism")
        self.device, self.model, self.tensor_parallel = device, model, tensor_parallel
        d, m, tp = device, model, tensor_parallel
        self.s_per_flop = 1.0 / (d.flops * d.mfu * tp)
        self.s_per_byte = 1.0 / (d.bandwidth * d.mbu * tp)
        self.flops_per_token = 2.0 * m.layers * m.linear_params_per_layer
        self.flops_per_sample = 2.0 * m.hidden * m.vocab
        self.flops_per_pair = 4.0 * m.layers * m.heads * m.head_dim  # QK^T and PV, one query x one key
        self.kv_bytes_per_token = 2.0 * m.layers * m.kv_heads * m.head_dim * m.dtype_bytes
        self.weight_bytes = float(m.weight_bytes)
        # two all-reduces a layer (after attention, after the MLP) of each token's hidden state
        self.all_reduce_s_per_token = (2 * m.layers * 2 * (tp - 1) / tp * m.hidden * m.dtype_bytes / d.interconnect
                                       if tp > 1 else 0.0)
        self.all_reduce_s_per_step = 2 * m.layers * d.collective_latency_s if tp > 1 else 0.0
        self.description = (f"roofline {device_name or 'device'}{f' x{tp} (tensor parallel)' if tp > 1 else ''} "
                            f"({d.flops / 1e12:.0f} TFLOP/s x mfu {d.mfu}, {d.bandwidth / 1e12:.2f} TB/s x mbu "
                            f"{d.mbu}, +{d.step_overhead_s * 1e3:.1f} ms/step) for {model_name or 'the model'}")

    @classmethod
    def named(cls, device: str, model: str, tensor_parallel: int = 1) -> "RooflinePredictor":
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: choose one of {', '.join(DEVICES)}")
        if model not in MODELS:
            raise ValueError(f"model {model!r}: choose one of {', '.join(MODELS)}")
        return cls(DEVICES[device], MODELS[model], device, model, tensor_parallel)

    def seconds_of_shape(self, shape: tuple) -> float:
        t, s, pa, dc, _ = shape
        flops = t * self.flops_per_token + s * self.flops_per_sample + (pa + dc) * self.flops_per_pair
        # KV read by decodes (their context) and written for every new token; prompt rows read
        # their prefix once per step (tiled attention keeps the rest on chip)
        kv_bytes = (dc + t) * self.kv_bytes_per_token
        return max(flops * self.s_per_flop, (self.weight_bytes + kv_bytes) * self.s_per_byte) \
            + self.device.step_overhead_s + self._all_reduce_seconds(t)

    def _all_reduce_seconds(self, tokens: int) -> float:
        return self.all_reduce_s_per_step + tokens * self.all_reduce_s_per_token if tokens else 0.0

    def describe(self) -> dict:
        return {"device": asdict(self.device), "model": asdict(self.model), "tensor_parallel": self.tensor_parallel}
