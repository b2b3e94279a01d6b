//! Allocator hot-path benchmarks on the simulated device.
//!
//! - `pair/live=N`: one alloc+free pair on a warm cache with N other blocks live;
//! - `pair_warm_default/live=N`: the same under the default policy
//!   (`policy:gpualloc`: expandable segments, page pool, defragmentation);
//! - `churn`: a window of live blocks of mixed sizes, oldest freed first;
//! - `split_coalesce`: allocations that split one segment and frees that merge it back;
//! - `threads/T`: T threads sharing one device through `Allocator` (the lock).
//!
//! All but `pair_warm_default` run PyTorch's rules (`Config::pytorch()`), the
//! configuration their earlier results were measured with.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpualloc::workload::Rng;
use gpualloc::{Allocator, Config, DeviceAllocator, SimBackend};

const CAPACITY: u64 = 1 << 40;

fn device() -> DeviceAllocator<SimBackend> {
    device_with(Config::pytorch())
}

fn device_with(config: Config) -> DeviceAllocator<SimBackend> {
    DeviceAllocator::new(0, SimBackend::new(CAPACITY), config)
}

/// Mixed tensor sizes drawn from an xorshift64 [`Rng`].
struct Sizes(Rng);

impl Sizes {
    fn new(seed: u64) -> Sizes {
        Sizes(Rng::xorshift64(seed))
    }

    fn next(&mut self) -> u64 {
        let x = self.0.next_u64();
        match x % 10 {
            0..=5 => 512 + x % (256 << 10),     // small activations
            6..=8 => (1 << 20) + x % (8 << 20), // medium
            _ => (10 << 20) + x % (64 << 20),   // large
        }
    }
}

fn pair_with_live(c: &mut Criterion) {
    pairs(c, "pair", Config::pytorch());
}

fn pair_warm_default(c: &mut Criterion) {
    pairs(c, "pair_warm_default", Config::default());
}

/// One alloc+free pair on a warm cache, with 0 to 100k other blocks live.
fn pairs(c: &mut Criterion, group: &str, config: Config) {
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(1));
    for live in [0usize, 1_000, 10_000, 100_000] {
        let mut d = device_with(config.clone());
        let mut sizes = Sizes::new(0x9e3779b97f4a7c15);
        let held: Vec<u64> = (0..live)
            .map(|_| d.malloc(sizes.next() % (512 << 10) + 1, 0).unwrap())
            .collect();
        // Warm: the pair's own block is cached.
        let p = d.malloc(4096, 0).unwrap();
        d.free(p).unwrap();
        g.bench_with_input(BenchmarkId::new("live", live), &live, |b, _| {
            b.iter(|| {
                let p = d.malloc(black_box(4096), 0).unwrap();
                d.free(black_box(p)).unwrap();
            })
        });
        black_box(held);
    }
    g.finish();
}

fn churn(c: &mut Criterion) {
    let mut d = device();
    let mut sizes = Sizes::new(42);
    let mut window: std::collections::VecDeque<u64> = (0..256)
        .map(|_| d.malloc(sizes.next(), 0).unwrap())
        .collect();
    let mut g = c.benchmark_group("churn");
    g.throughput(Throughput::Elements(1));
    g.bench_function("mixed_window_256", |b| {
        b.iter(|| {
            let p = d.malloc(sizes.next(), 0).unwrap();
            window.push_back(p);
            d.free(window.pop_front().unwrap()).unwrap();
        })
    });
    g.finish();
}

fn split_coalesce(c: &mut Criterion) {
    let mut d = device();
    let mut g = c.benchmark_group("split_coalesce");
    g.throughput(Throughput::Elements(8));
    g.bench_function("8_pieces_of_a_small_segment", |b| {
        b.iter(|| {
            let ps: [u64; 8] =
                std::array::from_fn(|i| d.malloc((((i as u64) + 1) * 16) << 10, 0).unwrap());
            // Free in an order that merges from both sides.
            for i in [1usize, 3, 5, 7, 0, 2, 4, 6] {
                d.free(ps[i]).unwrap();
            }
        })
    });
    g.finish();
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    for t in [1usize, 2, 4] {
        let a = Arc::new(Allocator::new(
            Config::pytorch(),
            1,
            Box::new(|_| Ok(SimBackend::new(CAPACITY))),
        ));
        // One element = one alloc+free pair on each of the T threads.
        g.throughput(Throughput::Elements(t as u64));
        g.bench_with_input(BenchmarkId::from_parameter(t), &t, |b, &t| {
            b.iter_custom(|iters| {
                let start = std::time::Instant::now();
                std::thread::scope(|s| {
                    for k in 0..t {
                        let a = &a;
                        s.spawn(move || {
                            let stream = k as u64;
                            for _ in 0..iters {
                                let p = a.malloc(0, black_box(8192), stream).unwrap();
                                a.free(0, p).unwrap();
                            }
                        });
                    }
                });
                start.elapsed()
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    pair_with_live,
    pair_warm_default,
    churn,
    split_coalesce,
    threads
);
criterion_main!(benches);
