"""Shared fixtures. Puts the repository root on sys.path so `ipc`, `scheduler_proc` and
`worker_proc` import without installing the package."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # for `from inproc import ...` under any import mode
    sys.path.insert(0, str(TESTS))


# ---- CPU kernels, one build per instruction-set level this CPU runs ---------------------------

def _kernel_levels() -> list[str]:
    from worker_proc import cpu_kernels

    return cpu_kernels.distinct_levels()


@pytest.fixture(scope="module", params=_kernel_levels())
def kernel(request):
    """loom's compiled CPU kernels, built for each level this CPU can execute (native, and the
    portable avx512 / avx2 / scalar levels below it that run other code paths)."""
    from worker_proc import cpu_kernels

    module = cpu_kernels.load(request.param)
    if module is None:
        pytest.skip("no C++ compiler here: the torch path is used instead")
    return module


_kernel_outcomes: dict[str, Counter] = defaultdict(Counter)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    level = getattr(item, "callspec", None) and item.callspec.params.get("kernel")
    if level and (report.when == "call" or (report.when == "setup" and not report.passed)):
        _kernel_outcomes[level][report.outcome] += 1


def pytest_terminal_summary(terminalreporter):
    """Which kernel builds the tests ran, so a run on any CPU shows every path it covered."""
    if not _kernel_outcomes:
        return
    from worker_proc import cpu_kernels

    terminalreporter.write_line(f"CPU kernel tests per build (this CPU runs {', '.join(cpu_kernels.supported_levels())};"
                                " a level that runs native's code paths is tested as native):")
    for level, counts in _kernel_outcomes.items():
        tally = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        terminalreporter.write_line(f"  {cpu_kernels.describe(level)}: {tally}")


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
