//! Formats: what a trace is turned into (PyTorch's snapshot pickle for
//! MemoryViz, Chrome trace JSON, RMM's CSV columns, Parquet tables) and the
//! logs of other allocators turned into a trace (PyTorch snapshots, RMM
//! logs), so that every analysis and `replay` read them alike.

pub(crate) mod export_chrome;
pub(crate) mod export_csv;
pub(crate) mod export_parquet;
pub(crate) mod export_torch;
pub(crate) mod import_rmm;
pub(crate) mod import_torch;
pub(crate) mod lines;
pub(crate) mod parquet_ranges;
pub(crate) mod parquet_table;
pub(crate) mod pickle;
pub(crate) mod torch_annotations;
pub(crate) mod torch_config;
pub(crate) mod torch_start;
pub(crate) mod torch_stitches;
pub(crate) mod unpickle;
