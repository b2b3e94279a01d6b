"""The CUDA kernels of a window of steps, by device time: which kernels a
run spends its time in, and whether an allocator's memory makes any of
them slower (compare the same window under two allocators). Used by
trainers.py (`--profile-steps FIRST:LAST`) and sweep.py
(`GPUALLOC_SWEEP_PROFILE_ROUNDS=FIRST:LAST`)."""

from __future__ import annotations


def parse_window(spec):
    """(first, last) of "FIRST:LAST" with 0 <= FIRST < LAST; None for ""
    or None; ValueError naming the spec otherwise."""
    if not spec:
        return None
    try:
        first, last = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"profile window {spec!r}: expected FIRST:LAST, two step numbers") from None
    if not 0 <= first < last:
        raise ValueError(f"profile window {spec!r}: expected 0 <= FIRST < LAST")
    return first, last


class StepProfiler:
    """torch.profiler over steps [first, last) of a run, from a spec
    "FIRST:LAST" ("" or None: off, every call a no-op). Call begin() as a
    step starts, end() when it is over (synchronized) and finish() after
    the last step, which closes a window the run was too short for;
    afterwards `kernels` holds the 40 largest by device time (full names)
    and `steps` the steps they cover."""

    def __init__(self, spec):
        self.first, self.last = parse_window(spec) or (-1, -1)
        self.step, self.prof, self.kernels, self.steps = 0, None, None, None

    def begin(self):
        if self.step == self.first:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()

    def end(self):
        self.step += 1
        if self.step == self.last:
            self.finish()

    def finish(self):
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        rows = [(e.key, e.device_time_total, e.count) for e in self.prof.key_averages()]
        rows.sort(key=lambda r: -r[1])
        self.kernels = [{"name": k, "device_us": round(t, 1), "count": n} for k, t, n in rows[:40]]
        self.steps = [self.first, self.step]
        self.prof = None
