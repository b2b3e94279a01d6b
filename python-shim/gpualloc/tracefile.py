"""Reads the phases and marks of a ``.gtrace`` file without the ``gpualloc`` command.

``annotations(path)`` returns, per record in file order, a dict with
``device``, ``time_ns`` (since the trace start), ``kind`` (``phase_push``,
``phase_pop`` or ``mark``) and ``name``. It decodes every record (their
fields are delta-encoded), but keeps only these three kinds; ``records(path)``
keeps them all. ``decode`` names a record's fields by action, the one place
that reads them by position; the byte layout is docs/trace-format.md's. A damaged or truncated file is a ``ValueError``
naming the offset and what was expected: a block cut short or failing its
checksum, and, as the Rust reader (allocator/src/trace/reader.rs) checks,
blocks deleted, duplicated or reordered (sequence numbers, the END block's
totals), malformed records (unknown action codes, overlong varints, stray
bytes) and the format's limits. Pure Python: about 200k events a second, for tests and
short runs; the ``gpualloc`` command reads long traces.
"""

from __future__ import annotations

import struct
import zlib
from typing import Dict, List, Tuple

MAGIC = b"\x89GATRACE"
EVENTS, STRINGS, DROPPED, END = 1, 2, 3, 4  # block kinds (docs/trace-format.md)
# Limits of allocator/src/trace/format.rs, which the Rust reader enforces.
MAX_HEADER_LEN, MAX_BLOCK_LEN, MAX_BLOCK_EVENTS = 1 << 20, 64 << 20, 1 << 16
MAX_STRINGS, MAX_DEVICES = 1 << 20, 1024
# Action codes in order, with PyTorch's names (``Action`` in allocator/src/trace/event.rs).
ACTIONS = (
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "oom", "empty_cache", "phase_push", "phase_pop",
    "mark", "record_stream", "stream_reuse", "sync_all_streams", "free",
    "pages_create", "pages_release", "private_pool", "memory_limit", "segment_unlist",
    "segment_list",
)
# The calls a ``private_pool`` record names (its ``size``; ``PoolOp`` in event.rs).
POOL_OPS = ("begin_allocate_to_pool", "end_allocate_to_pool", "create_or_incref_pool", "release_pool",
            "empty_pool_cache", "get_checkpoint_state", "set_checkpoint_pool_state",
            "create_or_incref_pool_with_allocator", "set_use_on_oom", "set_no_split",
            "set_allocator_settings")
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
    code, or ``"stitch"`` for ``STITCH_CODE``; segment_list and segment_unlist
    too, Note [Listed ranges]); ``requested``, ``device_free``
    (oom); ``released`` (empty_cache); ``name`` (a string id: phase_push,
    phase_pop, mark); ``addr``, ``other_stream`` (record_stream); ``addr``,
    ``block_size``, ``from_stream`` (stream_reuse); ``outstanding``
    (sync_all_streams); ``bytes`` (pages_create, pages_release); ``op`` (the
    call's name, ``"#<code>"`` for an unknown one), ``pool`` (the pool's
    index on the device) and ``checkpoint`` (a checkpoint's number, for
    the checkpoint calls) (private_pool); ``fraction`` (of device memory,
    1.0 for none) or ``bytes`` (None for none), the cap set, or neither
    (the record that tells the device's memory as a trace starts on it),
    and ``device_total`` (the device's memory as the allocator read it, 0
    if not known) (memory_limit). An unknown code gives ``kind``
    ``"#<code>"`` and the raw fields; a cap this reader does not know gives
    ``memory_limit`` and the raw fields.
    """
    kind = ACTIONS[action] if action < len(ACTIONS) else f"#{action}"
    if action <= 2 or action == FREE:
        return {"kind": kind, "addr": addr, "requested": size, "block_size": aux}
    if 3 <= action <= 6 or action in (20, 21):
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
    if action == 19 and size == 2:
        return {"kind": kind, "device_total": addr}
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
    """The kinds of the file's whole blocks in order, read from their
    headers alone (no checksum): a completed trace's last is ``END``. A
    block cut short (a trace still being written, or truncated) is left
    out, so an END block whose bytes are not all there is not counted;
    bytes where a block header should start but does not are an error."""
    data = _contents(path)
    if data[:8] != MAGIC or len(data) < 14:
        raise ValueError(f"{path}: not a gpualloc trace (magic {data[:8]!r}, expected {MAGIC!r})")
    # The first block follows the header; the header's bytes (start time,
    # pid, strings, checksum) may hold "BK" too.
    kinds, pos = [], 14 + struct.unpack_from("<I", data, 10)[0] + 4
    while pos + 16 <= len(data):
        if data[pos : pos + 2] != b"BK":
            raise ValueError(f"{path}: no block header at byte {pos} (found {data[pos : pos + 2]!r}, expected b'BK')")
        end = pos + 16 + int.from_bytes(data[pos + 8 : pos + 12], "little")
        if end > len(data):
            break
        kinds.append(data[pos + 2])
        pos = end
    return kinds


def _contents(path: str) -> bytes:
    """The file's bytes; only its first 8 when they are not the magic, so
    that another file (a checkpoint, ``/dev/zero``) is not read whole."""
    with open(path, "rb") as f:
        data = f.read(8)
        return data + f.read() if data == MAGIC else data


def records(path: str) -> List[Dict]:
    """Every record of the file in file order, as ``decode`` names its fields,
    with ``device`` and ``time_ns``. Phase and mark names stay string ids; a
    ``free`` record (a ``free_requested`` completed in the same call) stays
    one record."""
    return _read(path, None)[1]


def _read(path: str, actions) -> Tuple[Dict[int, str], List[Dict]]:
    """The string table and the records whose action code is in ``actions``
    (every record when ``None``)."""
    data = _contents(path)
    if len(data) < 8 and data and MAGIC.startswith(data):
        raise ValueError(f"{path}: truncated inside the magic ({len(data)} of its 8 bytes)")
    if data[:8] != MAGIC:
        raise ValueError(f"{path}: not a gpualloc trace (magic {data[:8]!r}, expected {MAGIC!r})")
    if len(data) < 14:
        raise ValueError(f"{path}: truncated inside the header ({len(data)} of its first 14 bytes)")
    (version, body_len) = struct.unpack_from("<HI", data, 8)
    if version != 1:
        raise ValueError(f"{path}: trace format version {version}; this reader knows version 1")
    if body_len > MAX_HEADER_LEN:
        raise ValueError(f"{path}: at byte 10: header length {body_len} exceeds the limit {MAX_HEADER_LEN}")
    pos = 14 + body_len + 4
    if pos > len(data):
        raise ValueError(f"{path}: truncated inside the header ({len(data)} of its {pos} bytes)")
    stored, computed = struct.unpack_from("<I", data, 14 + body_len)[0], zlib.crc32(data[14 : 14 + body_len])
    if stored != computed:
        raise ValueError(f"{path}: the header fails its checksum (its body, bytes 14 to {14 + body_len}): stored crc32 {stored:#010x}, computed {computed:#010x}")
    minor = _minor(path, data[14 : 14 + body_len])
    strings: Dict[int, str] = {}
    recs: List[Dict] = []
    # What the END block's totals are checked against (docs/trace-format.md, Reading).
    blocks = events = dropped = 0
    ended = False
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
            if plen > MAX_BLOCK_LEN:
                raise ValueError(f"its length {plen} exceeds the limit {MAX_BLOCK_LEN}")
            if device >= MAX_DEVICES:
                raise ValueError(f"its device {device} is not below the limit of {MAX_DEVICES} devices")
            if ended:
                raise ValueError("it follows the END block: blocks were duplicated or appended")
            if minor >= 1 and data[pos + 3] != blocks & 0xFF:
                raise ValueError(
                    f"block {blocks} carries sequence number {data[pos + 3]}, expected {blocks & 0xFF} "
                    "(the index modulo 256): blocks were deleted, duplicated or reordered"
                )
            if kind == STRINGS:
                n, i = _varint(payload, 0)
                if len(strings) + n > MAX_STRINGS:
                    raise ValueError(f"{n} more strings after {len(strings)} are above the limit of {MAX_STRINGS} in a trace")
                for _ in range(n):
                    sid, i = _varint(payload, i)
                    if sid != len(strings):
                        raise ValueError(f"string id {sid} out of order (expected {len(strings)})")
                    ln, i = _varint(payload, i)
                    if i + ln > len(payload):
                        raise ValueError(f"string {sid} runs past the block")
                    try:
                        strings[sid] = payload[i : i + ln].decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"string {sid} is not UTF-8") from None
                    i += ln
            elif kind == EVENTS:
                events += _records(payload, actions, device, recs)
            elif kind == DROPPED:
                n, _ = _varint(payload, 0)
                dropped += n
            elif kind == END:
                want = ("events", events), ("dropped events", dropped), ("end time", None)
                i = 0
                for what, have in want + ((("blocks before it", blocks),) if minor >= 1 else ()):
                    v, i = _varint(payload, i)
                    if have is not None and v != have:
                        raise ValueError(f"the END block counts {v} {what}, the file before it holds {have}: blocks were deleted or duplicated")
                ended = True
            # Other kinds are skipped: later minor versions may add some.
        except (IndexError, ValueError, struct.error) as e:
            raise ValueError(f"{path}: the block at byte {pos} passes its checksum but is malformed (a block of kind {kind}): {e}") from None
        blocks += 1
        pos += 16 + plen
    return strings, recs


def _minor(path: str, body: bytes) -> int:
    """The header body's minor version (0 when absent), its fields checked
    as ``parse_header`` in reader.rs checks them."""
    try:
        if len(body) < 16:
            raise ValueError(f"{len(body)} bytes, fewer than the 16 of its fixed fields")
        device_count = struct.unpack_from("<I", body, 8)[0]
        i = 16
        for what in ("configuration", "producer"):
            ln, i = _varint(body, i)
            if i + ln > len(body):
                raise ValueError(f"the {what} string runs past the header")
            try:
                body[i : i + ln].decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"the {what} string is not UTF-8") from None
            i += ln
        minor = _varint(body, i)[0] if i < len(body) else 0
    except ValueError as e:
        raise ValueError(f"{path}: at byte 14: the header's fields do not parse: {e}") from None
    if device_count > MAX_DEVICES:
        raise ValueError(f"{path}: at byte 14: the header's device count {device_count} is above the limit of {MAX_DEVICES}")
    return minor


def _records(p: bytes, actions, device: int, out: List) -> int:
    """Appends the records (``decode``'s dict with ``device`` and ``time_ns``) of an EVENTS payload
    whose action code is in ``actions`` (every record when ``None``) to
    ``out``; returns the payload's events as the Rust reader counts them (a
    ``free`` record is two). Malformed records are a ValueError, as in
    ``decode_events`` (reader.rs)."""
    n, i = _varint(p, 0)
    if n > MAX_BLOCK_EVENTS:
        raise ValueError(f"event count {n} is above the limit of {MAX_BLOCK_EVENTS} records per block")
    t, i = _varint(p, i)
    stream = addr = size = aux = 0
    events = n
    for k in range(n):
        if i >= len(p):
            raise ValueError(f"record {k} of {n} missing")
        tag = p[i]
        i += 1
        action = tag & 0x1F
        if action >= len(ACTIONS):
            raise ValueError(f"record {k}: unknown action code {action}")
        events += action == FREE
        dt, i = _zigzag(p, i)
        t = (t + dt) & U64  # wraps as the Rust reader's u64 does
        if not tag & 0x20:
            stream, i = _varint(p, i)
        if not tag & 0x40:
            thread, i = _varint(p, i)
            if thread >= 1 << 32:
                raise ValueError(f"record {k}: thread id {thread} too large")
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
            out.append({"device": device, "time_ns": t, **decode(action, stream, addr, size, aux)})
    if i != len(p):
        raise ValueError(f"{len(p) - i} stray bytes after {n} records")
    return events
