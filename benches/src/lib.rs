//! gpualloc's micro-benchmarks (criterion), all on the simulated device.
//!
//! # The key decision: measure the policy, not the driver
//!
//! A CUDA allocation costs microseconds and a cache hit tens of nanoseconds;
//! what gpualloc controls is the cache hit. Every benchmark therefore runs the
//! real [`gpualloc::DeviceAllocator`] over [`gpualloc::SimBackend`], whose
//! calls cost nothing, so the numbers are the policy's own: the alloc+free
//! pair with 0 to 100k live blocks (`benches/alloc.rs`), mixed-size churn,
//! split/coalesce, threads sharing one device's lock, the cost tracing
//! adds (`benches/trace.rs`) and what logging costs when off (`benches/log.rs`). The GPU-side comparison with PyTorch's allocator
//! lives in `tests/gpu/` (`churn`, training step times), because it needs torch.
