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
