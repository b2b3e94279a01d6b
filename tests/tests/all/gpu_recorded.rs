//! The traces in `examples/` were recorded on an H200 by
//! `bash tests/gpu/bench.sh` (torch 2.11, 60 training steps, gpualloc's
//! default policy: page pool, defragmentation, stitching). Replaying one
//! with the configuration it was recorded with must reproduce the peaks
//! that PyTorch read from gpualloc on the GPU (`torch.cuda.max_memory_reserved`
//! and `max_memory_allocated`, in that run's `bench.json`), to the byte:
//! every decision of the policy depends only on the calls and the times the
//! trace stamps them with, never on how far the GPU had come (Note
//! [Event-ordered unmapping], Note [One clock for decisions and traces]). Under `policy:pytorch`
//! the same calls reserve what PyTorch's own allocator reserved on the GPU
//! in the same run. The YOLO-style trace was recorded again with the
//! library of commit 9d6cd2c (`docs/results/h200-round6/`), the detector
//! and ResNet-50 traces with the library of f6e80e5 (widening to pooled
//! handles, the reclaim order: `docs/results/h200-round14/`); the GPT-2 trace,
//! recorded earlier, replays to the same peaks under both.
//!
//! Round 40 took the largest free runs first when moving pages (Note
//! [Reclaim order] in `allocator/src/free_runs.rs`), which changes the
//! decisions on most traces. The detector, ResNet-50 and Ultralytics YOLO
//! workloads ran again on the H200 with that order and PyTorch read the
//! peaks these replays give, to the byte
//! (`docs/results/h200-round40/bench-resnet-detector-60-largest-first.json`,
//! `yolo-largest-first.json`). The other figures below are today's
//! replays; each test says what the GPU read under the order its trace was
//! recorded with, which the replay reached then.

use std::path::PathBuf;

use gpualloc::Config;
use gpualloc::replay::{ReplayResult, replay};
use gpualloc::trace::TraceEvent;
use gpualloc::trace::reader::TraceReader;

/// H200 memory as `nvidia-smi` reports it (143771 MiB). The driver's own
/// total (`cudaMemGetInfo`, `total_memory`), which a fraction is taken of,
/// is [`H200_TOTAL`]; no trace but the capped one comes near either.
const H200: u64 = 143_771 << 20;
/// H200 memory as `torch.cuda.get_device_properties(0).total_memory` read
/// it in round 28, and as gpualloc's driver backend read it in the same run
/// (a replay on this capacity fails the recorded requests of a fraction).
const H200_TOTAL: u64 = 150_109_880_320;

/// The recorded configuration and the events of `examples/NAME`, read whole.
fn example(name: &str) -> (String, Vec<TraceEvent>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name);
    let mut r = TraceReader::open(&path).expect("the example trace opens");
    let events: Vec<_> = r.events().collect();
    assert!(r.error().is_none(), "{:?}", r.error());
    assert!(r.end().is_some(), "the recording was stopped cleanly");
    (r.header().config.clone(), events)
}

/// The replay of `examples/NAME` on an H200 under `config` (default: the
/// recorded one).
fn replayed(name: &str, config: Option<&str>) -> ReplayResult {
    let (recorded, events) = example(name);
    let config = Config::parse(config.unwrap_or(&recorded)).expect("the configuration parses");
    replay(events.into_iter(), H200, &config)
}

/// Peak reserved, peak allocated and failed requests of [`replayed`].
fn replay_example(name: &str, config: Option<&str>) -> (u64, u64, u64) {
    let out = replayed(name, config);
    (out.peak_reserved, out.peak_allocated, out.ooms)
}

/// Asserts that `examples/NAME`, replayed as recorded, reaches the peaks
/// (reserved, allocated) the GPU read, fails nothing, and makes the memory
/// calls the CUDA backend counted.
fn replays_to_the_gpus(name: &str, peaks: (u64, u64), calls: u64) {
    let out = replayed(name, None);
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (peaks.0, peaks.1, 0),
        "{name}"
    );
    assert_eq!(out.driver.memory_calls(), calls, "{name}");
}

#[test]
fn gpt2_trace_replays_to_the_peaks_measured_on_the_gpu() {
    assert_eq!(
        replay_example("gpt2-varlen.gtrace", None),
        (8_105_492_480, 8_050_975_232, 0)
    );
    // PyTorch's allocator on the GPU in the same run: 12,494,831,616 B
    // reserved (R/A 1.546), from the same calls.
    let (reserved, allocated, ooms) = replay_example("gpt2-varlen.gtrace", Some("policy:pytorch"));
    assert_eq!((reserved, ooms), (12_494_831_616, 0));
    assert!(allocated >= 8_050_975_232);
}

#[test]
fn detector_trace_replays_to_the_peaks_measured_on_the_gpu() {
    // Recorded with the library of f6e80e5 in
    // `docs/results/h200-round14/bench-resnet-detector.json`, which read
    // 2,707,423,232 B reserved (the library before it 2,724,200,448 B in
    // round 9); round 40's reclaim order read 2,717,908,992 B, and so did
    // three runs on an H100 in round 75 (`docs/results/h100-round75/`).
    // Round 75's rule that builds a stitch rather than wait to repair a part
    // the last repair put in (Note [Stitching]) gives this replay; the same
    // workload read 2,705,326,080–2,709,520,384 B under it on the H100
    // (untraced runs, whose budget decisions follow their own clocks).
    assert_eq!(
        replay_example("detector-multiscale.gtrace", None),
        (2_703_228_928, 2_629_305_344, 0)
    );
    // PyTorch's own allocator on the GPU (round 6's run of the same
    // calls: every run of this workload allocates the same sizes in the
    // same order, and its peak allocated is the same to the byte).
    let (reserved, _, ooms) = replay_example("detector-multiscale.gtrace", Some("policy:pytorch"));
    assert_eq!((reserved, ooms), (4_823_449_600, 0));
}

/// `examples/ultralytics-yolo.gtrace`: a real third-party training library,
/// recorded on the H200 by `bash tests/gpu/yolo.sh --variants gpualloc-traced`
/// (Ultralytics YOLOv8n, 3 epochs of multi-scale training on synthetic
/// images, batch 32, with validation) under the default policy, with the
/// library of fd9d5af (one clock for the budget and the trace). Its GPU
/// peaks, read by `torch.cuda.max_memory_*` in that run
/// (`docs/results/h200-round8/yolo-traced.json`: 2,151,677,952 B
/// reserved, R/A 1.0172), were what the replay reached, to the byte. With
/// round 40's reclaim order the GPU read 2,132,803,584 B (R/A 1.0083,
/// `docs/results/h200-round40/yolo-largest-first.json`), as the replay.
#[test]
fn ultralytics_trace_replays_to_the_peaks_measured_on_the_gpu() {
    assert_eq!(
        replay_example("ultralytics-yolo.gtrace", None),
        (2_132_803_584, 2_115_307_008, 0)
    );
}

/// `examples/gpt2-generate.gtrace`: inference, not training: transformers
/// GPT-2 small generating 64 tokens greedily for eight batches of 4–32
/// prompts (a KV cache growing a token at a time), recorded by `bash
/// tests/gpu/sweep.sh --only generate --variants gpualloc-traced` with the
/// library of e4177a1 (`docs/results/h200-round12/sweep-generate-traced.json`).
/// The replay reached the GPU's peaks to the byte (1,218,445,312 B
/// reserved) and made the 867 memory calls the CUDA backend counted; with
/// round 40's reclaim order it reserves less.
#[test]
fn generation_trace_replays_to_the_gpus_peaks_and_memory_calls() {
    let out = replayed("gpt2-generate.gtrace", None);
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (1_210_056_704, 1_111_098_368, 0)
    );
    assert_eq!(out.driver.memory_calls(), 860);
}

/// `examples/reduce-overhead-graphs.gtrace`: `torch.compile(mode=
/// "reduce-overhead")` training on three sequence lengths (CUDA graphs
/// captured into one private pool by cudagraph trees, which also take
/// checkpoints of it: 11 records of 6 distinct ones, as the C ABI then
/// recorded a checkpoint again when PyTorch asked twice for a buffer),
/// recorded by `bash tests/gpu/sweep.sh --only reduce_overhead --variants
/// gpualloc-traced` with the library of f8072dd
/// (`docs/results/h200-round13/sweep-reduce-overhead-f8072dd.json`). The
/// trace holds the calls on private pools, and the replay sends each
/// allocation to the pool that served it: the GPU's peaks to the byte and
/// its 1,175 memory calls. Without the pool calls (as the replay read every
/// trace before they were recorded), graph memory lands in the default
/// pools, which defragment it: another peak, and twice the calls.
#[test]
fn a_cuda_graph_trace_replays_to_the_gpus_peaks_and_memory_calls() {
    let out = replayed("reduce-overhead-graphs.gtrace", None);
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (2_134_900_736, 2_006_201_344, 0)
    );
    assert_eq!(out.driver.memory_calls(), 1_175);
    let (config, events) = example("reduce-overhead-graphs.gtrace");
    let without = events
        .into_iter()
        .filter(|e| e.action != gpualloc::trace::Action::PrivatePool);
    let out = replay(without, H200, &Config::parse(&config).unwrap());
    assert_ne!(out.peak_reserved, 2_134_900_736);
    let calls = out.driver.memory_calls();
    assert!(calls > 3 * 1_175 / 2, "{calls}");
}

/// `examples/graph-branches-restores.gtrace`: two `torch.compile(mode=
/// "reduce-overhead")` graphs a step, the second on one of three lengths,
/// recorded by `bash tests/gpu/sweep.sh --only graph_branches --variants
/// gpualloc-traced` with the library of c98652a
/// (`docs/results/h200-round13/sweep-graph-branches-c98652a.json`):
/// cudagraph trees record branches of one tree, take 10 checkpoints and
/// put their pool back to one 4 times (`setCheckpointPoolState`). The replay takes and restores the
/// same checkpoints: the GPU's peaks to the byte (its 1,190 memory calls
/// under the reclaim order it was recorded with, 1,198 under round 40's).
#[test]
fn a_cuda_graph_tree_with_restores_replays_to_the_gpus_peaks_and_memory_calls() {
    use gpualloc::trace::{Action, EventKind, PoolOp};
    let (config, events) = example("graph-branches-restores.gtrace");
    let restores = events
        .iter()
        .filter(|e| {
            matches!(e.kind(), EventKind::PrivatePool { op: PoolOp::Restore, checkpoint, .. } if checkpoint != u64::MAX)
        })
        .count();
    assert_eq!(restores, 4);
    let out = replay(
        events.iter().copied(),
        H200,
        &Config::parse(&config).unwrap(),
    );
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (1_130_364_928, 996_706_304, 0)
    );
    assert_eq!(out.driver.memory_calls(), 1_198);
    // Without the pool calls, graph memory lands in the default pools.
    let without = events
        .into_iter()
        .filter(|e| e.action != Action::PrivatePool);
    let out = replay(without, H200, &Config::parse(&config).unwrap());
    assert_ne!(
        (out.peak_reserved, out.driver.memory_calls()),
        (1_130_364_928, 1_198)
    );
}

/// `examples/resnet50.gtrace`: ResNet-50, batch 128, 60 steps, recorded
/// by `bash tests/gpu/bench.sh --variants gpualloc-traced` with the library
/// of f6e80e5 (`docs/results/h200-round14/bench-resnet-detector.json`:
/// 6,251,610,112 B reserved; 6,266,290,176 B with 4f53d2a in round 10).
/// It replays to the GPU's peaks (6,239,027,200 B with round 40's reclaim
/// order, on the GPU as in the replay); and since its layouts repeat, a cached stitch that
/// repairs keep changing gets a second stitch instead (Note [Stitching]):
/// after warm-up the replay makes no memory call at all, as PyTorch's
/// expandable segments make none.
#[test]
fn resnet_trace_replays_to_the_gpus_peaks_and_is_silent_after_warm_up() {
    let whole = replayed("resnet50.gtrace", None);
    assert_eq!(
        (whole.peak_reserved, whole.peak_allocated, whole.ooms),
        (6_239_027_200, 6_146_379_776, 0)
    );
    let whole = whole.driver.memory_calls();
    let (config, events) = example("resnet50.gtrace");
    let config = Config::parse(&config).unwrap();
    // Steps begin with the optimizer's phase, the last phase of a step.
    let phase = |e: &gpualloc::trace::TraceEvent| match e.kind() {
        gpualloc::trace::EventKind::PhasePush { name } => Some(name),
        _ => None,
    };
    let optimizer = events
        .iter()
        .rev()
        .find_map(phase)
        .expect("phases recorded");
    let starts: Vec<usize> = (0..events.len())
        .filter(|&i| phase(&events[i]) == Some(optimizer))
        .collect();
    assert_eq!(starts.len(), 60, "one optimizer phase a step");
    let calls_until = |step: usize| {
        let out = replay(events[..starts[step]].iter().copied(), H200, &config);
        out.driver.memory_calls()
    };
    assert!(calls_until(12) > 0);
    assert_eq!(calls_until(20), whole, "memory calls after step 20");
}

/// `examples/yolo-style-oom.gtrace` (README's first command): recorded on
/// the H200 by `tests/gpu/record_example.py` under `memory_limit:1700MiB`,
/// with automatic steps and phases, ending in an out-of-memory error. The
/// replay under the recorded configuration with the policy it was
/// recorded with (the headroom kept at 0.5% as the limit nears,
/// `defragment_pressure:1`) reaches the recorded peaks and fails the same
/// request; today's default fits the run under the same limit (Note
/// [Headroom under pressure]).
#[test]
fn yolo_style_trace_replays_to_its_peaks_and_its_oom() {
    assert_eq!(
        replay_example(
            "yolo-style-oom.gtrace",
            Some("memory_limit:1700MiB,defragment_pressure:1")
        ),
        // 1,767,899,136 B reserved under the reclaim order it was recorded
        // with, the GPU's figure; the same request fails under both.
        (1_772_093_440, 1_705_659_392, 1)
    );
    let (_, _, ooms) = replay_example("yolo-style-oom.gtrace", None);
    assert_eq!(ooms, 0, "the default fails the run under its limit");
    let (config, events) = example("yolo-style-oom.gtrace");
    assert_eq!(config, "memory_limit:1700MiB");
    let count = |a: gpualloc::trace::Action| events.iter().filter(|e| e.action == a).count();
    assert_eq!(
        count(gpualloc::trace::Action::Mark),
        36,
        "one mark per optimizer step"
    );
    assert!(count(gpualloc::trace::Action::PhasePush) > 100);
    assert_eq!(count(gpualloc::trace::Action::Oom), 1);
}

#[test]
fn a_capacity_beyond_any_device_replays_as_one_pebibyte() {
    let (_, events) = example("yolo-style-oom.gtrace");
    let config = Config::parse("").unwrap();
    for capacity in [1 << 60, u64::MAX] {
        let out = replay(events.iter().cloned(), capacity, &config);
        assert_eq!(out.capacity, gpualloc::config::MAX_BYTES);
        assert!(out.peak_reserved > 0 && out.ooms == 0, "{out:?}");
    }
}

/// `examples/fsdp2-gpt2.gtrace` and `examples/four-streams.gtrace`: FSDP2
/// (`fully_shard`, one process) training GPT-2 small on random lengths, and
/// a CNN whose four branches run on four streams, recorded by `bash
/// tests/gpu/sweep.sh --only fsdp,multi_stream --variants gpualloc-traced`
/// with the library of 5d1dd67
/// (`docs/results/h200-round32/sweep-fsdp-multistream-recorded-5d1dd67.json`):
/// they replayed to the GPU's peaks (1.0128x and 1.0059x: 4,190,109,696
/// and 20,201,865,216 B reserved) and to all of its memory calls (4,724
/// and 8,754); round 40's reclaim order reserves 1.0173x and 1.0049x,
/// with 4,876 and 8,568 calls, and round 41's (the smallest runs first
/// while the stitch budget has no credit) 1.0173x and 1.0063x, with 4,876
/// and 8,814 calls. The recordings before (f6e80e5 and round 27) were made
/// before the defragmentation budget stopped letting the peak of reserved
/// memory rise (Note [Defragmentation budget]) and before pooled handles a
/// mapping cannot use went back first (Note [Spare handles at the
/// high-water mark]); their replays predicted 2 and 4 MiB less than those
/// GPUs reserved, and the GPU runs of 5d1dd67 reserved exactly that.
/// The library before Note [Widening to pooled handles] and Note [Reclaim
/// order] reserved 1.089x and 1.049x their peak allocated on the GPU;
/// f6e80e5 1.013x and 1.020x; with the stitch budget the four streams
/// 1.006x.
#[test]
fn multi_stream_traces_replay_to_the_gpus_peaks() {
    for (name, peaks, calls) in [
        ("fsdp2-gpt2.gtrace", (4_208_984_064, 4_137_244_672), 4_876),
        (
            "four-streams.gtrace",
            (20_210_253_824, 20_083_987_968),
            8_814,
        ),
    ] {
        replays_to_the_gpus(name, peaks, calls);
    }
}

/// `examples/promise-budget.gtrace`: the GPU check of the promise (`bash
/// tests/gpu/run.sh --only promise`, variant `gpualloc-traced`, library of
/// f6d54e1: `docs/results/h200-round42/`; first recorded with 6e9720f in
/// round 28, before traces carried the device's total). The check
/// caps the process at 6 GiB with `set_per_process_memory_fraction` after
/// the trace started, fragments it on two streams and asks for what the
/// bounds say is free, and for more: 87 requests failed on the GPU. The
/// cap is in the trace (a `memory_limit` record), so a replay on a device
/// of the driver's total ([`H200_TOTAL`], whose share the check asked
/// for; on `nvidia-smi`'s larger figure 52 fail) fails the same 87 and reaches the GPU's peaks to the
/// byte; without the record nothing fails. The trace names that total, so
/// `gpualloc replay` on another capacity warns with the `--capacity` that
/// reproduces the cap.
#[test]
fn a_cap_set_while_running_replays_to_the_gpus_failures() {
    let (recorded, events) = example("promise-budget.gtrace");
    let config = Config::parse(&recorded).unwrap();
    let out = replay(events.iter().cloned(), H200_TOTAL, &config);
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (6_442_450_944, 6_441_107_968, 87)
    );
    let uncapped = events
        .into_iter()
        .filter(|e| e.action != gpualloc::trace::Action::MemoryLimit);
    assert_eq!(replay(uncapped, H200_TOTAL, &config).ooms, 0);
}

/// `examples/moe-varlen.gtrace`: a mixture-of-experts language model whose
/// eight experts each take the rows routed to them, so activations of new
/// sizes come and go in every layer of every step; recorded by `bash
/// tests/gpu/sweep.sh --only moe` (variant `gpualloc-traced`) with the
/// library of b8d12fb (`docs/results/h200-round15/sweep-moe.json`). It
/// replayed to the GPU's peaks and memory calls (10,515,120,128 B reserved,
/// R/A 1.0132, and 6,672 calls; PyTorch's allocator 2.010, its expandable
/// segments 1.070 in the same run); round 40's reclaim order reserves less
/// (R/A 1.0094).
#[test]
fn moe_trace_replays_to_the_gpus_peaks() {
    let out = replayed("moe-varlen.gtrace", None);
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (10_475_274_240, 10_377_710_592, 0)
    );
    assert_eq!(out.driver.memory_calls(), 6_350);
}

/// `examples/hf-trainer-gpt2.gtrace`: a real third-party training library,
/// the Hugging Face `Trainer` on a randomly initialised GPT-2 small with
/// dynamic padding, 40 steps, recorded by `bash tests/gpu/trainers.sh
/// --libraries hf --variants gpualloc-traced` with the library of 78afeb7
/// (`docs/results/h200-round14/trainers-hf-traced-78afeb7.json`). It
/// replayed to the GPU's peaks (19,352,518,656 B reserved, R/A 1.0048;
/// PyTorch expandable's 1.0722); round 40's reclaim order holds 2 MiB more.
#[test]
fn a_hugging_face_trainer_trace_replays_to_the_gpus_peaks() {
    let out = replayed("hf-trainer-gpt2.gtrace", None);
    assert_eq!(
        (out.peak_reserved, out.peak_allocated, out.ooms),
        (19_354_615_808, 19_260_850_176, 0)
    );
}

/// `examples/bert-checkpoint-amp.gtrace`, `examples/lstm-varlen.gtrace` and
/// `examples/resnet50-empty-cache.gtrace`: three of the sweep's workloads
/// (transformers BERT-base with gradient checkpointing and bf16 autocast on
/// random lengths; a cuDNN LSTM on random batch sizes and lengths; ResNet-50
/// calling `torch.cuda.empty_cache()` after every step), recorded by `bash
/// tests/gpu/sweep.sh --only checkpoint_amp,lstm_varlen,empty_cache
/// --variants gpualloc-traced` with the library of b1ddfe7
/// (`docs/results/h200-round43/sweep-traced-b1ddfe7.json`). Each replays to
/// the GPU's peaks to the byte and to the memory calls the CUDA backend
/// counted (2,548 and 24,851), but for the LSTM's: two more than its 977,
/// moving no peak. No decision differs there: after every call the replay
/// has mapped the same bytes as the recording (forty-first study), so the
/// two are in how the calls were counted, not in memory. (The generation
/// trace's 860 against 867 do come from decisions: it was recorded before
/// round 40's reclaim order, whose largest runs first it now follows.)
/// The last gives its memory back at every step and creates it again
/// (Note [Regrowth]).
///
/// And `examples/cudnn-benchmark.gtrace`: the sweep's ResNet-50 with
/// `torch.backends.cudnn.benchmark` on (bf16, channels-last, six input
/// sizes drawn at random), recorded by `bash tests/gpu/sweep.sh --only
/// cudnn_benchmark --variants native-expandable,gpualloc-traced,gpualloc`
/// with the library of b1ddfe7 (`docs/results/h200-round44/`). cuDNN
/// empties the cache after timing each new convolution shape: 408
/// `empty_cache` calls give back 30.6 GiB, nearly all created again. It
/// replays to the GPU's peaks (R/A 1.0097; PyTorch expandable's 1.019) and
/// to the 13,843 memory calls the CUDA backend counted.
#[test]
fn sweep_traces_replay_to_the_gpus_peaks_and_memory_calls() {
    for (name, peaks, calls) in [
        (
            "bert-checkpoint-amp.gtrace",
            (4_424_990_720, 4_282_565_632),
            2_548,
        ),
        ("lstm-varlen.gtrace", (3_139_436_544, 3_035_600_896), 979),
        (
            "resnet50-empty-cache.gtrace",
            (3_208_642_560, 3_140_111_872),
            24_851,
        ),
        (
            "cudnn-benchmark.gtrace",
            (4_791_992_320, 4_745_740_288),
            13_843,
        ),
    ] {
        replays_to_the_gpus(name, peaks, calls);
    }
}

/// `examples/compile-dynamic.gtrace`: the sweep's `torch.compile(model,
/// dynamic=True)` of a six-layer GPT on random lengths 64–512 (the compile
/// is round 0), recorded by `bash tests/gpu/sweep.sh --only compile_dynamic
/// --variants gpualloc-traced` with the library of 5c97f93
/// (`docs/results/h200-round48/`): R/A 1.031 on the GPU; it replays to the
/// peaks it recorded there (`gpualloc summary` of the trace) to the byte. The run's own count of memory calls did not come
/// back from the GPU machine, so only the replay's stands here (1,323).
/// Under PyTorch's rules the same calls reserve 5,530,189,824 bytes for
/// 3,187,291,136 allocated (R/A 1.735; its rounding allocates more).
#[test]
fn compile_dynamic_trace_replays_to_the_gpus_peaks() {
    assert_eq!(
        replay_example("compile-dynamic.gtrace", None),
        (3_277_848_576, 3_178_181_632, 0)
    );
    let out = replayed("compile-dynamic.gtrace", None);
    assert_eq!(out.driver.memory_calls(), 1_323);
    assert_eq!(
        replay_example("compile-dynamic.gtrace", Some("policy:pytorch")),
        (5_530_189_824, 3_187_291_136, 0)
    );
}

/// What reserved memory is made of at its peak (Note [Held memory by
/// unit]). Under gpualloc's default, ResNet-50 and the detector hold no
/// free handle and nothing pooled there: every byte over allocated memory
/// lies beside a live block, in a handle that block keeps. Under PyTorch's
/// rules most of it is whole free segments, the cache. The graph-branch
/// trace's free memory at its peak is its graphs' private pool.
#[test]
fn what_reserved_memory_is_made_of_at_its_peak() {
    for (name, config, (used, beside, free, private)) in [
        ("resnet50.gtrace", None, (6_239_027_200, 92_647_424, 0, 0)),
        (
            "resnet50.gtrace",
            Some("policy:pytorch"),
            (1_417_674_752, 1_081_876_480, 6_983_516_160, 0),
        ),
        (
            "detector-multiscale.gtrace",
            None,
            (2_703_228_928, 73_949_696, 0, 0),
        ),
        (
            "graph-branches-restores.gtrace",
            None,
            (564_133_888, 4_526_080, 0, 566_231_040),
        ),
    ] {
        let out = replayed(name, config);
        let [d] = &out.devices[..] else {
            panic!("{name}: one device")
        };
        let h = d.held_at_peak_reserved;
        assert_eq!(h.total(), d.peak_reserved, "{name} {config:?}: {h:?}");
        assert_eq!(
            (
                h.used_units,
                h.used_units - d.allocated_at_peak_reserved,
                h.free_units,
                h.free_private_units,
                h.pooled
            ),
            (used, beside, free, private, 0),
            "{name} {config:?}"
        );
    }
}

/// `examples/resnet50-batch4.gtrace` and `examples/detector-batch1.gtrace`:
/// the benchmark's ResNet-50 and multi-scale detector on small footprints
/// (batch 4 and batch 1: 476 and 356 MiB at their peaks, where the
/// default's headroom is about one 2 MiB page or less), recorded on an H100
/// by `bash tests/gpu/bench.sh --only
/// train_resnet_small,train_detector_small --variants
/// native-expandable,gpualloc,gpualloc-traced,native` with the library of
/// 6a3f788 (`docs/results/h100-round53/bench-small-6a3f788.json`). Each
/// replays to the GPU's peaks and to the memory calls the CUDA backend
/// counted, to the byte and the call (the traced and untraced runs of both
/// repeats agreed); under PyTorch's rules the same calls reserve what
/// PyTorch's own allocator did in the same run. R/A 1.060 and 1.058,
/// against PyTorch expandable's 1.077 and 1.125 (forty-first study).
#[test]
fn small_footprint_traces_replay_to_the_gpus_peaks_and_memory_calls() {
    for (name, peaks, calls, pytorch) in [
        (
            "resnet50-batch4.gtrace",
            (528_482_304, 498_667_008),
            647,
            (545_259_520, 507_792_896),
        ),
        (
            "detector-batch1.gtrace",
            (394_264_576, 372_770_816),
            838,
            (442_499_072, 375_281_664),
        ),
    ] {
        replays_to_the_gpus(name, peaks, calls);
        assert_eq!(
            replay_example(name, Some("policy:pytorch")),
            (pytorch.0, pytorch.1, 0),
            "{name}"
        );
    }
}

/// Traces recorded on the GPU by the policy of today (since round 43):
/// replayed under their recorded configuration, each obtains the memory
/// its recording did after every allocation, not only at the peaks
/// (no `Departure`). Most older traces were recorded before round 40's
/// reclaim order and depart from their recordings somewhere on the way
/// (forty-first study in `docs/policy-experiments.md`).
#[test]
fn recordings_of_todays_policy_obtain_what_the_gpu_did_after_every_call() {
    for name in [
        "bert-checkpoint-amp.gtrace",
        "lstm-varlen.gtrace",
        "resnet50-empty-cache.gtrace",
        "cudnn-benchmark.gtrace",
        "compile-dynamic.gtrace",
        "resnet50-batch4.gtrace",
        "detector-batch1.gtrace",
    ] {
        assert_eq!(replayed(name, None).departure, None, "{name}");
    }
    // The detector's trace, recorded before round 40's reclaim order: the
    // replay first maps other pages 2,567 events in, 12 MiB more than the
    // recording had by then.
    let d = replayed("detector-multiscale.gtrace", None)
        .departure
        .expect("the older trace departs");
    assert_eq!(
        (d.event_index, d.replayed, d.recorded),
        (2567, 931_135_488, 918_552_576)
    );
}

/// Five workloads the benchmark never tuned for, three of them from
/// libraries new to the project, recorded on an H100 by `bash
/// tests/gpu/sweep.sh --only gnn,lora,accelerate,speech_ctc,t5_adafactor
/// --variants native,native-expandable,gpualloc,gpualloc-traced` with the
/// library of 2dc484d (`docs/results/h100-round54/sweep/` and `sweep2/`):
/// torch_geometric message passing on a new random graph every step
/// (`examples/gnn-random-graphs.gtrace`), peft LoRA over a frozen bf16
/// Llama with gradient checkpointing and dynamic padding
/// (`lora-llama.gtrace`), accelerate's bf16 gradient accumulation over
/// random image sizes (`accelerate-convnext.gtrace`), and from
/// transformers wav2vec2 CTC on raw audio of random lengths
/// (`speech-ctc.gtrace`) and T5 with Adafactor on random source and target
/// lengths (`t5-adafactor.gtrace`). Each replayed to its traced GPU run's
/// peaks and to the memory calls the CUDA backend counted, never
/// departing from what the recording obtained; four still do (LoRA
/// changed in round 75, below). Under PyTorch's rules the
/// same calls reserve, to the byte, what PyTorch's own allocator reserved
/// in the same sweep (3.02x the live peak on the graphs), but for two:
/// wav2vec2's replay reserves 10,741,612,544 B, 2 MiB more than PyTorch's
/// run (10,739,515,392), and peaks at 5,798,040,064 B allocated against its
/// 5,802,906,112, so that run made other calls (cause not established; the
/// test holds the replay's own figure). Accelerate's replay reserves
/// PyTorch's figure but peaks 229,376 B below its allocated one.
/// Since round 75 a repair that would replace a busy part the last repair
/// put in builds a stitch instead (Note [Stitching] in
/// `allocator/src/stitch.rs`), which changes LoRA's replay: it departs from
/// its recording at event 46,363 and makes 2,078 memory calls for the
/// same peaks (its run counted 1,965).
#[test]
fn third_party_library_traces_replay_to_the_gpus_peaks_and_memory_calls() {
    for (name, peaks, calls, pytorch_reserved) in [
        (
            "gnn-random-graphs.gtrace",
            (9_577_693_184, 9_525_497_856),
            2646,
            28_795_994_112,
        ),
        (
            "lora-llama.gtrace",
            (3_781_165_056, 3_723_684_864),
            2078,
            4_680_843_264,
        ),
        (
            "accelerate-convnext.gtrace",
            (3_927_965_696, 3_895_440_896),
            3119,
            4_768_923_648,
        ),
        (
            "speech-ctc.gtrace",
            (5_792_333_824, 5_754_539_520),
            12_740,
            10_741_612_544,
        ),
        (
            "t5-adafactor.gtrace",
            (3_586_129_920, 3_467_462_656),
            2977,
            4_355_784_704,
        ),
    ] {
        replays_to_the_gpus(name, peaks, calls);
        let departs = name == "lora-llama.gtrace";
        let departure = replayed(name, None).departure;
        assert_eq!(departure.is_some(), departs, "{name}: {departure:?}");
        let (reserved, _, ooms) = replay_example(name, Some("policy:pytorch"));
        assert_eq!((reserved, ooms), (pytorch_reserved, 0), "{name}");
    }
}
