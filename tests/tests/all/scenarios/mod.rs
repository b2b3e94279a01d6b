//! One file per rule group of PyTorch's caching allocator (reference §1, §2).

mod best_fit;
mod coalesce;
mod cross_stream;
mod empty_cache;
mod gc;
mod graphs;
mod limits;
mod messages;
mod oom;
mod oversize;
mod pools;
mod record_stream;
mod robustness;
mod rounding;
mod split;
mod stats;
mod zero_and_invalid;
