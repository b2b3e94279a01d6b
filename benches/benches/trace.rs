//! Trace costs.
//!
//! - `pair/off`, `pair/on`: an alloc+free pair through `Allocator` (lock
//!   included) with 10k other blocks live, without and with tracing (to
//!   /dev/null, the writer thread running); the difference is the cost added
//!   per pair (three events: alloc, free_requested, free_completed), under
//!   PyTorch's rules (`Config::pytorch()`), as the earlier results were;
//! - `record`: one `DeviceTrace::record` call;
//! - `encode`, `decode`: the writer's and the reader's throughput on blocks
//!   of 4096 events.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpualloc::trace::{
    Action, Recorder, TraceEvent, TraceHeader, TraceOptions, TraceReader, TraceWriter,
};
use gpualloc::workload::Rng;
use gpualloc::{Allocator, Config, SimBackend};

const LIVE: usize = 10_000;

fn allocator() -> (Allocator<SimBackend>, Vec<u64>) {
    let a = Allocator::new(
        Config::pytorch(),
        1,
        // The process clock, as on a GPU: tracing reads it once per call.
        Box::new(|_| Ok(SimBackend::new(1 << 40).with_wall_clock())),
    );
    let mut rng = Rng::xorshift64(0x9e37_79b9_7f4a_7c15);
    let held = (0..LIVE)
        .map(|_| a.malloc(0, 512 + rng.below(512 << 10), 0).unwrap())
        .collect();
    let p = a.malloc(0, 4096, 0).unwrap();
    a.free(0, p).unwrap();
    (a, held)
}

fn pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("pair");
    g.throughput(Throughput::Elements(1));
    for traced in [false, true] {
        let (a, held) = allocator();
        if traced {
            a.trace_start(Path::new("/dev/null")).unwrap();
        }
        g.bench_function(if traced { "on" } else { "off" }, |b| {
            b.iter(|| {
                let p = a.malloc(0, black_box(4096), 0).unwrap();
                a.free(0, black_box(p)).unwrap();
            })
        });
        if traced {
            let s = a.trace_stop().unwrap();
            assert_eq!(s.dropped, 0, "the writer kept up");
        }
        black_box(held);
    }
    g.finish();
}

fn record(c: &mut Criterion) {
    let rec = Recorder::start(Path::new("/dev/null"), "", 1, TraceOptions::default()).unwrap();
    let mut t = rec.device_trace(0, gpualloc::clock::now_ns());
    let mut g = c.benchmark_group("record");
    g.throughput(Throughput::Elements(1));
    g.bench_function("event", |b| {
        let mut addr = 0x7f00_0000_0000u64;
        b.iter(|| {
            addr += 512;
            // One event per call: the call's clock reading included.
            t.record(
                gpualloc::clock::now_ns(),
                Action::Alloc,
                0,
                black_box(addr),
                4000,
                4096,
            );
        })
    });
    g.finish();
}

fn events() -> Vec<TraceEvent> {
    let mut t = 0;
    (0..4096u64)
        .map(|i| {
            t += 150 + i % 7 * 40;
            let action =
                [Action::Alloc, Action::FreeRequested, Action::FreeCompleted][(i % 3) as usize];
            TraceEvent {
                time_ns: t,
                action,
                device: 0,
                stream: 0,
                addr: 0x7f00_0000_0000 + (i / 3 % 97) * (1 << 20),
                size: 1000 + i / 3 % 5000,
                aux: 1024 + i / 3 % 5000,
                thread: 1,
            }
        })
        .collect()
}

fn codec(c: &mut Criterion) {
    let evs = events();
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(evs.len() as u64));
    g.bench_function("encode", |b| {
        let mut w = TraceWriter::new(std::io::sink(), &TraceHeader::default()).unwrap();
        b.iter(|| w.write_events(0, black_box(&evs)).unwrap())
    });
    let mut w = TraceWriter::new(Vec::new(), &TraceHeader::default()).unwrap();
    for _ in 0..64 {
        w.write_events(0, &evs).unwrap();
    }
    let (file, _) = w.finish(None).unwrap();
    g.throughput(Throughput::Elements(64 * evs.len() as u64));
    g.bench_function("decode", |b| {
        let mut buf = Vec::new();
        b.iter(|| {
            let mut r = TraceReader::new(&file[..]).unwrap();
            let mut n = 0;
            while r.next_events(&mut buf).unwrap() {
                n += buf.len();
            }
            black_box(n)
        })
    });
    g.finish();
}

criterion_group!(benches, pair, record, codec);
criterion_main!(benches);
