//! Snapshots as JSON, shaped like `torch.cuda.memory_snapshot()`: a list of
//! segments (`device`, `address`, `total_size`, `allocated_size`,
//! `active_size`, `requested_size`, `stream`, `segment_type`,
//! `segment_pool_id`, `is_expandable`, `blocks`), each block with `address`,
//! `size`, `requested_size` and `state` (`active_allocated`,
//! `active_pending_free`, `inactive`); or the same as C structs
//! ([`gpualloc_snapshot_segments`]), for the torch bridge's `SnapshotInfo`.

use std::ffi::{c_char, c_int};
use std::fmt::Write;

use gpualloc::size_class::PoolKind;
use gpualloc::{BlockState, SegmentSnapshot};

use crate::boundary::{Error, GPUALLOC_ERR_BUFFER_TOO_SMALL, status};
use crate::global::{self, existing};

fn segment_json(out: &mut String, s: &SegmentSnapshot) {
    let sum = |f: &dyn Fn(&gpualloc::BlockSnapshot) -> bool, size: bool| -> u64 {
        s.blocks
            .iter()
            .filter(|b| f(b))
            .map(|b| if size { b.size } else { b.requested_size })
            .sum()
    };
    // Active: PyTorch's active states (a stitch's claimed tail is inactive).
    let allocated = sum(&|b| b.state == BlockState::Allocated, true);
    let active = sum(&|b| c_state(b.state) != 0, true);
    let requested = sum(&|b| c_state(b.state) != 0, false);
    let _ = write!(
        out,
        "{{\"device\":{},\"address\":{},\"total_size\":{},\"allocated_size\":{},\"active_size\":{},\"requested_size\":{},\"stream\":{},\"segment_type\":\"{}\",\"segment_pool_id\":[{},{}],\"is_expandable\":{},\"blocks\":[",
        s.device,
        s.address,
        s.total_size,
        allocated,
        active,
        requested,
        s.stream,
        match s.kind {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        },
        s.pool_id.0,
        s.pool_id.1,
        s.expandable
    );
    for (i, b) in s.blocks.iter().enumerate() {
        let _ = write!(
            out,
            "{}{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"{}\"}}",
            if i > 0 { "," } else { "" },
            b.address,
            b.size,
            b.requested_size,
            b.state_name()
        );
    }
    out.push_str("]}");
}

/// The segments of `device` (every created device when negative).
fn segments(device: c_int) -> Result<Vec<SegmentSnapshot>, Error> {
    let Some(g) = existing() else {
        // Nothing allocated yet, and nothing is created to say so.
        if device >= 0 {
            global::idle(i64::from(device))?;
        }
        return Ok(Vec::new());
    };
    let alloc = &g.alloc;
    let mut segments = Vec::new();
    if device < 0 {
        alloc.for_each_created(|d| {
            segments.extend(d.snapshot());
            Ok(())
        })?;
    } else {
        segments = alloc.snapshot(i64::from(device))?;
    }
    Ok(segments)
}

fn snapshot_json(device: c_int) -> Result<String, Error> {
    let segments = segments(device)?;
    let mut out = String::with_capacity(64 + segments.len() * 256);
    out.push_str("{\"segments\":[");
    for (i, s) in segments.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        segment_json(&mut out, s);
    }
    out.push_str("]}");
    Ok(out)
}

/// Writes a JSON snapshot of `device` (every created device when negative)
/// into `buf` (NUL-terminated) and its length plus one into `*needed`. When
/// `cap` is too small (e.g. `buf == NULL, cap == 0` to ask) nothing is
/// written to `buf` and the result is `GPUALLOC_ERR_BUFFER_TOO_SMALL`; a
/// NULL `buf` with a non-zero `cap` is `GPUALLOC_ERR_INVALID_ARGUMENT`
/// (`*needed` is still set). The state may change between two calls: retry
/// with a larger buffer.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes; `needed` is NULL or
/// points to a writable size_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_snapshot_json(
    device: c_int,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> c_int {
    status(|| {
        let json = snapshot_json(device)?;
        let n = json.len() + 1;
        if !needed.is_null() {
            // SAFETY: non-NULL; the caller promises a writable size_t.
            unsafe { needed.write(n) };
        }
        if buf.is_null() && cap > 0 {
            return Err(Error::invalid(format!(
                "gpualloc: the snapshot buffer is NULL with room for {cap} bytes (NULL goes with a cap of 0, to ask for the size)"
            )));
        }
        if buf.is_null() || cap < n {
            return Err(Error::new(
                GPUALLOC_ERR_BUFFER_TOO_SMALL,
                format!("gpualloc: snapshot needs {n} bytes, {cap} given"),
            ));
        }
        // SAFETY: `buf` has `cap >= n` writable bytes and does not overlap our String.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), json.len());
            buf.add(json.len()).write(0);
        }
        Ok(())
    })
}

/// One segment of [`gpualloc_snapshot_segments`]: a plain segment, one
/// mapped run of an expandable segment, or a stitch in use.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuallocSegmentInfo {
    /// Device index.
    pub device: i32,
    /// Large pool (1) or small pool (0).
    pub is_large: u8,
    /// Expandable memory (1) or a plain segment (0).
    pub is_expandable: u8,
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// The stream it was allocated for (`cudaStream_t` as an integer).
    pub stream: u64,
    /// Owning private pool id, `(0, 0)` for the default pools.
    pub pool_a: u64,
    /// Second half of the pool id.
    pub pool_b: u64,
    /// Index of its first block in the blocks array.
    pub first_block: u64,
    /// Number of its blocks, which tile it in address order.
    pub num_blocks: u64,
}

/// One block of [`gpualloc_snapshot_segments`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuallocBlockInfo {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (0 when free).
    pub requested_size: u64,
    /// 0 inactive (free), 1 active_allocated, 2 active_pending_free.
    pub state: u8,
}

/// The C form of a segment and its blocks.
fn segment_info(s: &SegmentSnapshot, first_block: usize) -> GpuallocSegmentInfo {
    GpuallocSegmentInfo {
        device: s.device as i32,
        is_large: u8::from(s.kind == PoolKind::Large),
        is_expandable: u8::from(s.expandable),
        address: s.address,
        total_size: s.total_size,
        stream: s.stream,
        pool_a: s.pool_id.0,
        pool_b: s.pool_id.1,
        first_block: first_block as u64,
        num_blocks: s.blocks.len() as u64,
    }
}

fn block_info(b: &gpualloc::BlockSnapshot) -> GpuallocBlockInfo {
    GpuallocBlockInfo {
        address: b.address,
        size: b.size,
        requested_size: b.requested_size,
        state: c_state(b.state),
    }
}

/// [`GpuallocBlockInfo::state`]: 0 inactive, 1 active_allocated,
/// 2 active_pending_free (as [`gpualloc::BlockSnapshot::state_name`]).
fn c_state(state: BlockState) -> u8 {
    match state {
        BlockState::Allocated => 1,
        BlockState::PendingFree => 2,
        BlockState::Free | BlockState::Unmapped | BlockState::Claimed => 0,
    }
}

/// Segments of `device` (-1: every device), or only those of private pool
/// `(pool_a, pool_b)` when `only_pool != 0`, with their blocks in address
/// order: segment `i`'s blocks are `blocks[segs[i].first_block ..
/// segs[i].first_block + segs[i].num_blocks]`. The same segments and blocks
/// as [`gpualloc_snapshot_json`]. `*n_segs` and `*n_blocks` are always set
/// to the counts; when `seg_cap` or `block_cap` is too small nothing is
/// written to the arrays and the result is `GPUALLOC_ERR_BUFFER_TOO_SMALL`
/// (`segs`/`blocks` may be NULL with cap 0 to ask; NULL with a non-zero
/// cap is `GPUALLOC_ERR_INVALID_ARGUMENT`). The state may change between
/// two calls: retry with larger arrays.
///
/// # Safety
/// `segs` is NULL or points to `seg_cap` writable `GpuallocSegmentInfo`;
/// `blocks` is NULL or points to `block_cap` writable `GpuallocBlockInfo`;
/// `n_segs` and `n_blocks` are NULL or point to a writable size_t.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpualloc_snapshot_segments(
    device: c_int,
    only_pool: c_int,
    pool_a: u64,
    pool_b: u64,
    segs: *mut GpuallocSegmentInfo,
    seg_cap: usize,
    n_segs: *mut usize,
    blocks: *mut GpuallocBlockInfo,
    block_cap: usize,
    n_blocks: *mut usize,
) -> c_int {
    status(|| {
        let mut all = segments(device)?;
        if only_pool != 0 {
            all.retain(|s| s.pool_id == (pool_a, pool_b));
        }
        let nb: usize = all.iter().map(|s| s.blocks.len()).sum();
        let ns = all.len();
        // SAFETY: each is NULL or a writable size_t, as the caller promises.
        unsafe {
            if !n_segs.is_null() {
                n_segs.write(ns);
            }
            if !n_blocks.is_null() {
                n_blocks.write(nb);
            }
        }
        for (null, cap, what) in [
            (segs.is_null(), seg_cap, "segments"),
            (blocks.is_null(), block_cap, "blocks"),
        ] {
            if null && cap > 0 {
                return Err(Error::invalid(format!(
                    "gpualloc: the array for the {what} is NULL with room for {cap} (NULL goes with a cap of 0, to ask for the counts)"
                )));
            }
        }
        let fits = |p: bool, cap: usize, n: usize| n == 0 || (!p && cap >= n);
        if !fits(segs.is_null(), seg_cap, ns) || !fits(blocks.is_null(), block_cap, nb) {
            return Err(Error::new(
                GPUALLOC_ERR_BUFFER_TOO_SMALL,
                format!(
                    "gpualloc: snapshot has {ns} segments and {nb} blocks, room for {seg_cap} and {block_cap} given"
                ),
            ));
        }
        let mut k = 0;
        for (i, s) in all.iter().enumerate() {
            // SAFETY: `segs` has `seg_cap >= ns > i` writable elements.
            unsafe { segs.add(i).write(segment_info(s, k)) };
            for b in &s.blocks {
                // SAFETY: `blocks` has `block_cap >= nb > k` writable elements.
                unsafe { blocks.add(k).write(block_info(b)) };
                k += 1;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use gpualloc::size_class::PoolKind;
    use gpualloc::{BlockSnapshot, BlockState, SegmentSnapshot};

    use super::{block_info, segment_json};

    /// Every block state, the claimed tail of a stitch included: the JSON's
    /// sums count exactly the blocks the structs call active.
    #[test]
    fn json_sums_follow_the_struct_states() {
        let states = [
            BlockState::Allocated,
            BlockState::PendingFree,
            BlockState::Free,
            BlockState::Claimed,
        ];
        let blocks: Vec<BlockSnapshot> = states
            .iter()
            .enumerate()
            .map(|(i, &state)| BlockSnapshot {
                address: 4096 * (i as u64 + 1),
                size: 4096 << i,
                requested_size: 1000 << i,
                state,
            })
            .collect();
        let seg = SegmentSnapshot {
            device: 0,
            address: 4096,
            total_size: blocks.iter().map(|b| b.size).sum(),
            stream: 0,
            kind: PoolKind::Large,
            pool_id: (0, 0),
            expandable: true,
            blocks,
        };
        let mut json = String::new();
        segment_json(&mut json, &seg);
        let (active, requested) = seg
            .blocks
            .iter()
            .filter(|b| block_info(b).state != 0)
            .fold((0, 0), |(a, r), b| (a + b.size, r + b.requested_size));
        assert!(
            json.contains(&format!("\"active_size\":{active},")),
            "{json}"
        );
        assert!(
            json.contains(&format!("\"requested_size\":{requested},")),
            "{json}"
        );
        for b in &seg.blocks {
            let name = ["inactive", "active_allocated", "active_pending_free"];
            assert_eq!(b.state_name(), name[block_info(b).state as usize]);
        }
    }
}
