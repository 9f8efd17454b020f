"""Figures for the benchmark results. matplotlib is optional (the `bench` extra): without it every
plot function prints one line saying so and returns None."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np


def load_pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib, or the `bench` extra)")
        return None
    return plt


def plot_latency_cdf(ttfts_s: Sequence[float | None], e2es_s: Sequence[float | None], path: Path,
                     title: str = "") -> Path | None:
    """Empirical CDFs of TTFT and end-to-end latency (ms), side by side."""
    plt = load_pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, name in ((axes[0], ttfts_s, "TTFT"), (axes[1], e2es_s, "E2E latency")):
        ms = np.sort(np.array([v for v in values if v is not None], dtype=np.float64)) * 1000.0
        if ms.size:
            # Starts at 0 on the left of the fastest request and steps up 1/n at each one.
            ax.step(np.concatenate([ms[:1], ms]), np.arange(ms.size + 1) / ms.size, where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(ms, q), color="grey", linestyle=style, linewidth=0.8, label=f"p{q}")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_throughput_vs_batch(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Decode and prefill tok/s against batch size (log-log), with the decode roofline."""
    plt = load_pyplot()
    if plt is None:
        return None
    bs = [r["batch_size"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.plot(bs, [r["decode_tok_s"] for r in rows], "o-", label="decode (measured)")
    if all(r.get("roof_tok_s") for r in rows):
        ax.plot(bs, [r["roof_tok_s"] for r in rows], "k--", linewidth=1,
                label="roofline: min(bandwidth, GEMM)")
    ax.set_ylabel("decode tok/s")
    ax2 = axes[1]
    ax2.plot(bs, [r["prefill_tok_s"] for r in rows], "s-", color="tab:orange", label="prefill (measured)")
    if all(r.get("prefill_gemm_roof_tok_s") for r in rows):
        ax2.plot(bs, [r["prefill_gemm_roof_tok_s"] for r in rows], "k--", linewidth=1, label="GEMM roofline")
    ax2.set_ylabel("prefill tok/s")
    for a in axes:
        a.set_xscale("log", base=2)
        a.set_xticks(bs, [str(b) for b in bs])
        a.set_yscale("log")
        a.set_xlabel("batch size")
        a.grid(alpha=0.3, which="both")
        a.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return path
