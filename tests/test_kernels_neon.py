"""The NEON kernel set on an x86 machine: csrc/tests/test_quants.c cross-built
for aarch64 (with and without the dot-product extension) and run under
qemu's user-mode emulator. It checks every weight type's NEON kernels
against the scalar ones and float64, es_matmat's batched kernels bit for bit
against es_matvec for 1 to 17 tokens, and the extreme-value sums, so the
path Arm laptops take is tested on every CI run, not only on Arm hardware.

Needs gcc-aarch64-linux-gnu and qemu-user-static (Debian; .ci/run installs
them). Where they are missing the test skips, unless
EDGESPEC_REQUIRE_NEON=1 (set by CI), where it fails. On an aarch64 machine
the C tests run natively instead (ctest)."""
from __future__ import annotations

import os
import pathlib
import platform
import shutil
import subprocess

import pytest

import edgespec

ROOT = pathlib.Path(__file__).resolve().parent.parent
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64-static"


def _missing() -> str | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"cross-testing runs on x86-64 (this is {platform.machine()})"
    absent = [tool for tool in (CC, QEMU) if not shutil.which(tool)]
    return f"{', '.join(absent)} not installed" if absent else None


@pytest.mark.parametrize("march", ["armv8-a", "armv8.2-a+dotprod"])
def test_neon_kernels_under_qemu(tmp_path, march):
    why = _missing()
    if why:
        if os.environ.get("EDGESPEC_REQUIRE_NEON") == "1":
            pytest.fail(f"EDGESPEC_REQUIRE_NEON=1 but {why}")
        pytest.skip(why)
    sources = [ROOT / "csrc/tests/test_quants.c", ROOT / "csrc/base.c",
               *sorted((ROOT / "csrc/native").rglob("*.c")), *sorted((ROOT / "csrc/speculative").glob("*.c"))]
    exe = tmp_path / "test_quants"
    subprocess.run([CC, "-static", "-O2", "-std=gnu11", f"-march={march}", f'-DES_VERSION="{edgespec.__version__}"',
                    f"-I{ROOT / 'csrc'}",
                    f"-I{ROOT / 'csrc/tests'}", *map(str, sources), "-lm", "-lpthread", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([QEMU, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "kernels: neon" in run.stdout
    assert "all checks passed" in run.stdout
