//! Integration tests of gpualloc on the simulated device: one binary.
//!
//! - `properties`: random operation sequences under several configurations,
//!   with every invariant, the accounting and stream safety checked after
//!   each operation;
//! - `promise`: the default policy never fails a request for fragmentation;
//! - `scenarios`: one file per rule of PyTorch's caching allocator;
//! - `segment_events`: segment events announce exactly the backed memory;
//! - `listed_trace`: a trace lists the snapshot's segments, each byte once;
//! - `stitch_safety`: stitch repair waits for the stitch's queued work;
//! - `docs`: `docs/configuration.md` lists exactly the code's keys and
//!   environment variables, with the code's defaults;
//! - `examples`: the C example builds and runs on the simulated device;
//! - `graph_replay`: a program with CUDA graph captures replays exactly;
//! - `pool_option_properties`: random programs with a pool served by another
//!   allocator and a pool that lends on out-of-memory;
//! - `replay_fuzz`: the replay takes any sequence of records without panicking.

mod docs;
mod examples;
mod fault_properties;
mod follow_properties;
mod fuzz_config;
mod gpu_recorded;
mod graph_isolation;
mod graph_replay;
mod listed_trace;
mod pool_option_properties;
mod promise;
mod promise_adversarial;
mod properties;
mod replay_fuzz;
mod scenarios;
mod segment_events;
mod stitch_safety;
mod structure;
