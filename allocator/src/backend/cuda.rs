//! The CUDA driver backend (being written).
