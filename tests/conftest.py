"""Shared fixtures. Puts the repository root on sys.path so `ipc`, `scheduler_proc` and
`worker_proc` import without installing the package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # for `from inproc import ...` under any import mode
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once from GGUF into ~/.cache/loom."""
    from worker_proc.model_loader import ensure_default_model

    return Path(ensure_default_model())


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    tok = smollm2_tokenizer
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def engine(default_model_dir):
    """One loom Engine (all processes) on the default model, float32, shared by the tests."""
    from launch import Engine

    with Engine(dtype="float32", kv_cache_gb=1.0, max_running_requests=32, port=0) as e:
        yield e


@pytest.fixture(scope="session")
def hf_smollm2(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
