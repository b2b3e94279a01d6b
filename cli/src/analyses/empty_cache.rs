//! What a program's `empty_cache` calls cost it: memory given back to the
//! driver that it then created again.
//!
//! `torch.cuda.empty_cache()` returns cached memory to the driver, for
//! other processes or to look smaller in `nvidia-smi`; it never lowers the
//! peak. A loop that calls it every step gives back its whole working set
//! and has the driver create it again in the next step, which costs about
//! 90 µs a physical handle (`docs/driver-costs.md`, Note \[Regrowth\]). The
//! summary reports the calls, the bytes they gave back, and how many of
//! those bytes came back afterwards, so that a costly habit shows. The
//! habit is not always the program's own: with
//! `torch.backends.cudnn.benchmark` on, PyTorch's cuDNN convolutions call
//! `empty_cache` after timing each new shape (408 calls in 40 steps of
//! ResNet-50 on six input sizes, `tests/gpu/sweep.sh`, `cudnn_benchmark`).

use gpualloc::trace::EventKind;

use crate::units::bytes;

/// `empty_cache` calls on one device and the memory created after them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmptyCaches {
    /// Calls recorded.
    pub calls: u64,
    /// Bytes they gave back to the driver.
    pub released: u64,
    /// Bytes of physical memory created after a call, up to what the calls
    /// gave back until then.
    pub recreated: u64,
    /// Bytes given back and not yet created again.
    owed: u64,
}

impl EmptyCaches {
    /// Counts one event.
    #[inline]
    pub fn apply(&mut self, kind: &EventKind) {
        match *kind {
            EventKind::EmptyCache { released } => {
                // Saturating: a damaged file's sizes must not wrap a total.
                self.calls += 1;
                self.released = self.released.saturating_add(released);
                self.owed = self.owed.saturating_add(released);
            }
            EventKind::PagesCreate { bytes } | EventKind::SegmentAlloc { size: bytes, .. } => {
                let back = bytes.min(self.owed);
                self.recreated += back;
                self.owed -= back;
            }
            _ => {}
        }
    }

    /// "N calls gave back X; Y of it was created again afterwards", with
    /// advice when most of it came back; `None` without calls.
    pub fn describe(&self) -> Option<String> {
        (self.calls > 0).then(|| {
            let advice = if self.recreated > 0 && self.recreated >= self.released / 2 {
                " (the driver's work twice, and no lower peak: call it only when another process needs the memory; \
                 with torch.backends.cudnn.benchmark on, cuDNN calls it after timing each new convolution shape \
                 unless torch._C._cudnn_set_conv_benchmark_empty_cache(False))"
            } else {
                ""
            };
            format!(
                "{} calls gave back {}; {} of it was created again afterwards{advice}",
                self.calls,
                bytes(self.released),
                bytes(self.recreated)
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc::trace::Pool;

    #[test]
    fn counts_what_comes_back_up_to_what_was_given_back() {
        let mut e = EmptyCaches::default();
        e.apply(&EventKind::PagesCreate { bytes: 100 });
        assert_eq!(e.recreated, 0, "memory created before any call is new");
        e.apply(&EventKind::EmptyCache { released: 80 });
        e.apply(&EventKind::PagesCreate { bytes: 50 });
        e.apply(&EventKind::SegmentAlloc {
            addr: 0,
            size: 50,
            pool: Pool::Code(1),
        });
        e.apply(&EventKind::EmptyCache { released: 0 });
        assert_eq!((e.calls, e.released, e.recreated), (2, 80, 80));
    }
}
