"""A random-weight checkpoint of a model's shape: its config (fields overridable) and tokenizer,
with weights drawn at random instead of its own. Step times do not depend on the weights' values,
so the benchmarks can time a model (or a larger one of the same family) where its weights are
not at hand, e.g. on a machine they cannot be copied to:

    python benchmarks/random_checkpoint.py --out /tmp/smollm2-random
    python benchmarks/random_checkpoint.py --out /tmp/llama-1b-shape --set num_hidden_layers=16 \\
        --set hidden_size=2048 --set intermediate_size=8192 --set num_attention_heads=32 --set num_key_value_heads=8
    python benchmarks/bench_one_batch.py --model-path /tmp/smollm2-random ...

Benchmark requests run to their length (ignore_eos), so random outputs time like real ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template", "vocab", "merges")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`key=value` pairs; values parse as JSON (numbers, true/false, null, lists), else stay text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set takes key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build(like: Path, out: Path, overrides: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Writes the checkpoint to `out`; returns its config fields that set the shape and its size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(like))
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise SystemExit(f"--set {key}: {type(config).__name__} has no such field")
        setattr(config, key, value)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (initialising a large model is faster there)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    copied = [f.name for f in like.iterdir() if f.is_file() and f.name.startswith(TOKENIZER_FILES)]
    for name in copied:
        shutil.copy(like / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    return {"dir": str(out), "like": str(like), "overrides": overrides, "parameters": params,
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "tokenizer_files": copied}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint to")
    p.add_argument("--like", type=Path, default=None,
                   help="checkpoint folder whose config and tokenizer to take (default: loom's embedded model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable), e.g. --set num_hidden_layers=16")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the stored weights (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (default: %(default)s)")
    args = p.parse_args(argv)
    like = args.like
    if like is None:
        from worker_proc.model_loader import ensure_default_model

        like = Path(ensure_default_model())
    info = build(like, args.out, parse_overrides(args.overrides), getattr(torch, args.dtype), args.seed)
    print(f"{info['dir']}: {info['parameters'] / 1e6:.1f} M parameters, {info['bytes'] / 2**20:.1f} MiB "
          f"({args.dtype}), the shape of {info['like']}" + (f" with {info['overrides']}" if info["overrides"] else ""))
    return info


if __name__ == "__main__":
    main()
