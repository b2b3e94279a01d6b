"""The Python and C++ lists of stats against the one table.

The table lives in allocator/src/stats.rs (Note [One table for stats]);
docs/stats.md is its rendering, kept current by a Rust test, so this reads
the Markdown. Checked here:

- the ctypes ``Stats``, ``StatArray`` and ``Stat`` against the header the
  package ships (names, order, types, size) and the header's version;
- the table's stats against ``Stats`` (each stat with a C version is a field
  of the right kind) and ``STAT_ARRAYS``;
- the keys: the table flattened, the keys the library reports and the
  ``Stats`` struct flattened are the same list, with the same values;
- what the two resets do, through the library, against the table's columns;
- bridge.cpp's ``getDeviceStats`` copies every stat torch's ``DeviceStats``
  has (column torch = yes), and nothing else;
- where torch's headers are installed, the torch column against torch's own
  ``struct DeviceStats``.
"""

from __future__ import annotations

import ctypes
import os
import re
import unittest

from . import __name__ as _env  # noqa: F401  (sets the simulated environment first)

from gpualloc._lib import STAT_ARRAYS, STATS_VERSION, Stat, StatArray, Stats, lib

from .test_torch_compat import class_body, torch_include_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = os.path.join(ROOT, "docs", "stats.md")
HEADER = os.path.join(ROOT, "python-shim", "gpualloc", "include", "gpualloc.h")
BRIDGE = os.path.join(ROOT, "python-shim", "gpualloc", "bridge.cpp")

POOLS = ("all", "small_pool", "large_pool")
FIELDS = ("current", "peak", "allocated", "freed")
MiB = 1 << 20


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def table_rows(text: str) -> list[dict]:
    """The rows of docs/stats.md: name, kind, reset_peak, reset_accumulated, torch, c."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"\|\s*`(\w+)`\s*\|(.*)\|\s*$", line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        kind, peak, acc, torch, c = cells[:5]
        rows.append(
            {
                "name": m.group(1),
                "kind": kind,
                "reset_peak": peak == "peak",
                "reset_accumulated": acc != "-",
                "torch": torch,
                "c": 0 if c == "-" else int(c.lstrip("v")),
            }
        )
    return rows


def keys_of(name: str, kind: str) -> list[str]:
    if kind == "array":
        return [f"{name}.{p}.{f}" for p in POOLS for f in FIELDS]
    if kind == "gauge":
        return [f"{name}.{f}" for f in FIELDS]
    return [name]


def c_struct(header: str, name: str) -> list[tuple[str, str]]:
    """``(type, field)`` of ``typedef struct NAME { ... } NAME;`` in the header."""
    m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (name, name), header, re.S)
    if m is None:
        raise AssertionError(f"{name} not in the header")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return [(t.strip(), n) for t, n in re.findall(r"([\w ]+?)\s+(\w+);", body)]


C_TYPES = {
    "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "double": ctypes.c_double,
    "struct GpuallocStat": Stat,
    "struct GpuallocStatArray": StatArray,
}
KIND_TYPES = {"array": StatArray, "gauge": Stat, "counter": ctypes.c_int64, "setting": ctypes.c_int64}


def flatten(s: Stats, rows: list[dict]) -> dict:
    """The flat keys of the struct's stats, with their values."""
    out = {}
    for r in rows:
        v = getattr(s, r["name"])
        if r["kind"] == "array":
            for p in POOLS:
                for f in FIELDS:
                    out[f"{r['name']}.{p}.{f}"] = getattr(getattr(v, p), f)
        elif r["kind"] == "gauge":
            for f in FIELDS:
                out[f"{r['name']}.{f}"] = getattr(v, f)
        else:
            out[r["name"]] = v
    return out


def device_stats_body(src: str) -> str:
    """The body of the bridge's getDeviceStats override."""
    m = re.search(r"getDeviceStats\([^)]*\)\s*override\s*\{", src)
    if m is None:
        raise AssertionError("no getDeviceStats override in bridge.cpp")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return re.sub(r"//[^\n]*", "", src[m.end() : i - 1])


# Where torch declares DeviceStats, newest first (c10/core from torch 2.8 on).
TORCH_STATS_HEADERS = ("c10/core/CachingDeviceAllocator.h", "c10/cuda/CUDACachingAllocator.h")


def torch_device_stats_fields(src: str) -> set[str]:
    """The field names of ``struct DeviceStats`` in a torch header."""
    body = re.sub(r"//[^\n]*", "", class_body(src, "DeviceStats"))
    return set(re.findall(r"^\s*(?:StatArray|Stat|int64_t)\s+(\w+)\b", body, re.M))


def bridge_problems(src: str, rows: list[dict]) -> list[str]:
    """What getDeviceStats gets wrong against the table (empty: nothing)."""
    body = device_stats_body(src)
    copied = set(re.findall(r"\bs\.(\w+)", body))
    filled = set(re.findall(r"\bout\.(\w+)", body))
    problems = []
    for r in rows:
        if r["torch"] == "yes":
            if r["name"] not in filled:
                problems.append(f"torch's DeviceStats.{r['name']} is not filled")
            if r["name"] not in copied:
                problems.append(f"GpuallocStats.{r['name']} is not read")
    known = {r["name"] for r in rows if r["torch"] == "yes"}
    for name in sorted(copied - known - {"size"}):
        problems.append(f"s.{name} is read but the table says torch's DeviceStats lacks it")
    return problems


class StatsTableTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rows = table_rows(read(TABLE))
        cls.header = read(HEADER)

    def test_the_table_is_read(self):
        names = [r["name"] for r in self.rows]
        self.assertIn("allocated_bytes", names)
        self.assertIn("max_split_size", names)
        self.assertEqual(len(names), len(set(names)))
        self.assertEqual({r["kind"] for r in self.rows}, set(KIND_TYPES))

    def test_ctypes_structs_match_the_header(self):
        for cls, cname in ((Stats, "GpuallocStats"), (StatArray, "GpuallocStatArray"), (Stat, "GpuallocStat")):
            want = [(n, C_TYPES[t]) for t, n in c_struct(self.header, cname)]
            self.assertEqual(list(cls._fields_), want, f"{cls.__name__} against {cname}")
        m = re.search(r"#define GPUALLOC_STATS_VERSION (\d+)", self.header)
        self.assertEqual(STATS_VERSION, int(m.group(1)))

    def test_every_stat_with_a_c_version_is_a_field_of_its_kind(self):
        fields = dict(Stats._fields_)
        for r in self.rows:
            if r["c"]:
                self.assertIs(fields.get(r["name"]), KIND_TYPES[r["kind"]], r["name"])
                self.assertLessEqual(r["c"], STATS_VERSION, r["name"])
            else:
                self.assertNotIn(r["name"], fields)
        self.assertEqual(STAT_ARRAYS, tuple(r["name"] for r in self.rows if r["kind"] == "array"))

    def test_keys_are_the_table_the_library_and_the_struct(self):
        from_table = sorted(k for r in self.rows for k in keys_of(r["name"], r["kind"]))
        self.assertEqual(list(lib().stat_names), from_table, "gpualloc_stat_name against docs/stats.md")
        in_c = [r for r in self.rows if r["c"]]
        self.assertEqual(sorted(flatten(Stats(), in_c)), from_table, "every stat is in GpuallocStats")

    def test_struct_and_flat_values_agree(self):
        p = lib().malloc(5 * MiB, 1, 3)
        q = lib().malloc(4000, 1, 3)
        lib().free(q, 1)
        try:
            s = lib().stats_struct(1)
            self.assertEqual(s.size, ctypes.sizeof(Stats))
            flat = lib().stats(1)
            self.assertEqual(flatten(s, self.rows), flat)
            self.assertGreater(flat["allocation.all.allocated"], 0)
            self.assertGreater(s.num_driver_memory_calls, 0)
        finally:
            lib().free(p, 1)

    def test_resets_do_what_the_table_says(self):
        p = lib().malloc(9 * MiB, 1, 0)
        lib().free(p, 1)
        before = lib().stats(1)
        lib().reset_peak_stats(1)
        after = lib().stats(1)
        for r in self.rows:
            for k in keys_of(r["name"], r["kind"]):
                if r["reset_peak"] and k.endswith(".peak"):
                    self.assertEqual(after[k], after[k[: -len("peak")] + "current"], k)
                else:
                    self.assertEqual(after[k], before[k], k)
        p = lib().malloc(9 * MiB, 1, 0)
        lib().free(p, 1)
        before = lib().stats(1)
        lib().reset_accumulated_stats(1)
        after = lib().stats(1)
        self.assertGreater(before["allocation.all.allocated"], 0)
        for r in self.rows:
            for k in keys_of(r["name"], r["kind"]):
                total = r["kind"] in ("counter", "setting") or k.endswith((".allocated", ".freed"))
                want = 0 if r["reset_accumulated"] and total else before[k]
                self.assertEqual(after[k], want, k)

    def test_bridge_fills_every_field_torch_has(self):
        self.assertEqual(bridge_problems(read(BRIDGE), self.rows), [])

    def test_a_drifted_bridge_is_caught(self):
        src = read(BRIDGE)
        line = "    out.num_device_free = s.num_device_free;\n"
        self.assertIn(line, src)
        self.assertEqual(
            bridge_problems(src.replace(line, ""), self.rows),
            ["torch's DeviceStats.num_device_free is not filled", "GpuallocStats.num_device_free is not read"],
        )
        extra = src.replace(line, line + "    out.num_device_free += s.num_stitch;\n")
        self.assertEqual(
            bridge_problems(extra, self.rows),
            ["s.num_stitch is read but the table says torch's DeviceStats lacks it"],
        )

    def test_torch_column_against_the_installed_torch(self):
        inc = torch_include_dir()
        headers = [os.path.join(inc, h) for h in TORCH_STATS_HEADERS] if inc else []
        found = [h for h in headers if "struct DeviceStats" in (read(h) if os.path.isfile(h) else "")]
        if not found:
            print("\nSKIPPED: no torch headers (install torch or set GPUALLOC_TORCH_INCLUDE)", flush=True)
            self.skipTest("no torch headers")
        fields = torch_device_stats_fields(read(found[0]))
        self.assertIn("allocated_bytes", fields)
        table = {r["name"]: r["torch"] for r in self.rows}
        self.assertEqual(sorted(f for f in fields if table.get(f) not in ("yes", "newer")), [], f"fields of {found[0]} the table lacks")
        self.assertEqual(sorted(n for n, t in table.items() if t == "yes" and n not in fields), [], f"not in {found[0]}")

    def test_the_torch_parser_reads_device_stats(self):
        src = (
            "struct DeviceStats {\n  // COUNT: allocations\n  StatArray allocation;\n  Stat oversize_segments;\n"
            "  int64_t num_ooms = 0;\n  // int64_t gone = 0;\n  int64_t max_split_size = 0;\n};\n"
            "struct Other {\n  int64_t not_this;\n};"
        )
        self.assertEqual(torch_device_stats_fields(src), {"allocation", "oversize_segments", "num_ooms", "max_split_size"})

    def test_a_drifted_struct_is_caught(self):
        header = self.header.replace("  int64_t num_stitch;\n", "", 1)
        want = [(n, C_TYPES[t]) for t, n in c_struct(header, "GpuallocStats")]
        self.assertNotEqual(list(Stats._fields_), want)


if __name__ == "__main__":
    unittest.main()
