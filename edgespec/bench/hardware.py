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
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


# ---------------------------------------------------------------------------
# Read bandwidth
# ---------------------------------------------------------------------------

BANDWIDTH_FILE = "bandwidth.json"


def measure_bandwidth(threads: int, *, n_bytes: int = 512 << 20, passes: int = 5) -> float:
    """Read bandwidth in bytes/s with ``threads`` threads streaming a buffer of
    ``n_bytes`` (far larger than any last-level cache), the fastest of
    ``passes`` (the C core's es_measure_bandwidth)."""
    from ..capi import check, ffi, lib

    params = ffi.new("es_bandwidth_params *", lib.es_bandwidth_default_params())
    params.n_bytes, params.n_threads, params.n_passes = n_bytes, threads, passes
    out = ffi.new("double *")
    check(lib.es_measure_bandwidth(params, out), "es_measure_bandwidth")
    return out[0]


def bandwidth(threads: int, *, remeasure: bool = False) -> float:
    """This machine's read bandwidth with ``threads`` threads, in bytes/s:
    cached like the planner's cost curves (provisional when measured on a
    busy machine, see edgespec.planner.cached_measurement)."""
    from ..planner import cached_measurement

    return cached_measurement(BANDWIDTH_FILE, f"{_cpuinfo()[0]}:{threads}", "bytes_per_s",
                              lambda: measure_bandwidth(threads),
                              lambda v: isinstance(v, (int, float)) and v > 0, remeasure=remeasure)


# ---------------------------------------------------------------------------
# int8 peak
# ---------------------------------------------------------------------------

INT8_PEAK_FILE = "int8-peak.json"


def measure_int8_peak(threads: int) -> float:
    """int8 multiply-accumulates per second with ``threads`` threads, each in
    the kernel set in use's tightest loop of its integer step (the C core's
    es_measure_int8_peak), the fastest of five passes."""
    from ..capi import check, ffi, lib

    params = ffi.new("es_int8_peak_params *", lib.es_int8_peak_default_params())
    params.n_threads = threads
    out = ffi.new("double *")
    check(lib.es_measure_int8_peak(params, out), "es_measure_int8_peak")
    return out[0]


def int8_peak(threads: int, *, remeasure: bool = False) -> tuple[float, str]:
    """(int8 MACs/s, kernel set) of this machine with ``threads`` threads and
    the kernel set EDGESPEC_KERNELS names (else the best): cached as
    ``bandwidth`` is."""
    from ..backends.native import select_kernels
    from ..capi import ffi, lib
    from ..planner import cached_measurement

    select_kernels()
    kernels = ffi.string(lib.es_kernels_name()).decode()
    peak = cached_measurement(INT8_PEAK_FILE, f"{_cpuinfo()[0]}:{threads}:{kernels}", "macs_per_s",
                              lambda: measure_int8_peak(threads),
                              lambda v: isinstance(v, (int, float)) and v > 0, remeasure=remeasure)
    return peak, kernels
