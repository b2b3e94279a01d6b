"""Reads the phases and marks of a ``.gtrace`` file without the ``gpualloc`` command.

``annotations(path)`` returns, per record in file order, a dict with
``device``, ``time_ns`` (since the trace start), ``kind`` (``phase_push``,
``phase_pop`` or ``mark``) and ``name``. It decodes every record (their
fields are delta-encoded), but keeps only these three kinds; ``records(path)``
keeps them all. ``decode`` names a record's fields by action, the one place
that reads them by position; the byte layout is docs/trace-format.md's. A damaged or truncated file is a ``ValueError``
naming the offset. Pure Python: about 200k events a second, for tests and
short runs; the ``gpualloc`` command reads long traces.
"""

from __future__ import annotations

import struct
import zlib
from typing import Dict, List, Tuple

MAGIC = b"\x89GATRACE"
EVENTS, STRINGS, END = 1, 2, 4  # block kinds (docs/trace-format.md)
# Action codes in order, with PyTorch's names (``Action`` in allocator/src/trace/event.rs).
ACTIONS = (
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "empty_cache", "phase_push", "phase_pop",
    "mark", "record_stream", "stream_reuse", "sync_all_streams", "free",
    "pages_create", "pages_release", "private_pool", "memory_limit",
)
# The calls a ``private_pool`` record names (its ``size``; ``PoolOp`` in event.rs).
POOL_OPS = ("begin_allocate_to_pool", "end_allocate_to_pool", "create_or_incref_pool", "release_pool",
            "empty_pool_cache", "get_checkpoint_state", "set_checkpoint_pool_state")
KINDS = {9: "phase_push", 10: "phase_pop", 11: "mark"}
FREE = 15  # alloc, free_requested, free_completed (0-2) and free store aux against size
STITCH_CODE = 2**64 - 1  # the pool code of a stitched range (Note [Stitching])
U64 = 2**64 - 1  # addresses and block sizes wrap as the Rust reader's do


def decode(action: int, stream: int, addr: int, size: int, aux: int) -> Dict:
    """The named fields of one record: the one place this module reads ``size``
    and ``aux`` by action, as ``TraceEvent::kind`` does in Rust
    (allocator/src/trace/event.rs; the table in docs/trace-format.md).

    Returns a dict with ``kind`` (the action's name) and that action's fields:
    ``addr``, ``requested``, ``block_size`` (alloc, free_requested,
    free_completed, free); ``addr``, ``size``, ``pool`` (segment events: a pool
    code, or ``"stitch"`` for ``STITCH_CODE``); ``requested``, ``device_free``
    (oom); ``released`` (empty_cache); ``name`` (a string id: phase_push,
    phase_pop, mark); ``addr``, ``other_stream`` (record_stream); ``addr``,
    ``block_size``, ``from_stream`` (stream_reuse); ``outstanding``
    (sync_all_streams); ``bytes`` (pages_create, pages_release); ``op`` (the
    call's name, ``"#<code>"`` for an unknown one), ``pool`` (the pool's
    index on the device) and ``checkpoint`` (a checkpoint's number, for
    the checkpoint calls) (private_pool); ``fraction`` (of device memory,
    1.0 for none) or ``bytes`` (None for none), the cap set, and
    ``device_total`` (the device's memory as the allocator read it, 0 if
    not known) (memory_limit). An unknown code gives ``kind``
    ``"#<code>"`` and the raw fields; a cap this reader does not know gives
    ``memory_limit`` and the raw fields.
    """
    kind = ACTIONS[action] if action < len(ACTIONS) else f"#{action}"
    if action <= 2 or action == FREE:
        return {"kind": kind, "addr": addr, "requested": size, "block_size": aux}
    if 3 <= action <= 6:
        return {"kind": kind, "addr": addr, "size": size, "pool": "stitch" if aux == STITCH_CODE else aux}
    if action == 7:
        return {"kind": kind, "requested": size, "device_free": aux}
    if action == 8:
        return {"kind": kind, "released": size}
    if action in KINDS:
        return {"kind": kind, "name": aux}
    if action == 12:
        return {"kind": kind, "addr": addr, "other_stream": stream}
    if action == 13:
        return {"kind": kind, "addr": addr, "block_size": size, "from_stream": aux}
    if action == 14:
        return {"kind": kind, "outstanding": size}
    if action in (16, 17):
        return {"kind": kind, "bytes": size}
    if action == 18:
        op = POOL_OPS[size] if size < len(POOL_OPS) else f"#{size}"
        return {"kind": kind, "op": op, "pool": aux, "checkpoint": addr}
    if action == 19 and size == 0:
        fraction = struct.unpack("<d", struct.pack("<Q", aux & U64))[0]
        return {"kind": kind, "fraction": fraction, "device_total": addr}
    if action == 19 and size == 1:
        return {"kind": kind, "bytes": None if aux == U64 else aux, "device_total": addr}
    return {"kind": kind, "stream": stream, "addr": addr, "size": size, "aux": aux}


def _varint(buf: bytes, i: int) -> Tuple[int, int]:
    """An unsigned LEB128 of at most 64 bits (10 bytes), as ``get_varint`` in
    format.rs: a longer one is an error, not a big integer built bit by bit
    (quadratic in its length)."""
    v, shift, start = 0, 0, i
    while True:
        if i >= len(buf):
            raise ValueError(f"a varint at byte {start} of the payload runs past its end")
        b = buf[i]
        i += 1
        if shift == 63 and b > 1:
            raise ValueError(f"the varint at byte {start} of the payload exceeds 64 bits")
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, i
        shift += 7


def _zigzag(buf: bytes, i: int) -> Tuple[int, int]:
    v, i = _varint(buf, i)
    return (v >> 1) ^ -(v & 1), i


def annotations(path: str) -> List[Dict]:
    strings, recs = _read(path, KINDS)
    return [
        {"device": r["device"], "time_ns": r["time_ns"], "kind": r["kind"], "name": strings.get(r["name"], f"#{r['name']}")}
        for r in recs
    ]


def block_kinds(path: str) -> List[int]:
    """The kinds of the file's blocks in order, read from their headers
    alone (no checksum): a completed trace's last is ``END``."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != MAGIC or len(data) < 14:
        raise ValueError(f"{path}: not a gpualloc trace (magic {data[:8]!r}, expected {MAGIC!r})")
    # The first block follows the header; the header's bytes (start time,
    # pid, strings, checksum) may hold "BK" too.
    kinds, pos = [], 14 + struct.unpack_from("<I", data, 10)[0] + 4
    while pos + 12 <= len(data):
        kinds.append(data[pos + 2])
        pos += 16 + int.from_bytes(data[pos + 8 : pos + 12], "little")
    return kinds


def records(path: str) -> List[Dict]:
    """Every record of the file in file order, as ``decode`` names its fields,
    with ``device`` and ``time_ns``. Phase and mark names stay string ids; a
    ``free`` record (a ``free_requested`` completed in the same call) stays
    one record."""
    return _read(path, None)[1]


def _read(path: str, actions) -> Tuple[Dict[int, str], List[Dict]]:
    """The string table and the records whose action code is in ``actions``
    (every record when ``None``)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8 and data and MAGIC.startswith(data):
        raise ValueError(f"{path}: truncated inside the magic ({len(data)} of its 8 bytes)")
    if data[:8] != MAGIC:
        raise ValueError(f"{path}: not a gpualloc trace (magic {data[:8]!r}, expected {MAGIC!r})")
    if len(data) < 14:
        raise ValueError(f"{path}: truncated inside the header ({len(data)} of its first 14 bytes)")
    (version, body_len) = struct.unpack_from("<HI", data, 8)
    if version != 1:
        raise ValueError(f"{path}: trace format version {version}; this reader knows version 1")
    pos = 14 + body_len + 4
    if pos > len(data):
        raise ValueError(f"{path}: truncated inside the header ({len(data)} of its {pos} bytes)")
    stored, computed = struct.unpack_from("<I", data, 14 + body_len)[0], zlib.crc32(data[14 : 14 + body_len])
    if stored != computed:
        raise ValueError(f"{path}: the header fails its checksum (its body, bytes 14 to {14 + body_len}): stored crc32 {stored:#010x}, computed {computed:#010x}")
    strings: Dict[int, str] = {}
    recs: List[Dict] = []
    while pos < len(data):
        if pos + 16 > len(data):
            raise ValueError(f"{path}: truncated inside the block header at byte {pos} ({len(data) - pos} of its 16 bytes)")
        if data[pos : pos + 2] != b"BK":
            raise ValueError(f"{path}: no block header at byte {pos} (found {data[pos : pos + 2]!r}, expected b'BK')")
        kind, device, plen, crc = data[pos + 2], *struct.unpack_from("<III", data, pos + 4)
        payload = data[pos + 16 : pos + 16 + plen]
        if len(payload) != plen:
            raise ValueError(f"{path}: the block at byte {pos} is truncated: its payload is {plen} bytes, the file holds {len(payload)}")
        computed = zlib.crc32(payload, zlib.crc32(data[pos : pos + 12]))
        if computed != crc:
            raise ValueError(f"{path}: the block at byte {pos} fails its checksum: stored crc32 {crc:#010x}, computed {computed:#010x}")
        try:
            if kind == STRINGS:
                n, i = _varint(payload, 0)
                for _ in range(n):
                    sid, i = _varint(payload, i)
                    ln, i = _varint(payload, i)
                    if i + ln > len(payload):
                        raise IndexError("a string runs past the block")
                    strings[sid] = payload[i : i + ln].decode("utf-8", "replace")
                    i += ln
            elif kind == EVENTS:
                recs.extend({"device": device, "time_ns": t, **ev} for t, ev in _records(payload, actions))
        except (IndexError, ValueError, struct.error) as e:
            raise ValueError(f"{path}: the block at byte {pos} passes its checksum but its records end early ({e})") from None
        pos += 16 + plen
    return strings, recs


def _records(p: bytes, actions=None):
    """``(time, decode(...))`` of the records of an EVENTS payload whose action
    code is in ``actions`` (every record when ``None``)."""
    n, i = _varint(p, 0)
    t, i = _varint(p, i)
    stream = addr = size = aux = 0
    for _ in range(n):
        tag = p[i]
        i += 1
        action = tag & 0x1F
        dt, i = _zigzag(p, i)
        t = (t + dt) & U64  # wraps as the Rust reader's u64 does
        if not tag & 0x20:
            stream, i = _varint(p, i)
        if not tag & 0x40:
            _, i = _varint(p, i)  # thread
        if not tag & 0x80:
            da, i = _zigzag(p, i)
            addr = (addr + da) & U64
            size, i = _varint(p, i)
            if action <= 2 or action == FREE:
                d, i = _zigzag(p, i)
                aux = (size + d) & U64
            else:
                aux, i = _varint(p, i)
        if actions is None or action in actions:
            yield t, decode(action, stream, addr, size, aux)
