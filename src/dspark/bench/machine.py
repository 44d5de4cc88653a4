"""The machine a benchmark ran on, and the peak resident memory of each timed call."""

from __future__ import annotations

import os
import platform
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(), "machine": platform.machine(), "python": sys.version.split()[0],
        "torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "cpu_model": _cpu_model(), "memory_gib": _mem_total_gib(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "device": device,
    }
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _cpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if m:
            return m.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return m.group(1).strip() if m else platform.processor() or None
    except OSError:
        return platform.processor() or None


def _mem_total_gib() -> float | None:
    try:
        kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        return round(kib / 2**20, 1)
    except (OSError, AttributeError):
        return None


class MemoryProbe:
    """Peak RSS per call: VmHWM after resetting it (Linux clear_refs), else the lifetime ru_maxrss."""

    def __init__(self) -> None:
        self.per_call = self._reset()
        self.method = ("VmHWM per call (reset via /proc/self/clear_refs)" if self.per_call
                       else "ru_maxrss (process lifetime high-water mark; not per call)")

    @staticmethod
    def _reset() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status_kib(field_name: str) -> int | None:
        try:
            m = re.search(rf"^{field_name}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)
            return int(m.group(1)) if m else None
        except OSError:
            return None

    def start(self) -> int:
        """Reset the high-water mark; returns the RSS (KiB) before the call."""
        if self.per_call:
            self._reset()
        return self._status_kib("VmRSS") or 0

    def peak(self) -> int:
        """High-water RSS (KiB) since ``start``."""
        hwm = self._status_kib("VmHWM") if self.per_call else None
        return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
