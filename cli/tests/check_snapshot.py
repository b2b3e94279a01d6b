"""Checks a snapshot pickle the way PyTorch's memory_viz reads it.

Usage: python3 check_snapshot.py FILE.pickle
Exits non-zero with a message on the first violation.
"""
import pickle
import pickletools
import sys

# Opcodes MemoryViz.js's hand-written reader understands (protocol 2-4).
ALLOWED = {
    "PROTO", "FRAME", "MARK", "STOP", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE",
    "DICT", "LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "SETITEM", "SETITEMS",
    "APPEND", "APPENDS", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "NEWTRUE", "NEWFALSE", "NONE", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE",
    "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
}


def add_range(ranges, lo, hi):
    """Adds [lo, hi) to a sorted list of disjoint ranges, merging neighbours."""
    out = []
    for a, b in ranges:
        if b < lo or a > hi:
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    out.append((lo, hi))
    return sorted(out)


def remove_range(ranges, lo, hi):
    out = []
    for a, b in ranges:
        if b <= lo or a >= hi:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo))
        if b > hi:
            out.append((hi, b))
    return out


def fail(msg):
    print("snapshot check failed: " + msg, file=sys.stderr)
    sys.exit(1)


def main(path):
    data = open(path, "rb").read()
    for op, arg, pos in pickletools.genops(data):
        if op.name not in ALLOWED:
            fail(f"opcode {op.name} at byte {pos} is not read by MemoryViz.js")
        if op.name == "PROTO" and not 2 <= arg <= 4:
            fail(f"protocol {arg}: MemoryViz.js reads 2 to 4")
        if op.name == "LONG1" and not -(2**63) <= arg < 2**63:
            fail(f"integer {arg} at byte {pos} does not fit 63 bits")
    snap = pickle.loads(data)
    if not isinstance(snap, dict) or "segments" not in snap or "device_traces" not in snap:
        fail("top level must be a dict with segments and device_traces")
    for seg in snap["segments"]:
        for key in ("device", "address", "total_size", "stream", "blocks", "allocated_size"):
            if key not in seg:
                fail(f"segment without {key}: {seg}")
        total = sum(b["size"] for b in seg["blocks"])
        if total != seg["total_size"]:
            fail(f"blocks of segment {seg['address']:#x} sum to {total}, not {seg['total_size']}")
        addr = seg["address"]
        for b in seg["blocks"]:
            if b.get("address", addr) != addr:
                fail(f"block at {b['address']:#x} does not follow the previous one ({addr:#x})")
            if b["state"] not in ("active_allocated", "active_pending_free", "inactive"):
                fail(f"unknown block state {b['state']}")
            addr += b["size"]
        alloc = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        if alloc != seg["allocated_size"]:
            fail(f"allocated_size {seg['allocated_size']} != {alloc}")
    for dev, trace in enumerate(snap["device_traces"]):
        check_device(snap, dev, trace)
    print(f"ok: {len(snap['segments'])} segments, {sum(map(len, snap['device_traces']))} events")


def check_device(snap, dev, trace):
    # Final state, as MemoryViz builds it.
    segs = {}
    expandable = {}
    blocks = {}
    for seg in snap["segments"]:
        if seg["device"] != dev:
            continue
        segs[seg["address"]] = seg["total_size"]
        expandable[seg["address"]] = bool(seg.get("is_expandable"))
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                blocks[addr] = {"size": b["size"], "pending": b["state"] == "active_pending_free"}
            addr += b["size"]
    # Forward: from nothing, the trace must lead exactly to the final state.
    fsegs, fblocks, mapped = {}, {}, []
    # The most bytes MemoryViz shows as segments at once: with each page
    # listed once, never more than the memory reserved.
    most = 0
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            fblocks[e["addr"]] = False
        elif a == "free_requested":
            if e["addr"] not in fblocks:
                fail(f"device {dev} event {i}: free_requested of unknown block {e['addr']:#x}")
            fblocks[e["addr"]] = True
        elif a == "free_completed":
            if fblocks.pop(e["addr"], None) is None:
                fail(f"device {dev} event {i}: free_completed of unknown block {e['addr']:#x}")
        elif a == "segment_alloc":
            fsegs[e["addr"]] = e["size"]
        elif a == "segment_free":
            if fsegs.pop(e["addr"], None) != e["size"]:
                fail(f"device {dev} event {i}: segment_free of unknown segment {e['addr']:#x}")
        elif a == "oom":
            if "device_free" not in e:
                fail(f"device {dev} event {i}: oom without device_free")
        elif a == "segment_map":
            if any(lo < e["addr"] + e["size"] and e["addr"] < hi for lo, hi in mapped):
                fail(f"device {dev} event {i}: segment_map of memory already mapped {e['addr']:#x}")
            mapped = add_range(mapped, e["addr"], e["addr"] + e["size"])
        elif a == "segment_unmap":
            if not any(lo <= e["addr"] and e["addr"] + e["size"] <= hi for lo, hi in mapped):
                fail(f"device {dev} event {i}: segment_unmap of unmapped memory {e['addr']:#x}")
            mapped = remove_range(mapped, e["addr"], e["addr"] + e["size"])
        else:
            fail(f"device {dev} event {i}: action {a} is not one memory_viz knows")
        if a.startswith("segment_"):
            most = max(most, sum(fsegs.values()) + sum(hi - lo for lo, hi in mapped))
        if a in ("alloc", "free_requested", "free_completed"):
            in_seg = any(s <= e["addr"] < s + n for s, n in fsegs.items())
            in_map = any(lo <= e["addr"] < hi for lo, hi in mapped)
            if not (in_seg or in_map):
                fail(f"device {dev} event {i}: block {e['addr']:#x} lies in no segment")
    final_plain = {a: n for a, n in segs.items() if not expandable.get(a)}
    final_mapped = []
    for a, n in segs.items():
        if expandable.get(a):
            final_mapped = add_range(final_mapped, a, a + n)
    if fsegs != final_plain:
        fail(f"device {dev}: segments after the trace {sorted(fsegs)} != final segments {sorted(final_plain)}")
    if mapped != final_mapped:
        fail(f"device {dev}: mapped ranges after the trace ({len(mapped)}) != final expandable segments ({len(final_mapped)})")
    final_live = {a: b["pending"] for a, b in blocks.items()}
    if fblocks != final_live:
        fail(f"device {dev}: live blocks after the trace differ from the final state "
             f"({len(fblocks)} vs {len(final_live)})")
    # Backward, as the Allocator State History view does: no unknown block.
    live = dict(blocks)
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        a = e["action"]
        if a == "free_requested":
            if e["addr"] not in live:
                fail(f"device {dev} event {i}: undoing free_requested of unknown block {e['addr']:#x}")
            live[e["addr"]]["pending"] = False
        elif a == "free_completed":
            live[e["addr"]] = {"size": e["size"], "pending": True}
        elif a == "alloc":
            live.pop(e["addr"], None)
    if live:
        fail(f"device {dev}: {len(live)} blocks exist before the first event")
    print(f"device {dev}: at most {most} bytes in segments")


if __name__ == "__main__":
    main(sys.argv[1])
