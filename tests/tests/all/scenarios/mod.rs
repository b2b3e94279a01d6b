//! One file per rule group of PyTorch's caching allocator (reference §1, §2).
//!
//! The scenarios were written when the default configuration was PyTorch's
//! rules plus gpualloc's cross-stream reuse. They name that configuration:
//! `policy:pytorch,cross_stream_reuse:true` (plain segments, cross-stream
//! reuse on), followed by the keys each test is about. The default policy
//! (`policy:gpualloc`: expandable segments, page pool, defragmentation) is
//! covered by the property tests, and by the files below whose rules hold
//! under both policies (see `under_both_policies!`).

/// Defines a `#[test]` for each listed function `fn(policy: &str)` twice:
/// in `pytorch`, with `policy:pytorch,cross_stream_reuse:true`, and in
/// `gpualloc_policy`, with `policy:gpualloc` (the default). The functions
/// build their configuration string from `policy` and their own keys.
macro_rules! under_both_policies {
    ($($name:ident),* $(,)?) => {
        mod pytorch {
            $(
                #[test]
                fn $name() {
                    super::$name("policy:pytorch,cross_stream_reuse:true")
                }
            )*
        }
        mod gpualloc_policy {
            $(
                #[test]
                fn $name() {
                    super::$name("policy:gpualloc")
                }
            )*
        }
    };
}

mod best_fit;
mod coalesce;
mod cross_stream;
mod deferred_unmap;
mod empty_cache;
mod faults;
mod gc;
mod graphs;
mod graphs_expandable;
mod limits;
mod messages;
mod oom;
mod oversize;
mod pool_checkpoint;
mod pool_options;
mod pools;
mod record_stream;
mod robustness;
mod rounding;
mod served_pools;
mod sharing;
mod split;
mod stats;
mod tracing;
mod zero_and_invalid;
