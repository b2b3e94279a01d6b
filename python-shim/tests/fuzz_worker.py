"""One case of the Python API fuzzer (``test_fuzz.py`` runs it in a subprocess).

Usage: ``python fuzz_worker.py SEED CALLS THREADS DIR``

Drives random calls of the package's public API (``gpualloc.*`` and the
``lib()`` wrappers) on the simulated backend, with valid, misused and absurd
arguments. After every call:

- an exception must be one of the documented kinds (:data:`ALLOWED`);
- ``check_invariants`` must pass on both simulated devices.

With one thread the bookkeeping is exact, so more is required: freeing a
live block succeeds, a double free or a free of an interior or unknown
pointer fails, and at the end (everything freed) no byte is allocated.
With several threads the same calls run concurrently (blocks are then freed
by other threads too, so only the general rules hold). The last line printed
is ``FUZZ OK``; a failure prints the last calls and exits with status 1.
"""

from __future__ import annotations

import os
import pathlib
import random
import sys
import threading
import traceback

os.environ["GPUALLOC_BACKEND"] = "sim"
os.environ["GPUALLOC_SIM_CAPACITY"] = "2GiB"
os.environ["GPUALLOC_SIM_DEVICES"] = "2"
os.environ.pop("GPUALLOC_CONF", None)
# PyTorch's settings may cap devices too (Note [PyTorch's settings under gpualloc]).
for _name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    os.environ.pop(_name, None)
os.environ.pop("GPUALLOC_TRACE", None)

import gpualloc  # noqa: E402
from gpualloc import GpuallocError  # noqa: E402
from gpualloc._lib import lib  # noqa: E402

ALLOWED = (GpuallocError, ValueError, TypeError)
MiB = 1 << 20


class Failure(Exception):
    pass


def sizes(r: random.Random):
    return r.choice(
        [
            0,
            1,
            r.randrange(1, 4097),
            r.randrange(1, 64 * MiB),
            r.randrange(1, 1 << 31),
            1 << r.randrange(64),
            (1 << 64) - 1,
            1 << 64,
            -1,
            -r.randrange(1 << 70),
            1.5,
            "4096",
            None,
            True,
        ]
    )


def devices(r: random.Random):
    return r.choice([0, 0, 0, 1, 1, -1, 2, 7, 1 << 31, (1 << 32), 1 << 40, -(1 << 40), "0", 1.0, None, True])


def public_devices(r: random.Random):
    """What the ``device=`` arguments of ``gpualloc.*`` may be given."""
    return r.choice([None, 0, 1, 2, -1, "cuda", "cuda:0", "cuda:1", "cuda:9", "cuda:x", "cuda:1:2", "gpu", "", "cpu", 1.5, [1], 1 << 40, True])


def streams(r: random.Random):
    return r.choice([0, 0, 1, 2, 3, None, -1, 1 << 64, (1 << 64) - 1, 1.5, "1"])


def unknown_pointers(r: random.Random):
    return r.choice([0, None, 1, 12345, -1, 1 << 64, (1 << 64) - 1, -(1 << 70), "x", b"x", 1.5, [1]])


def fractions(r: random.Random):
    return r.choice([1.0, 1.0, 0.5, r.random(), 1e-12, 0, 0.0, -1, 2, 1 << 70, 10**400, float("nan"), float("inf"), "0.5", None, True])


def limits(r: random.Random):
    return r.choice([None, None, 1, r.randrange(1, 4 << 30), 64 * MiB, 0, -1, 1 << 64, (1 << 64) - 1, 1.5, "1", True])


def names(r: random.Random):
    return r.choice(
        [
            "step",
            "",
            "épreuve ✓",
            "x" * 4096,
            "x" * 4097,
            "y" * 5000,
            "a\0b",
            "\0",
            b"bytes name",
            b"\xff\xfe not utf-8",
            b"nul\0",
            "\udcff surrogate",
            None,
            12,
            "z" * r.randrange(20000),
        ]
    )


def pools(r: random.Random):
    return r.choice(
        [
            (r.randrange(4), r.randrange(4)),
            (r.randrange(4), r.randrange(4)),
            (0, 0),
            [1, 2],
            (-1, 0),
            (1 << 64, 0),
            ((1 << 64) - 1, (1 << 64) - 1),
            (1,),
            (1, 2, 3),
            None,
            ("a", "b"),
            (1.0, 2),
        ]
    )


def paths(r: random.Random, d: str):
    return r.choice(
        [
            os.path.join(d, "t.gtrace"),
            os.path.join(d, "t-{pid}-{rank}.gtrace"),
            pathlib.Path(d) / "p.gtrace",
            os.fsencode(os.path.join(d, "b.gtrace")),
            os.path.join(d, "no", "such", "dir.gtrace"),
            d,
            "",
            os.path.join(d, "nul\0.gtrace"),
            os.fsencode(d) + b"/\xff.gtrace",
            d + "/\udcff.gtrace",
            "/proc/no-write.gtrace",
            None,
            3,
        ]
    )


class Case:
    def __init__(self, seed: int, calls: int, threads: int, d: str):
        self.seed, self.calls, self.threads, self.dir = seed, calls, threads, d
        self.exact = threads == 1
        self.lock = threading.Lock()
        self.live = {}  # address -> (size, device); exact mode only
        self.freed = set()
        self.log = []
        self.open_phases = []
        self.L = lib()

    # ---- checks ----

    def call(self, what: str, f, *args, **kw):
        """Runs one call; returns (ok, result). Undocumented exceptions fail the case."""
        with self.lock:
            self.log.append(f"{threading.current_thread().name}: {what}")
            del self.log[:-40]
        try:
            return True, f(*args, **kw)
        except ALLOWED as e:
            return False, e
        except Exception as e:  # noqa: BLE001
            raise Failure(f"{what} raised {type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc()}") from None

    def invariants(self, what: str):
        for d in (0, 1):
            try:
                self.L.check_invariants(d)
            except GpuallocError as e:
                raise Failure(f"after {what}: device {d}: {e}") from None

    def expect(self, cond: bool, what: str):
        if not cond:
            raise Failure(what)

    # ---- one random call ----

    def step(self, r: random.Random, mine: list):
        L = self.L
        op = r.randrange(32)
        if op < 6:  # malloc
            size, dev, stream = (r.randrange(1, 8 * MiB) if r.random() < 0.6 else sizes(r)), r.choice([0, 1]) if r.random() < 0.7 else devices(r), streams(r)
            what = f"lib().malloc({size!r}, {dev!r}, {stream!r})"
            ok, p = self.call(what, L.malloc, size, dev, stream)
            if ok and p:
                self.expect(isinstance(p, int) and p > 0, f"{what} returned {p!r}")
                if self.exact:
                    self.expect(p not in self.live, f"{what} returned the live address {p:#x}")
                    self.freed.discard(p)
                    self.live[p] = (size, dev)
                mine.append((p, dev))
            elif ok:
                self.expect(size == 0, f"{what} returned {p!r}")
            return what
        if op < 11:  # free a live block, maybe with another device argument
            if not mine:
                return "nothing to free"
            p, dev = mine.pop(r.randrange(len(mine)))
            arg = r.choice([dev, dev, -1, 1 - dev if dev in (0, 1) else 0])
            what = f"lib().free({p:#x}, {arg!r})"
            ok, e = self.call(what, L.free, p, arg)
            if self.exact:
                if arg in (dev, -1):
                    self.expect(ok, f"{what} of a live block failed: {e}")
                if ok:
                    del self.live[p]
                    self.freed.add(p)
                else:
                    mine.append((p, dev))
            return what
        if op == 11:  # double free, interior pointer, unknown pointer
            kind = r.randrange(3)
            if kind == 0 and self.freed:
                p = r.choice(sorted(self.freed - set(self.live))) if self.exact and self.freed - set(self.live) else None
                if p is None:
                    return "no freed block"
            elif kind == 1 and mine:
                p = mine[r.randrange(len(mine))][0] + r.choice([1, 512, 4096])
                if self.exact and p in self.live:
                    return "interior pointer is a block"
            else:
                p = unknown_pointers(r)
            dev = r.choice([0, 1, -1]) if r.random() < 0.8 else devices(r)
            what = f"lib().free({p!r}, {dev!r})"
            ok, e = self.call(what, L.free, p, dev)
            if self.exact and p not in (0, None):
                self.expect(not ok, f"{what} of no live block succeeded")
            return what
        if op == 12:  # record_stream
            p = mine[r.randrange(len(mine))][0] if mine and r.random() < 0.7 else unknown_pointers(r)
            s = streams(r)
            what = f"lib().record_stream({p!r}, {s!r})"
            self.call(what, L.record_stream, p, s)
            return what
        if op == 13:
            self.call("gpualloc.empty_cache()", gpualloc.empty_cache)
            return "gpualloc.empty_cache()"
        if op == 14:
            f, dev = fractions(r), public_devices(r) if r.random() < 0.3 else r.choice([0, 1])
            what = f"gpualloc.set_memory_fraction({f!r}, {dev!r})"
            self.call(what, gpualloc.set_memory_fraction, f, dev)
            return what
        if op == 15:
            n, dev = limits(r), public_devices(r) if r.random() < 0.3 else r.choice([0, 1])
            what = f"gpualloc.set_memory_limit({n!r}, {dev!r})"
            self.call(what, gpualloc.set_memory_limit, n, dev)
            return what
        if op == 16:
            dev = public_devices(r)
            fn = r.choice([gpualloc.stats, gpualloc.fragmentation, gpualloc.held, gpualloc.reset_peak_stats, gpualloc.reset_accumulated_stats, gpualloc.snapshot])
            what = f"gpualloc.{fn.__name__}({dev!r})"
            ok, v = self.call(what, fn, dev)
            if ok and fn is gpualloc.stats:
                self.expect(all(isinstance(x, int) for x in v.values()), f"{what}: non-int stats")
            if ok and fn is gpualloc.held:
                self.expect(all(isinstance(x, int) and x >= 0 for x in v.values()), f"{what} returned {v!r}")
            return what
        if op == 17:
            dev = public_devices(r)
            what = f"gpualloc.summary({dev!r})"
            ok, v = self.call(what, gpualloc.summary, dev, r.random() < 0.5)
            self.expect(not ok or isinstance(v, str), f"{what} returned {v!r}")
            return what
        if op == 18:
            fn = r.choice([gpualloc.last_oom, gpualloc.backend, gpualloc.version, gpualloc.is_tracing, gpualloc.installed, gpualloc.auto_marks, gpualloc.library_path])
            what = f"gpualloc.{fn.__name__}()"
            self.call(what, fn)
            return what
        if op == 19:
            d = r.choice([0, 1]) if r.random() < 0.7 else devices(r)
            fn = r.choice([L.mem_info, L.memory_fraction, L.stats_struct, L.snapshot])
            what = f"lib().{fn.__name__}({d!r})"
            self.call(what, fn, d)
            return what
        if op == 20:
            p = paths(r, self.dir)
            what = f"gpualloc.trace_start({p!r})"
            self.call(what, gpualloc.trace_start, p)
            return what
        if op == 21:
            fn = r.choice([gpualloc.trace_stop, gpualloc.trace_flush, gpualloc.trace_flush])
            what = f"gpualloc.{fn.__name__}()"
            ok, v = self.call(what, fn)
            if ok and fn is gpualloc.trace_stop:
                self.expect(set(v) == {"events", "dropped", "bytes"}, f"{what} returned {v!r}")
            return what
        if op in (22, 23):  # phases, unbalanced: exited out of order, twice, or never
            k = r.randrange(5)
            if k < 2:
                n = names(r)
                what = f"gpualloc.phase({n!r}).__enter__()"
                ok, ph = self.call(what, gpualloc.phase, n)
                if ok:
                    self.call(what, ph.__enter__)
                    with self.lock:
                        self.open_phases.append(ph)
                return what
            if k == 2:
                with self.lock:
                    ph = self.open_phases[r.randrange(len(self.open_phases))] if self.open_phases else gpualloc.phase("never entered")
                what = f"phase({ph.name[:20]!r}).__exit__()"
                self.call(what, ph.__exit__, None, None, None)
                return what
            if k == 3:
                n = names(r)
                what = f"lib().phase_push({n!r:.40})"
                self.call(what, L.phase_push, n)
                return what
            self.call("lib().phase_pop()", L.phase_pop)
            return "lib().phase_pop()"
        if op == 24:
            n = names(r)
            what = f"gpualloc.mark({n!r:.60})"
            self.call(what, gpualloc.mark, n)
            return what
        if op in (25, 26):  # pools through the wrappers
            pool, d = pools(r), r.choice([0, 1]) if r.random() < 0.8 else devices(r)
            fn = r.choice([L.create_or_incref_pool, L.pool_use_count, L.empty_pool_cache, L.pool_live_allocations])
            what = f"lib().{fn.__name__}({pool!r}, {d!r})"
            ok, v = self.call(what, fn, pool, d)
            if ok and fn is L.pool_live_allocations and self.exact:
                self.expect(all(a in self.live for a in v), f"{what} returned blocks that are not live: {v}")
            return what
        if op == 27:  # allocation scopes and holds (the C calls the tests use), so that pools get blocks
            a, b, d = r.randrange(4), r.randrange(4), r.choice([0, 1])
            fn = r.choice(["gpualloc_begin_allocate_to_pool", "gpualloc_end_allocate_to_pool", "gpualloc_release_pool"])
            what = f"{fn}({d}, {a}, {b})"
            args = (d, a, b, None, None) if fn.startswith("gpualloc_begin") else (d, a, b)
            self.call(what, lambda: L.check(getattr(L.dll, fn)(*args)))
            return what
        if op == 28:
            c = r.choice(["", "max_split_size_mb:64", "no_such_key:1", "a\0b", None, 5, b"\xff"])
            what = f"lib().init({c!r})"
            self.call(what, L.init, c)
            return what
        if op == 29:
            d = public_devices(r)
            what = f"gpualloc._device({d!r})"
            ok, v = self.call(what, gpualloc._device, d)
            self.expect(not ok or (isinstance(v, int) and -(1 << 31) <= v < (1 << 31)), f"{what} returned {v!r}")
            return what
        # a few valid calls in a row, to keep memory in use
        return self.step(r, mine) if r.random() < 0.5 else "pass"

    def run_thread(self, r: random.Random, n: int):
        mine = []
        for _ in range(n):
            what = self.step(r, mine)
            self.invariants(what)
        for p, dev in mine:
            ok, e = self.call(f"lib().free({p:#x}, -1) at the end", self.L.free, p, -1)
            if self.exact:
                self.expect(ok, f"final free of live {p:#x} (device {dev}) failed: {e}")
                del self.live[p]

    def run(self):
        errors = []
        if self.threads == 1:
            self.run_thread(random.Random(self.seed), self.calls)
        else:

            def body(i):
                try:
                    self.run_thread(random.Random(self.seed * 1000 + i), self.calls // self.threads)
                except Failure as e:
                    errors.append(str(e))
                except BaseException:  # noqa: BLE001
                    errors.append(traceback.format_exc())

            ts = [threading.Thread(target=body, args=(i,), name=f"t{i}") for i in range(self.threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errors:
                raise Failure("\n".join(errors))
        for ph in list(self.open_phases):
            self.call("phase exit at the end", ph.__exit__, None, None, None)
        self.call("trace_stop at the end", gpualloc.trace_stop)
        self.invariants("the end")
        if self.exact:
            for d in (0, 1):
                # Blocks of released private pools the fuzzer never allocated do not exist: everything was freed.
                n = gpualloc.stats(d)["allocated_bytes.all.current"]
                self.expect(n == 0, f"device {d}: {n} bytes still allocated after every block was freed")


def main():
    seed, calls, threads, d = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    case = Case(seed, calls, threads, d)
    try:
        case.run()
    except Failure as e:
        print("FAILED (seed %d, %d calls, %d threads): %s" % (seed, calls, threads, e))
        print("last calls:\n  " + "\n  ".join(case.log))
        sys.stdout.flush()
        os._exit(1)
    print("FUZZ OK")


if __name__ == "__main__":
    main()
