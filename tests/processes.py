"""Test helper: a Python script run as a process of its own and killed (-9)
at a chosen moment (a training or distillation that must resume)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time


def killed_when(script: str, ready, *args) -> None:
    """Run ``script`` (Python) with ``args`` and kill it (-9) once ``ready()`` holds."""
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)])
    try:
        while not ready():
            assert proc.poll() is None, "it ended before it was killed"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
