//! What the diagnostic-logging calls cost with logging off (`gpualloc::log`).
//!
//! - `log/pair`: one alloc+free pair on a warm cache (no logging call on
//!   this path; the control);
//! - `log/grow_flush`: an alloc that creates a segment, its free, and
//!   `empty_cache`: two logging calls (`new segment`, `cache flushed`) per
//!   iteration, the slow path where they sit;
//! - `log/event`: one disabled `debug!` event with a field, alone.
//!
//! Run it twice and compare: with the calls compiled in but no logger (the
//! shipped build), and with them compiled out:
//!
//! ```sh
//! cargo bench -p gpualloc-benches --bench log -- --save-baseline calls
//! cargo bench -p gpualloc-benches --bench log --features log-compiled-out -- --baseline calls
//! ```

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpualloc::{Config, DeviceAllocator, SimBackend};

fn device() -> DeviceAllocator<SimBackend> {
    DeviceAllocator::new(0, SimBackend::new(1 << 40), Config::pytorch())
}

fn log_off(c: &mut Criterion) {
    assert!(
        !tracing::event_enabled!(tracing::Level::ERROR),
        "no logger may be installed: this measures logging off"
    );
    let mut g = c.benchmark_group("log");
    g.throughput(Throughput::Elements(1));
    let mut d = device();
    let p = d.malloc(4096, 0).unwrap();
    d.free(p).unwrap();
    g.bench_function("pair", |b| {
        b.iter(|| {
            let p = d.malloc(black_box(4096), 0).unwrap();
            d.free(black_box(p)).unwrap();
        })
    });
    let mut d = device();
    g.bench_function("grow_flush", |b| {
        b.iter(|| {
            let p = d.malloc(black_box(64 << 20), 0).unwrap();
            d.free(black_box(p)).unwrap();
            d.empty_cache().unwrap();
        })
    });
    g.bench_function("event", |b| {
        b.iter(|| tracing::debug!(bytes = black_box(4096u64), "an event"))
    });
    g.finish();
}

criterion_group!(benches, log_off);
criterion_main!(benches);
