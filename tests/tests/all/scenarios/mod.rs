//! One file per rule group of PyTorch's caching allocator (reference §1, §2).

mod best_fit;
mod coalesce;
mod cross_stream;
mod gc;
mod limits;
mod oom;
mod oversize;
mod pools;
mod rounding;
mod split;
