//! gpualloc: a CUDA caching allocator with PyTorch's policy, a simulated
//! device, and a full record of every allocation.
//!
//! # The key design decision
//!
//! The policy never names CUDA. A [`DeviceAllocator`] is generic over a
//! [`Backend`], the few primitives a device offers (allocate, release,
//! events, memory info), so every rule is tested, property-tested,
//! benchmarked and replayed on [`SimBackend`], a simulated device whose
//! streams advance only when a test says so. The CUDA backend (feature
//! `cuda`) is the only code here that may use `unsafe`.
//!
//! # The default policy
//!
//! By default each stream's blocks live in expandable segments: reserved
//! address ranges whose pages come from a pool of physical handles that
//! outlive their mappings (`page_pool.rs`). Rather than hold more memory
//! than the peak of live memory, the allocator maps free pages a second
//! time into a fresh range for a large request (`stitch.rs`) or moves free
//! pages to where the request fits (`expandable.rs`), unmapping a page only
//! once events say the work on it is done (`fence.rs`). Every driver call is
//! counted and costed (`cost.rs`), so a replay predicts time as well as
//! memory. `policy:pytorch` gives PyTorch's rules, described next.
//!
//! # The policy, in PyTorch's words
//!
//! Sizes round up to 512 B (optionally to power-of-two divisions). Requests
//! of at most 1 MiB come from the small pool, carved from 2 MiB segments;
//! requests below 10 MiB get 20 MiB segments; larger ones get a segment of
//! their size rounded to 2 MiB. A request takes the best-fitting cached
//! block *of its own stream* (one free list per stream); the remainder is
//! split off when worth keeping (≥ 512 B small, > 1 MiB large) and blocks of
//! at least `max_split_size` are never split. A freed block merges with its
//! free neighbours in the same segment, never across segments, and is
//! reusable at once on its stream; blocks used on other streams
//! (`record_stream`) wait for an event on each, polled lazily on the
//! allocation path. Before growing, a stream may take another stream's
//! cached block, ordered by an event (Note [Cross-stream reuse] in
//! `device.rs`), which PyTorch never does. When the device is full:
//! release oversize cached blocks and retry; wait for every event, release
//! every unsplit cached segment and retry; then fail with an
//! [`AllocError::OutOfMemory`] that carries the numbers. During CUDA graph
//! capture allocations come from private pools (`capture.rs`).
//!
//! Stats use PyTorch's names ([`DeviceStats`]); fragmentation figures are
//! methods computed from the blocks, never stored.

#![deny(unsafe_code)]
// Nothing in the library may panic on a closed stderr or stdout (`log::say`).
#![cfg_attr(
    not(test),
    deny(clippy::print_stderr, clippy::print_stdout, clippy::dbg_macro)
)]
#![warn(missing_docs)]

pub mod allocator;
pub mod backend;
mod backoff;
mod block;
mod budget;
mod capture;
mod capture_markers;
mod capture_reuse;
mod checkpoint;
pub mod clock;
pub mod config;
pub mod cost;
mod device;
mod drain;
pub mod env_vars;
pub mod error;
mod expandable;
mod fence;
mod free_runs;
mod heap;
mod held;
mod invariants;
mod ipc;
#[cfg(test)]
mod layout_probe;
mod limits;
pub mod log;
pub mod observer;
mod oom;
mod page_pool;
mod pending;
mod plain_requests;
mod pool;
mod private_pool;
mod release;
pub mod replay;
mod replay_pools;
mod rng;
mod segment;
mod segment_source;
mod shares;
pub mod size_class;
mod snapshot;
pub mod stats;
mod stitch;
mod stitch_cache;
mod stitch_repair;
mod stitch_trim;
mod stream_events;
pub mod torch_settings;
pub mod trace;
mod trace_control;
pub mod trace_path;
mod widen;
pub mod workload;

pub use allocator::Allocator;
pub use backend::{
    Backend, BackendError, CaptureNodes, DevicePtr, EventId, GraphNode, MemInfo, SimBackend,
    StreamId,
};
pub use block::BlockState;
pub use checkpoint::{CheckpointBlock, RestoreDelta};
pub use config::{Config, ConfigError};
pub use cost::{CostModel, DriverCall, DriverCalls};
pub use device::DeviceAllocator;
pub use error::{ANY_DEVICE, AllocError, OomReport};
pub use held::Held;
pub use ipc::Sharing;
pub use limits::is_memory_fraction;
pub use observer::{SegmentAction, SegmentEvent, SegmentObserver};
pub use pool::PoolKey;
pub use private_pool::StreamFilter;
pub use segment_source::SegmentSource;
pub use snapshot::{BlockSnapshot, SegmentSnapshot};
pub use stats::{
    DeviceStats, InTorch, STAT_FIELDS, STAT_POOLS, STATS, Stat, StatArray, StatDef, StatKind,
    StatMut, StatValue,
};

/// Cases of a property test: `PROPTEST_CASES` when set, else `default`
/// (what CI runs; long runs set it: README, Fuzzing).
#[cfg(test)]
pub(crate) fn proptest_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}
