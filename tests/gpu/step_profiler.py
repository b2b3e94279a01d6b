"""The CUDA kernels of a window of steps, by device time: which kernels a
run spends its time in, and whether an allocator's memory makes any of
them slower (compare the same window under two allocators). Used by
trainers.py (`--profile-steps FIRST:LAST`) and sweep.py
(`GPUALLOC_SWEEP_PROFILE_ROUNDS=FIRST:LAST`)."""

from __future__ import annotations


class StepProfiler:
    """torch.profiler over steps [first, last) of a run, from a spec
    "FIRST:LAST" ("" or None: off, every call a no-op). Call begin() as a
    step starts and end() when it is over (synchronized); afterwards
    `kernels` holds the 40 largest by device time."""

    def __init__(self, spec):
        try:
            self.first, self.last = (int(x) for x in spec.split(":")) if spec else (-1, -1)
        except ValueError:
            raise ValueError(f"profile window {spec!r}: expected FIRST:LAST, two step numbers") from None
        self.step, self.prof, self.kernels = 0, None, None

    def begin(self):
        if self.step == self.first:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()

    def end(self):
        self.step += 1
        if self.prof is not None and self.step == self.last:
            self.prof.__exit__(None, None, None)
            rows = [(e.key, e.device_time_total, e.count) for e in self.prof.key_averages()]
            rows.sort(key=lambda r: -r[1])
            self.kernels = [{"name": k[:120], "device_us": round(t, 1), "count": n} for k, t, n in rows[:40]]
            self.prof = None
