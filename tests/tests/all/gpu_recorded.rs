//! The traces in `examples/` were recorded on an H200 by `tests/gpu/run.sh`
//! (torch 2.11, 150 training steps, `expandable_segments:true`) with the
//! expandable-segment policy of that time, which gpualloc no longer has (it
//! now keeps a page pool and defragments): replay cannot reproduce the
//! reserved peaks measured then. New GPU traces will replace these; until
//! then the tests check what does not depend on that policy.
//!
//! - Under the recorded configuration, the allocated peak is the one PyTorch
//!   read from gpualloc on the GPU (`torch.cuda.max_memory_allocated`, in
//!   that run's `summary.json`), with no out-of-memory error. Expandable
//!   segments split a block whenever 512 B remain, so the allocated peak is
//!   the sum of the rounded requests whatever the page policy.
//! - Under `policy:pytorch` (plain segments) the replay completes without an
//!   out-of-memory error. Its allocated peak is higher: PyTorch leaves a
//!   remainder of up to 1 MiB inside a large block instead of splitting it.

use std::path::PathBuf;

use gpualloc::Config;
use gpualloc::replay::replay;
use gpualloc::trace::reader::TraceReader;

/// H200 memory as `cudaMemGetInfo` reports it (143771 MiB).
const H200: u64 = 143_771 << 20;

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

/// Replays an example under the configuration it was recorded with and
/// under `policy:pytorch`; checks both against the allocated peak measured
/// on the GPU.
fn check_example(name: &str, gpu_peak_allocated: u64) {
    let mut r = TraceReader::open(&example(name)).expect("the example trace opens");
    let recorded = Config::parse(&r.header().config).expect("the recorded configuration parses");
    assert!(recorded.expandable_segments);
    let events: Vec<_> = r.events().collect();
    assert!(r.error().is_none(), "{:?}", r.error());
    assert!(r.end().is_some(), "the recording was stopped cleanly");

    let out = replay(events.iter().copied(), H200, &recorded);
    assert_eq!(
        (out.peak_allocated, out.ooms),
        (gpu_peak_allocated, 0),
        "{name} under {:?}",
        recorded.source
    );
    assert!(out.peak_reserved >= out.peak_allocated);

    let pytorch = Config::pytorch();
    let out = replay(events.into_iter(), H200, &pytorch);
    assert_eq!(out.ooms, 0, "{name} under policy:pytorch");
    assert!(
        out.peak_allocated >= gpu_peak_allocated,
        "{name} under policy:pytorch: blocks are never smaller than with expandable segments"
    );
    assert!(out.peak_reserved >= out.peak_allocated);
}

#[test]
fn gpt2_trace_replays_to_the_allocated_peak_measured_on_the_gpu() {
    check_example("gpt2-varlen.gtrace", 8_092_138_496);
}

#[test]
fn detector_trace_replays_to_the_allocated_peak_measured_on_the_gpu() {
    check_example("detector-multiscale.gtrace", 2_629_305_344);
}
