"""How busy the host's CPUs were while timed steps ran (from the kernel's own counters),
and how fast the host runs Python.

Why a benchmark reports it: an ungraphed training step is issued by one Python thread,
and on a slow or busy host that thread, not the GPU, sets the pace. The same code has run
at 29.8 ms a step on one H200 host and 47 ms on another, while its CUDA-graphed twin ran
at 29.8 ms on both (docs/journal.md). Three figures, in cores
(1.0 = one CPU busy for the whole block), tell the causes apart:

  host_cpu_self   this process (all its threads). Near 1: the loop's thread alone. Well
                  above 1: other threads of the process ran too, and in Python they
                  take the GIL from the loop.
  host_cpu_all    every CPU of the machine, this process included: beyond host_cpu_self,
                  other processes (compile workers, another job) were running.
  host_cpu_steal  time the hypervisor gave this VM's CPUs to someone else.

A loop's thread is busy (self near 1) whether it issues work or waits for the GPU, so
these say nothing of how fast that thread is. python_speed_ns does: the time the host
takes for a fixed piece of pure Python, at one moment. It is a snapshot: on the lent
H200 hosts it jumps between two levels ~2x apart from one second to the next, in an
idle process too (docs/journal.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_PROC_STAT = Path("/proc/stat")


def machine_ticks(text: str) -> tuple[int, int]:
    """/proc/stat's text -> (busy, stolen) clock ticks of all CPUs since boot. Busy is
    everything but idle, iowait and steal (guest time is already inside user time)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[1:9])
            return user + nice + system + irq + softirq, steal
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def _read_machine() -> tuple[int, int] | None:
    try:
        return machine_ticks(_PROC_STAT.read_text())
    except (OSError, ValueError):
        return None  # not Linux, or a /proc this parser does not know


def _process_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _probe_call(a: int, key: int = 0) -> tuple[int, int]:
    return a, key


def python_speed_ns(iterations: int = 20_000, repeats: int = 15) -> float:
    """Nanoseconds an iteration of a fixed pure-Python loop takes on this host, best of
    `repeats`: a call with a keyword argument, a tuple, a dict store, the stuff of a kernel
    launch's host path, whose ~190 launches an ungraphed step issues one by one."""
    best = float("inf")
    for _ in range(repeats):
        table: dict[int, tuple[int, int]] = {}
        t0 = time.perf_counter()
        for i in range(iterations):
            table[i & 255] = _probe_call(i, key=i)
        best = min(best, time.perf_counter() - t0)
    return best / iterations * 1e9


class HostLoad:
    """`with HostLoad() as h: ...`; then `h.summary`: host_cpu_self, host_cpu_all and
    host_cpu_steal in cores over the block (the last two only where /proc/stat is
    readable), and host_cpus, the machine's CPU count."""

    def __init__(self):
        self.summary: dict | None = None

    def __enter__(self) -> HostLoad:
        self._machine = _read_machine()
        self._self = _process_seconds()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        if wall <= 0:
            return
        self.summary = {"host_cpu_self": (_process_seconds() - self._self) / wall,
                        "host_cpus": os.cpu_count()}
        end = _read_machine()
        if self._machine is not None and end is not None:
            ticks = wall * os.sysconf("SC_CLK_TCK")
            self.summary["host_cpu_all"] = (end[0] - self._machine[0]) / ticks
            self.summary["host_cpu_steal"] = (end[1] - self._machine[1]) / ticks
