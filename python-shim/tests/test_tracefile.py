"""gpualloc.tracefile names a record's fields by action in one function,
``decode``, as ``TraceEvent::kind`` does in Rust; it reads the recorded
example as the ``gpualloc`` command does."""

import os
import struct
import unittest

from . import __name__ as _env  # noqa: F401  (sets the simulated environment first)
from gpualloc.tracefile import ACTIONS, END, STITCH_CODE, annotations, block_kinds, decode, records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
YOLO = os.path.join(ROOT, "examples", "yolo-style-oom.gtrace")


def _varint(v):
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _header(minor=3, pid=0, producer=b"test", device_count=1):
    """A trace's header (docs/trace-format.md), sealed."""
    import zlib

    body = struct.pack("<QII", 0, device_count, pid) + _varint(0) + _varint(len(producer)) + producer
    if minor is not None:
        body += _varint(minor)
    return b"\x89GATRACE" + struct.pack("<HI", 1, len(body)) + body + struct.pack("<I", zlib.crc32(body))


def _block(kind, payload, device=0, seq=0):
    """A block with a valid checksum."""
    import zlib

    head = b"BK" + bytes([kind, seq & 0xFF]) + struct.pack("<II", device, len(payload))
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


def _read(data, fn=None):
    """``fn`` (``records``) of a file holding ``data``."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gtrace", delete=False) as f:
        f.write(data)
    try:
        return (fn or records)(f.name)
    finally:
        os.unlink(f.name)



class DecodeTest(unittest.TestCase):
    def test_every_action_has_its_named_fields(self):
        s, a, size, aux = 7, 0x7F00_0000, 1000, 1024
        want = {
            "alloc": {"addr": a, "requested": size, "block_size": aux},
            "free_requested": {"addr": a, "requested": size, "block_size": aux},
            "free_completed": {"addr": a, "requested": size, "block_size": aux},
            "segment_alloc": {"addr": a, "size": size, "pool": aux},
            "segment_free": {"addr": a, "size": size, "pool": aux},
            "segment_map": {"addr": a, "size": size, "pool": aux},
            "segment_unmap": {"addr": a, "size": size, "pool": aux},
            "oom": {"requested": size, "device_free": aux},
            "empty_cache": {"released": size},
            "phase_push": {"name": aux},
            "phase_pop": {"name": aux},
            "mark": {"name": aux},
            "record_stream": {"addr": a, "other_stream": s},
            "stream_reuse": {"addr": a, "block_size": size, "from_stream": aux},
            "sync_all_streams": {"outstanding": size},
            "free": {"addr": a, "requested": size, "block_size": aux},
            "pages_create": {"bytes": size},
            "pages_release": {"bytes": size},
            "private_pool": {"op": f"#{size}", "pool": aux, "checkpoint": a},
            "memory_limit": {"stream": s, "addr": a, "size": size, "aux": aux},  # a cap code this reader does not know
            "segment_unlist": {"addr": a, "size": size, "pool": aux},
            "segment_list": {"addr": a, "size": size, "pool": aux},
        }
        self.assertEqual(list(want), list(ACTIONS))
        for code, name in enumerate(ACTIONS):
            self.assertEqual(decode(code, s, a, size, aux), {"kind": name, **want[name]}, name)

    def test_a_pool_call_is_named_as_pytorch_names_it(self):
        self.assertEqual(decode(18, 0, 0, 0, 2),
                         {"kind": "private_pool", "op": "begin_allocate_to_pool", "pool": 2, "checkpoint": 0})
        self.assertEqual(decode(18, 0, 0, 3, 0)["op"], "release_pool")
        self.assertEqual(decode(18, 0, 9, 6, 1)["op"], "set_checkpoint_pool_state")
        self.assertEqual(decode(18, 0, 9, 7, 1)["op"], "create_or_incref_pool_with_allocator")
        self.assertEqual(decode(18, 0, 9, 8, 1)["op"], "set_use_on_oom")
        self.assertEqual(decode(18, 0, 9, 9, 1)["op"], "set_no_split")
        self.assertEqual(decode(18, 0, 9, 6, 1)["checkpoint"], 9)

    def test_a_memory_limit_names_the_cap_it_sets(self):
        half = struct.unpack("<Q", struct.pack("<d", 0.5))[0]
        self.assertEqual(decode(19, 0, 80 << 30, 0, half), {"kind": "memory_limit", "fraction": 0.5, "device_total": 80 << 30})
        self.assertEqual(decode(19, 0, 0, 1, 6 << 30), {"kind": "memory_limit", "bytes": 6 << 30, "device_total": 0})
        self.assertEqual(decode(19, 0, 0, 1, 2**64 - 1)["bytes"], None)

    def test_the_stitch_code_is_a_stitch_not_a_pool(self):
        self.assertEqual(decode(5, 0, 1 << 30, 2 << 20, STITCH_CODE)["pool"], "stitch")
        self.assertEqual(decode(6, 0, 1 << 30, 2 << 20, STITCH_CODE)["pool"], "stitch")
        self.assertEqual(decode(5, 0, 1 << 30, 2 << 20, 1)["pool"], 1)
        self.assertEqual(decode(21, 0, 1 << 30, 2 << 20, STITCH_CODE)["pool"], "stitch")
        self.assertEqual(decode(20, 0, 1 << 30, 2 << 20, 1)["pool"], 1)

    def test_the_recorded_example_reads_as_the_command_reads_it(self):
        recs = records(YOLO)
        # `gpualloc summary`: 174247 events (a `free` record is two), 58003 allocations.
        self.assertEqual(len(recs) + sum(r["kind"] == "free" for r in recs), 174247)
        self.assertEqual(sum(r["kind"] == "alloc" for r in recs), 58003)
        ooms = [r for r in recs if r["kind"] == "oom"]
        self.assertEqual(len(ooms), 1)
        self.assertEqual(ooms[0]["requested"], 31719424)
        self.assertTrue(any(r.get("pool") == "stitch" for r in recs), "stitches carry their own code")
        self.assertTrue(all(r["block_size"] >= r["requested"] for r in recs if r["kind"] == "alloc"))
        names = annotations(YOLO)
        self.assertEqual(len(names), sum(r["kind"] in ("phase_push", "phase_pop", "mark") for r in recs))


class DamageTest(unittest.TestCase):
    """A damaged or truncated file is a ValueError naming what and where."""

    def damaged(self, data):
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".gtrace", delete=False) as f:
            f.write(data)
        try:
            with self.assertRaises(ValueError) as cm:
                records(f.name)
            return str(cm.exception)
        finally:
            os.unlink(f.name)

    def test_truncated_corrupt_and_short_blocks(self):
        import struct
        import zlib

        with open(YOLO, "rb") as f:
            data = f.read()
        body = struct.unpack_from("<I", data, 10)[0]
        first = 14 + body + 4
        self.assertIn("truncated inside the header", self.damaged(data[:9]))
        self.assertIn("truncated inside the header", self.damaged(data[: first - 2]))
        bad = bytearray(data)
        bad[20] ^= 0xFF  # inside the header body
        self.assertIn("header fails its checksum", self.damaged(bytes(bad)))
        # The first events block, resealed with more records than it holds.
        at = first
        while data[at + 2] != 1:
            at += 16 + struct.unpack_from("<I", data, at + 8)[0]
        plen = struct.unpack_from("<I", data, at + 8)[0]
        payload = b"\xff\x7f" + data[at + 16 : at + 16 + plen][1:]  # a count of 16,383
        head = data[at : at + 8] + struct.pack("<I", len(payload))
        block = head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload
        self.assertIn(f"block at byte {at} passes its checksum", self.damaged(data[:at] + block))


class VarintTest(unittest.TestCase):
    """Varints are at most 64 bits, as the Rust reader's (format.rs)."""

    def test_an_overlong_varint_is_an_error_not_a_slow_big_integer(self):
        import time

        # One alloc record whose time delta is a varint of 200,000 bytes: it
        # was decoded bit by bit into a huge integer, quadratic (seconds here,
        # hours for a 64 MiB block), and returned as a time.
        rec = bytes([0]) + b"\x81" * 200_000 + b"\x01" + _varint(0) + _varint(1) + b"\x00\x00\x00"
        data = _header() + _block(1, _varint(1) + _varint(0) + rec)
        t = time.monotonic()
        with self.assertRaises(ValueError) as cm:
            _read(data)
        self.assertLess(time.monotonic() - t, 1.0)
        self.assertIn("exceeds 64 bits", str(cm.exception))
        self.assertIn("block at byte", str(cm.exception))

    def test_eleven_bytes_are_refused_and_ten_read(self):
        top = b"\xff" * 9 + b"\x01"  # 2**64 - 1, the longest valid varint
        ok = _header() + _block(1, _varint(1) + _varint(0) + bytes([7]) + _varint(0) + _varint(0) + _varint(0) + _varint(0) + top + _varint(0))
        self.assertEqual(_read(ok)[0]["requested"], 2**64 - 1)
        bad = _header() + _block(1, _varint(1) + _varint(0) + bytes([7]) + _varint(0) + _varint(0) + _varint(0) + _varint(0) + b"\x80" * 9 + b"\x02" + _varint(0))
        with self.assertRaises(ValueError):
            _read(bad)

    def test_time_wraps_at_64_bits_as_the_rust_reader(self):
        # The first record 1 ns before the block's base time 0.
        data = _header() + _block(1, _varint(1) + _varint(0) + bytes([11]) + _varint(1) + _varint(0) + _varint(0) + _varint(0) + _varint(0) + _varint(0))
        self.assertEqual(_read(data)[0]["time_ns"], 2**64 - 1)


class BlockKindsTest(unittest.TestCase):
    def test_the_header_is_not_searched_for_blocks(self):
        end = _block(END, _varint(0) + _varint(0) + _varint(5) + _varint(0))
        # pid 19266 is the bytes 42 4b ("BK"): the scan started there, inside the header.
        self.assertEqual(_read(_header(pid=19266) + end, block_kinds), [END])
        self.assertEqual(_read(_header(producer=b"import (BKP)") + end, block_kinds), [END])
        self.assertEqual(_read(_header() + end, block_kinds), [END])

    def test_a_block_cut_short_is_not_counted(self):
        events = _block(1, _varint(0), seq=0)
        end = _block(END, _varint(0) + _varint(0) + _varint(5) + _varint(1), seq=1)
        whole = _header() + events + end
        self.assertEqual(_read(whole, block_kinds), [1, END])
        # The END block's header is there, its payload not all: the trace
        # is not complete, whatever its last header says.
        self.assertEqual(_read(whole[:-1], block_kinds), [1])
        self.assertEqual(_read(whole[: len(whole) - len(end) + 10], block_kinds), [1])

    def test_bytes_that_are_no_block_header_are_named(self):
        data = _header() + _block(1, _varint(0)) + b"XX" + bytes(30)
        with self.assertRaises(ValueError) as cm:
            _read(data, block_kinds)
        self.assertIn("no block header at byte", str(cm.exception))


class _Refusing(unittest.TestCase):
    """Tests that read damaged bytes: ``error`` is the reader's message."""

    def error(self, data):
        with self.assertRaises(ValueError) as cm:
            _read(data)
        return str(cm.exception)


class MessageTest(_Refusing):
    """An error says what was wrong and where, as the Rust reader's does."""

    def test_a_truncated_block_is_not_called_a_checksum_failure(self):
        with open(YOLO, "rb") as f:
            data = f.read()
        first = 14 + struct.unpack_from("<I", data, 10)[0] + 4
        plen = struct.unpack_from("<I", data, first + 8)[0]
        e = self.error(data[: first + 20])
        self.assertIn(f"block at byte {first} is truncated: its payload is {plen} bytes, the file holds 4", e)
        self.assertNotIn("checksum", e)
        bad = bytearray(data)
        bad[first + 17] ^= 1
        e = self.error(bytes(bad))
        self.assertIn(f"block at byte {first} fails its checksum: stored crc32 0x", e)
        self.assertNotIn("truncated", e)
        e = self.error(data[: first + 5])
        self.assertIn(f"truncated inside the block header at byte {first} (5 of its 16 bytes)", e)
        e = self.error(data[:first] + b"XX" + data[first + 2 :])
        self.assertIn(f"no block header at byte {first} (found b'XX', expected b'BK')", e)
        self.assertIn("truncated inside the magic (3 of its 8 bytes)", self.error(data[:3]))
        bad = bytearray(data)
        bad[20] ^= 1
        self.assertIn("header fails its checksum (its body, bytes 14 to", self.error(bytes(bad)))


def _blocks(data):
    """The offsets of the blocks of a trace's bytes."""
    pos, offs = 14 + struct.unpack_from("<I", data, 10)[0] + 4, []
    while pos < len(data):
        offs.append(pos)
        pos += 16 + struct.unpack_from("<I", data, pos + 8)[0]
    return offs


class IntegrityTest(_Refusing):
    """Whole blocks deleted, duplicated or reordered, and records the Rust
    reader refuses, are errors at the block's offset (docs/trace-format.md,
    Reading); they were read as if intact, giving other counts than the
    ``gpualloc`` command, which refuses the file."""

    def setUp(self):
        with open(YOLO, "rb") as f:
            self.data = f.read()
        self.offs = _blocks(self.data)

    def block(self, k):
        return self.data[self.offs[k] : self.offs[k + 1]]

    def test_a_deleted_or_duplicated_block(self):
        d, offs = self.data, self.offs
        e = self.error(d[: offs[5]] + d[offs[6] :])
        self.assertIn(f"block at byte {offs[5]} passes its checksum", e)
        self.assertIn("carries sequence number 6, expected 5", e)
        e = self.error(d[: offs[6]] + self.block(5) + d[offs[6] :])
        self.assertIn(f"block at byte {offs[6]} passes", e)
        # 256 blocks deleted keep the sequence numbers: the END block's totals tell.
        alloc = bytes([0]) + _varint(0) * 4 + _varint(8) + _varint(0)
        evs = [_block(1, _varint(1) + _varint(k) + alloc, seq=k) for k in range(300)]
        end = _block(4, _varint(300) + _varint(0) + _varint(300) + _varint(300), seq=300)
        self.assertEqual(len(_read(_header() + b"".join(evs) + end)), 300)
        kept = evs[:5] + evs[5 + 256 :]
        e = self.error(_header() + b"".join(kept) + end)
        self.assertIn("the END block counts 300 events, the file before it holds 44", e)
        self.assertIn(f"block at byte {len(_header()) + len(b''.join(kept))}", e)
        # Minor 0 files have no sequence numbers: the END block's totals tell too.
        end0 = _block(4, _varint(3) + _varint(0) + _varint(3))
        evs0 = [_block(1, _varint(1) + _varint(k) + alloc) for k in range(3)]
        self.assertEqual(len(_read(_header(minor=None) + b"".join(evs0) + end0)), 3)
        self.assertIn("the END block counts 3 events", self.error(_header(minor=None) + b"".join(evs0[1:]) + end0))
        e = self.error(d + self.block(len(offs) - 2))
        self.assertIn("follows the END block", e)

    def test_records_the_rust_reader_refuses(self):
        h = _header()
        alloc = bytes([0]) + _varint(0) * 4 + _varint(8) + _varint(0)
        self.assertEqual(len(_read(h + _block(1, _varint(1) + _varint(0) + alloc))), 1)
        e = self.error(h + _block(1, _varint(1) + _varint(0) + alloc + b"\x00"))
        self.assertIn("1 stray bytes after 1 records", e)
        e = self.error(h + _block(1, _varint(1) + _varint(0) + bytes([22]) + alloc[1:]))
        self.assertIn("unknown action code 22", e)
        e = self.error(h + _block(1, _varint(1) + _varint(0) + alloc, device=1024))
        self.assertIn("device 1024", e)
        e = self.error(h + _block(2, _varint(1) + _varint(1) + _varint(1) + b"a"))
        self.assertIn("string id 1 out of order (expected 0)", e)
        e = self.error(h + _block(2, _varint(1) + _varint(0) + _varint(1) + b"\xff"))
        self.assertIn("string 0 is not UTF-8", e)
        e = self.error(_header(device_count=1025) + _block(1, _varint(1) + _varint(0) + alloc))
        self.assertIn("device count 1025", e)


if __name__ == "__main__":
    unittest.main()
