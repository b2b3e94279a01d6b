//! Analyses: each answers one question about a trace (per-phase peaks,
//! request sizes, leak candidates, out-of-memory forensics, where each
//! stream and each pool held memory, what `empty_cache` cost, what CUDA graphs held, when
//! the caching allocator was switched off, how ranks differ) from the
//! allocator state that `state` rebuilds event by event, within the bounds
//! `budget` sets for a whole trace. `analysis` runs them together in one
//! streaming pass; the commands only format what they found.

pub(crate) mod analysis;
pub(crate) mod budget;
pub(crate) mod caching_off;
pub(crate) mod empty_cache;
pub(crate) mod graph_pools;
pub(crate) mod leaks;
pub(crate) mod ooms;
pub(crate) mod phases;
pub(crate) mod pools;
pub(crate) mod range_set;
pub(crate) mod ranks;
pub(crate) mod sizes;
pub(crate) mod state;
pub(crate) mod streams;
