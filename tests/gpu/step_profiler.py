"""The CUDA kernels of a window of steps, by device time, and its host-side
operators, by their own host time: where a run spends its time, and
whether an allocator makes any of it slower (compare the same window under
two allocators). Used by
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
    afterwards `kernels` holds the 40 largest kernels by device time (full
    names), `host_ops` the 40 operators with the most host time of their
    own (where a host-bound loop's time goes), and `steps` the steps they
    cover."""

    def __init__(self, spec):
        self.first, self.last = parse_window(spec) or (-1, -1)
        self.step, self.prof, self.kernels, self.host_ops, self.steps = 0, None, None, None, None

    def begin(self):
        if self.step == self.first:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def end(self):
        self.step += 1
        if self.step == self.last:
            self.finish()

    def finish(self):
        if self.prof is None:
            return
        from torch.autograd import DeviceType

        self.prof.__exit__(None, None, None)
        avgs = list(self.prof.key_averages())
        on_host = [e for e in avgs if getattr(e, "device_type", None) == DeviceType.CPU]
        on_gpu = [e for e in avgs if getattr(e, "device_type", None) != DeviceType.CPU]
        on_gpu.sort(key=lambda e: -e.device_time_total)
        on_host.sort(key=lambda e: -e.self_cpu_time_total)
        self.kernels = [{"name": e.key, "device_us": round(e.device_time_total, 1), "count": e.count} for e in on_gpu[:40]]
        self.host_ops = [{"name": e.key, "self_cpu_us": round(e.self_cpu_time_total, 1), "count": e.count}
                         for e in on_host[:40]]
        self.steps = [self.first, self.step]
        self.prof = None

    def report(self):
        """What the window found, for a run's result: {"profiled_steps",
        "kernels", "host_ops"}; empty when nothing was profiled."""
        if self.kernels is None:
            return {}
        return {"profiled_steps": self.steps, "kernels": self.kernels, "host_ops": self.host_ops}
