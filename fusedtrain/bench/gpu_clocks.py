"""The GPU's SM clock and power draw while timed steps run, sampled by `nvidia-smi` in a
process of its own (so the sampling takes no time from the Python loop it watches).

Why a benchmark reports them: an H200 training step at full speed hits the board's power
limit, and the driver then lowers the SM clock. A faster step draws more power, so two
variants timed one after the other may run at different clocks (1605-1740 MHz for the
fused step against 1755-1830 for torch.compile's, on one H200). The clock next to each
figure says how much of a difference is the kernels' and how much the clock's.
"""

from __future__ import annotations

import select
import shutil
import statistics
import subprocess

import torch

# Newest field names first; older drivers know only the plain ones.
_QUERIES = (("clocks.sm", "power.draw.instant", "clocks_event_reasons.sw_power_cap"),
            ("clocks.sm", "power.draw"))
_FIRST_SAMPLE_S = 10


def parse_samples(lines: list[str]) -> dict | None:
    """nvidia-smi CSV lines (no header, no units: "1755, 652.31, Active") -> the median
    and lowest SM clock (MHz), the median power (W) and, where reported, the share of
    samples with the software power cap holding the clock down; None without a sample."""
    clocks, watts, capped = [], [], []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            clocks.append(float(fields[0]))
            watts.append(float(fields[1]))
        except (IndexError, ValueError):
            continue  # an error message, or "[N/A]"
        if len(fields) > 2:
            capped.append(fields[2] == "Active")
    if not clocks:
        return None
    out = {"sm_clock_mhz_median": statistics.median(clocks), "sm_clock_mhz_min": min(clocks),
           "power_w_median": statistics.median(watts), "clock_samples": len(clocks)}
    if capped:
        out["power_capped_share"] = sum(capped) / len(capped)
    return out


def _device_id(device: int) -> str:
    """The id nvidia-smi -i takes for torch's CUDA device `device`: its UUID where torch
    gives one (right whatever CUDA_VISIBLE_DEVICES says), else its index."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return str(device)
    uuid = str(uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class ClockSampler:
    """`with ClockSampler(device) as s: ...` samples every `interval_ms` from the block's
    start (it waits for the first sample) to its end; `s.summary` is then parse_samples'
    dict, or None where there is no GPU, no nvidia-smi or no sample."""

    def __init__(self, device: int | None = None, interval_ms: int = 25):
        self.device, self.interval_ms = device, interval_ms
        self.summary: dict | None = None
        self._proc: subprocess.Popen | None = None
        self._first: list[str] = []

    def _start(self, fields: tuple[str, ...]) -> bool:
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", _device_id(self.device), f"--query-gpu={','.join(fields)}",
             "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # A first sample within seconds, or none: a hung nvidia-smi must not hang the run.
        ready, _, _ = select.select([self._proc.stdout], [], [], _FIRST_SAMPLE_S)
        first = self._proc.stdout.readline() if ready else ""
        if parse_samples([first]) is None:  # a field this driver does not know, or no GPU
            self._stop()
            return False
        self._first = [first]
        return True

    def _stop(self) -> list[str]:
        self._proc.terminate()
        try:
            rest, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # deaf to SIGTERM: its samples are not worth a hang
            self._proc.kill()
            self._proc.wait()
            rest = ""
        self._proc = None
        return rest.splitlines()

    def __enter__(self) -> ClockSampler:
        if torch.cuda.is_available() and shutil.which("nvidia-smi"):
            if self.device is None:
                self.device = torch.cuda.current_device()
            for fields in _QUERIES:
                if self._start(fields):
                    break
        return self

    def __exit__(self, *exc) -> bool:
        if self._proc is not None:
            self.summary = parse_samples(self._first + self._stop())
        return False
