"""What machine a benchmark ran on, and how much memory each run peaked at."""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

# SIMD features worth naming (x86 /proc/cpuinfo "flags", ARM "Features").
SIMD = ("sse3", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
        "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
        "neon", "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")


def _cpuinfo() -> tuple[str, list[str], int | None]:
    """(CPU model, SIMD flags, physical cores) from /proc/cpuinfo where there is one."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return platform.processor() or platform.machine(), [], None
    model, flags, cores = "", set(), set()
    physical = core = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("model name", "Hardware", "cpu model") and not model:
            model = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
            cores.add((physical, core))
    return (model or platform.processor() or platform.machine(),
            [f for f in SIMD if f in flags], len(cores) or None)


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def fingerprint(threads: int | None) -> dict:
    model, simd, physical = _cpuinfo()
    ram = _ram_bytes()
    try:
        import llama_cpp
        system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    except Exception as e:  # the backend library may be missing or built differently
        system_info = f"unavailable: {e}"
    return {
        "cpu": model,
        "machine": platform.machine(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "simd": simd,
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {d: _version(d) for d in ("edgespec", "llama-cpp-python", "numpy", "onnxruntime")},
        "llama_cpp_system_info": system_info,
        "threads": threads,
    }


# ---------------------------------------------------------------------------
# Peak resident memory per run
# ---------------------------------------------------------------------------


class PeakRSS:
    """Peak resident memory of this process between ``reset()`` and ``read()``.

    Linux: writing "5" to /proc/self/clear_refs resets the kernel's high-water
    mark (VmHWM), so each run's peak is its own. Elsewhere getrusage's
    ru_maxrss is the peak since the process started: a run's figure is then
    never below an earlier run's, which ``method`` says.
    """

    def __init__(self):
        self.method = "VmHWM, reset before each run" if self._reset_hwm() else \
            "getrusage ru_maxrss: the process's peak since it started, not reset between runs"

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.method.startswith("VmHWM"):
            self._reset_hwm()

    def read(self) -> float:
        """Peak resident memory in MiB."""
        if self.method.startswith("VmHWM"):
            peak = process_peak_rss_mib(os.getpid())
            if peak is not None:
                return peak
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def process_peak_rss_mib(pid: int) -> float | None:
    """A running process's peak resident memory in MiB (Linux's VmHWM, which
    belongs to its memory map and so starts afresh at exec), or None where
    /proc has no figure (another OS, or the process has exited).

    A child's getrusage peak (wait4) is no measure of the child on Linux: it
    starts from its parent's peak, carried across vfork and exec, so a llama.cpp
    binary run by a benchmark that holds a 1 GB model would "use" 1 GB at once.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
