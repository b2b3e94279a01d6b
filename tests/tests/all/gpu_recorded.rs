//! The traces in `examples/` were recorded on an H200 by `tests/gpu/run.sh`
//! (torch 2.11, 150 training steps, `expandable_segments:true`). Replaying
//! one with the configuration it was recorded with must reproduce the peaks
//! that PyTorch read from gpualloc on the GPU (`torch.cuda.max_memory_reserved`
//! and `max_memory_allocated`, in that run's `summary.json`).

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

fn replay_example(name: &str) -> (u64, u64, u64) {
    let mut r = TraceReader::open(&example(name)).expect("the example trace opens");
    let config = Config::parse(&r.header().config).expect("the recorded configuration parses");
    assert!(config.expandable_segments);
    let events: Vec<_> = r.events().collect();
    assert!(r.error().is_none(), "{:?}", r.error());
    assert!(r.end().is_some(), "the recording was stopped cleanly");
    let out = replay(events.into_iter(), H200, &config);
    (out.peak_reserved, out.peak_allocated, out.ooms)
}

#[test]
fn gpt2_trace_replays_to_the_peaks_measured_on_the_gpu() {
    assert_eq!(
        replay_example("gpt2-varlen.gtrace"),
        (8_126_464_000, 8_092_138_496, 0)
    );
}

#[test]
fn detector_trace_replays_to_the_peaks_measured_on_the_gpu() {
    assert_eq!(
        replay_example("detector-multiscale.gtrace"),
        (2_667_577_344, 2_629_305_344, 0)
    );
}
