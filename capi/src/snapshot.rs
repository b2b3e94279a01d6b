//! Snapshots as JSON, shaped like `torch.cuda.memory_snapshot()`: a list of
//! segments (`device`, `address`, `total_size`, `allocated_size`,
//! `active_size`, `requested_size`, `stream`, `segment_type`,
//! `segment_pool_id`, `is_expandable`, `blocks`), each block with `address`,
//! `size`, `requested_size` and `state` (`active_allocated`,
//! `active_pending_free`, `inactive`).

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
    let allocated = sum(&|b| b.state == BlockState::Allocated, true);
    let active = sum(&|b| b.state != BlockState::Free, true);
    let requested = sum(&|b| b.state != BlockState::Free, false);
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

fn snapshot_json(device: c_int) -> Result<String, Error> {
    let Some(g) = existing() else {
        // Nothing allocated yet, and nothing is created to say so.
        if device >= 0 {
            global::idle(i64::from(device))?;
        }
        return Ok("{\"segments\":[]}".to_string());
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
/// written to `buf` and the result is `GPUALLOC_ERR_BUFFER_TOO_SMALL`. The
/// state may change between two calls: retry with a larger buffer.
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
