"""CPU kernels compiled on first use (torch's C++ extension loader; cached per CPU under
~/.cache/torch_extensions). `load()` returns None where no compiler is available: callers then
keep the pure-torch path."""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path

log = logging.getLogger("loom.kernels")
_SOURCES = [Path(__file__).with_name(n) for n in ("bindings.cpp", "paged_attention.cpp", "small_m_linear.cpp",
                                                    "fused_ops.cpp", "layer_stack.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("vec_math.h", "kernels.h")]
_module = None
_failed = False


def _cpu_tag() -> str:
    # -march=native code is only valid on the CPU that built it: key the build by its flags.
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    src = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    return hashlib.sha1(flags.encode() + src).hexdigest()[:12]


def load():
    global _module, _failed
    if _module is not None or _failed:
        return _module
    try:
        from torch.utils.cpp_extension import load as load_extension

        _module = load_extension(
            name=f"loom_cpu_kernels_{_cpu_tag()}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler / headers: the torch path still works
        _failed = True
        log.warning("CPU kernels unavailable (%s: %s); using plain torch ops", type(e).__name__, e)
    return _module
