//! One file per rule group of PyTorch's caching allocator (reference §1, §2).

mod best_fit;
mod cross_stream;
