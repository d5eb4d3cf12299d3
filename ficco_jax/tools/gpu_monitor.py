"""What the GPUs ran at while a timing was taken: every GPU's SM clock, power draw, whether its power
limit held the clock down, and its temperature, sampled by `nvidia-smi` in a background thread.

Why the tools record it: under sustained matmuls an H100 SXM sits at its power limit (700 W), its SM
clock well below its maximum and dependent on what ran just before; a short run (a profiler's ten
calls) runs at higher clocks than a timing loop of many, and a program that moves data beside its
matmuls often at lower ones than the matmuls alone. So a time means little without the clock it ran at.

`start()` returns False, and every window is empty, where `nvidia-smi` is missing or fails (CPU
machines, GPUs of another vendor): the timings are then taken as before, without clocks.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Sequence

import numpy as np

#: The fields sampled, in `nvidia-smi --query-gpu` order; "capped": the software power cap is
#: holding the clock down ("Active"), the name of the field differs between drivers.
FIELDS = ("index", "power.draw", "clocks.sm", "{cap}", "temperature.gpu")
CAP_FIELDS = ("clocks_event_reasons.sw_power_cap", "clocks_throttle_reasons.sw_power_cap")
INTERVAL_MS = 50


def _query(cap: str) -> str:
    return ",".join(f.format(cap=cap) for f in FIELDS)


class GpuMonitor:
    """Samples `command` (default: nvidia-smi every INTERVAL_MS) until `stop()`; `window(spans)`
    summarises the samples taken inside given stretches of `time.monotonic()`."""

    def __init__(self, command: Sequence[str] | None = None):
        self._command = list(command) if command is not None else None
        self._samples: list[tuple[float, int, float, float, bool, float]] = []
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def _default_command(self) -> list[str] | None:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        for cap in CAP_FIELDS:  # the first cap field this driver knows: one query, then the same in a loop
            once = [smi, f"--query-gpu={_query(cap)}", "--format=csv,noheader,nounits"]
            probe = subprocess.run(once, capture_output=True, text=True, timeout=20)
            if probe.returncode == 0 and probe.stdout.strip():
                return once + [f"-lms={INTERVAL_MS}"]
        return None

    def start(self) -> bool:
        """Start sampling; False (and no samples, ever) where there is nothing to sample."""
        try:
            command = self._command or self._default_command()
            if command is None:
                return False
            self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (OSError, subprocess.SubprocessError):
            return False
        self._thread = threading.Thread(target=self._read, name="ficco-gpu-monitor", daemon=True)
        self._thread.start()
        return True

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse(line)
            if sample is not None:
                with self._lock:
                    self._samples.append((time.monotonic(), *sample))

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def window(self, spans: Sequence[tuple[float, float]]) -> dict | None:
        """{"sm_mhz", "power_w", "temp_c": per GPU index the mean over the samples taken inside any
        of `spans` ((start, end) `time.monotonic()` readings); "capped": the share of those samples
        the power cap held the clock down; "samples"}, or None when no sample fell inside (spans
        shorter than the interval, or nothing sampled)."""
        with self._lock:
            inside = [s for s in self._samples if any(t0 <= s[0] <= t1 for t0, t1 in spans)]
        if not inside:
            return None
        gpus = sorted({s[1] for s in inside})
        of = lambda i, k: [s[k] for s in inside if s[1] == i]  # noqa: E731
        return {"sm_mhz": {str(i): round(float(np.mean(of(i, 3)))) for i in gpus},
                "power_w": {str(i): round(float(np.mean(of(i, 2))), 1) for i in gpus},
                "temp_c": {str(i): round(float(np.mean(of(i, 5))), 1) for i in gpus},
                "capped": round(float(np.mean([s[4] for s in inside])), 2), "samples": len(inside)}


def parse(line: str):
    """(index, power W, SM MHz, capped, temperature C) of one nvidia-smi line, or None if it is not
    one (a header, "[N/A]", an error message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return int(parts[0]), float(parts[1]), float(parts[2]), parts[3] == "Active", float(parts[4])
    except ValueError:
        return None


def summary_line(windows: Sequence[dict]) -> str | None:
    """One line over the windows of a run: the SM clock's range of per-window means, the share of
    samples at the power cap and the temperatures; None without windows."""
    windows = [w for w in windows if w]
    if not windows:
        return None
    clocks = [c for w in windows for c in w["sm_mhz"].values()]
    temps = [t for w in windows for t in w["temp_c"].values()]
    samples = sum(w["samples"] for w in windows)
    capped = sum(w["capped"] * w["samples"] for w in windows) / samples
    return (f"GPUs while timed (nvidia-smi every {INTERVAL_MS} ms, {samples} samples): SM clock {min(clocks):.0f}-"
            f"{max(clocks):.0f} MHz (mean per timing and GPU), at the power cap in {capped * 100:.0f} % of samples, "
            f"{min(temps):.0f}-{max(temps):.0f} C")
