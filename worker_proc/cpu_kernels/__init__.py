"""loom's CPU kernels, compiled on first use with torch's C++ extension loader, one build per
instruction-set level, cached under the loom cache folder (`LOOM_CACHE_DIR`, default
~/.cache/loom/kernels).

Levels: `native` (-march=native: everything this CPU has; what the engine runs by default) and the
portable x86-64 levels below it, `avx512` (x86-64-v4), `avx2` (x86-64-v3: AVX2, FMA, F16C) and
`scalar` (x86-64: SSE2). The kernels pick their code paths from the compiler's target macros, so
each level is a different program; the tests run every level this CPU can execute.

`load()` returns None where no compiler is available: callers then keep the pure-torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

log = logging.getLogger("loom.kernels")
_HERE = Path(__file__).parent
# (longest compile first: the build runs them two or more at a time)
_SOURCES = [_HERE / n for n in ("paged_attention.cpp", "layer_stack.cpp", "small_m_linear.cpp", "bindings.cpp",
                                "integer_panels.cpp", "fused_ops.cpp", "half_linear.cpp", "amx_linear.cpp",
                                "shared_memory_reduce.cpp")]
_HEADERS = [_HERE / n for n in ("vec_math.h", "kernels.h", "amx_tiles.h", "team.h", "kv_int8.h")]

ISA_LEVELS = ("native", "avx512", "avx2", "scalar")
_MARCH = {"native": "native", "avx512": "x86-64-v4", "avx2": "x86-64-v3", "scalar": "x86-64"}
# -O2 for the scalar level (CPUs older than AVX2, a fallback nothing is tuned for): at -O3 GCC
# spent 70 s on paged_attention.cpp alone there (its 16-lane vectors lowered to SSE), at -O2 23 s.
_OPT = {level: "-O2" if level == "scalar" else "-O3" for level in ISA_LEVELS}
# /proc/cpuinfo flags a level's code may use (x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE;
# v4 adds AVX-512 F, BW, CD, DQ, VL).
_V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
_NEEDS = {"native": set(), "scalar": set(), "avx2": _V3,
          "avx512": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
# The target macros the kernels branch on: two builds with the same set run the same code.
PATH_MACROS = ("__FMA__", "__F16C__", "__AVX2__", "__AVX512F__", "__AVX512BW__", "__AVX512VNNI__",
               "__AVX512BF16__", "__AVX512FP16__", "__AMX_BF16__")

_modules: dict[str, object] = {}
_failed: set[str] = set()


def _cpu_flags() -> set[str]:
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
        return set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def supported_levels() -> list[str]:
    """The levels this CPU can execute, highest first (`native` always)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    flags = _cpu_flags()
    return [level for level in ISA_LEVELS if _NEEDS[level] <= flags]


def target_macros(level: str) -> frozenset[str] | None:
    """PATH_MACROS the compiler defines for `level` on this machine (None if it cannot tell)."""
    return _macros(_MARCH[level])


@cache
def _macros(march: str) -> frozenset[str] | None:
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), f"-march={march}", "-dM", "-E", "-x", "c++",
                              os.devnull], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    defined = {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}
    return frozenset(m for m in PATH_MACROS if m in defined)


def distinct_levels() -> list[str]:
    """The supported levels that run different code, highest first: a portable level whose
    macros equal native's is left out (native runs the same paths)."""
    native = target_macros("native")
    return [level for level in supported_levels() if level == "native" or target_macros(level) != native]


def describe(level: str, macros=None) -> str:
    """`level` and the instruction sets its code paths use, e.g. 'native (fma f16c avx2 avx512f ...)':
    from `macros` (a build's own target_macros()), else as the compiler predicts them."""
    macros = target_macros(level) if macros is None else set(macros)
    if macros is None:
        return level
    names = [m.strip("_").lower() for m in PATH_MACROS if m in macros]
    return f"{level} ({' '.join(names) or 'no SIMD beyond SSE2'})"


def _build_name(level: str) -> str:
    # -march=native code is only valid on the CPU that built it: native builds are keyed by its flags.
    key = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + _MARCH[level].encode() + _OPT[level].encode()
    if level == "native":
        key += " ".join(sorted(_cpu_flags())).encode() or platform.processor().encode()
    return f"loom_cpu_kernels_{level}_{hashlib.sha1(key).hexdigest()[:12]}"


def _build_dir(name: str) -> Path:
    from worker_proc.model_loader import cache_dir

    path = cache_dir() / "kernels" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(level: str = "native"):
    """The kernels built for `level` (compiled on first use, about a minute on 2 cores), or
    None where they cannot be built. A level this CPU cannot execute is refused."""
    if level not in ISA_LEVELS:
        raise ValueError(f"kernel level {level!r}: choose one of {', '.join(ISA_LEVELS)}")
    if level not in supported_levels():
        raise ValueError(f"kernel level {level!r} needs instructions this CPU lacks; it runs "
                         f"{', '.join(supported_levels())}")
    if level in _modules or level in _failed:
        return _modules.get(level)
    name = _build_name(level)
    build_dir = _build_dir(name)
    cached = (build_dir / f"{name}.so").exists()
    try:
        from torch.utils.cpp_extension import load as load_extension

        with _CompileNotice(None if cached else f"compiling loom's CPU kernels for {describe(level)}; "
                                                "once per CPU and loom version"):
            _modules[level] = load_extension(
                name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build_dir),
                extra_cflags=[_OPT[level], "-std=c++20", f"-march={_MARCH[level]}", "-fopenmp", "-fvisibility=hidden"],
                extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler / headers: the torch path still works
        _failed.add(level)
        log.warning("CPU kernels unavailable (%s: %s); using plain torch ops", type(e).__name__, e)
    return _modules.get(level)


class _CompileNotice:
    """Says that a compile started, shows the seconds passing (on a terminal) and how long it took."""

    def __init__(self, message: str | None):
        self.message = message
        self._done = threading.Event()

    def __enter__(self):
        if self.message is None:
            return self
        log.warning("%s (about a minute on 2 cores) ...", self.message)
        self._start = time.monotonic()
        if sys.stderr.isatty():
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            print(f"\r  compiling CPU kernels: {time.monotonic() - self._start:.0f} s", end="", file=sys.stderr,
                  flush=True)
        print(file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self.message is None:
            return
        self._done.set()
        if exc[0] is None:
            log.warning("CPU kernels compiled in %.0f s", time.monotonic() - self._start)
