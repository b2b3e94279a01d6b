//! Memory limits: the device's capacity and the caps set by configuration
//! or at run time (`set_per_process_memory_fraction`, a byte limit).

use crate::backend::{Backend, BackendError};
use crate::config::Config;
use crate::error::AllocError;
use crate::trace::MemoryCap;

/// Whether `x` is a fraction of device memory as PyTorch's
/// `set_per_process_memory_fraction` takes it: in `[0, 1]`, where 0 lets
/// no new memory be reserved (NaN is not). The allocator, the C API and the
/// CLI's reading of recorded caps refuse the same values.
pub fn is_memory_fraction(x: f64) -> bool {
    (0.0..=1.0).contains(&x)
}

/// `fraction` if [`is_memory_fraction`], else the error that names it.
pub(crate) fn check_fraction(fraction: f64) -> Result<(), AllocError> {
    if is_memory_fraction(fraction) {
        Ok(())
    } else {
        Err(AllocError::Backend(BackendError::Unavailable(format!(
            "memory fraction {fraction} is not in [0, 1]"
        ))))
    }
}

/// Device capacity and the caps on reserved memory.
pub(crate) struct Limits {
    /// Device capacity, read once from the backend when needed.
    total: Option<u64>,
    /// Fraction of the device reserved memory may reach.
    fraction: Option<f64>,
    /// Bytes reserved memory may reach.
    bytes: Option<u64>,
}

impl Limits {
    pub fn new(config: &Config) -> Limits {
        Limits {
            total: None,
            fraction: config.memory_fraction,
            bytes: config.memory_limit,
        }
    }

    /// Sets the cap as a fraction of device memory, in `[0, 1]` as PyTorch
    /// takes it (0: no new memory at all, so the next request that needs
    /// some is out of memory, which tests use).
    pub fn set_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        check_fraction(fraction)?;
        self.fraction = Some(fraction);
        Ok(())
    }

    /// The fraction set, 1.0 when none.
    pub fn fraction(&self) -> f64 {
        self.fraction.unwrap_or(1.0)
    }

    /// Sets (or clears) the cap in bytes.
    pub fn set_bytes(&mut self, bytes: Option<u64>) {
        self.bytes = bytes;
    }

    /// The fraction cap as a trace records it.
    pub fn fraction_cap(&self) -> MemoryCap {
        MemoryCap::fraction(self.fraction())
    }

    /// The byte cap as a trace records it.
    pub fn bytes_cap(&self) -> MemoryCap {
        MemoryCap::Bytes(self.bytes)
    }

    /// The caps that differ in effect from those `config` sets (a fraction
    /// of 1.0 is none): those a trace started now must record.
    pub fn set_at_run_time(&self, config: &Config) -> Vec<MemoryCap> {
        let mut caps = Vec::new();
        if self.fraction() != config.memory_fraction.unwrap_or(1.0) {
            caps.push(self.fraction_cap());
        }
        if self.bytes != config.memory_limit {
            caps.push(self.bytes_cap());
        }
        caps
    }

    /// The limit in force, if any: the smaller of the byte limit and the
    /// fraction of device memory.
    pub fn limit(&mut self, backend: &mut impl Backend) -> Result<Option<u64>, AllocError> {
        let by_fraction = match self.fraction {
            Some(f) if f < 1.0 => Some((self.device_total(backend)? as f64 * f) as u64),
            _ => None,
        };
        Ok(match (by_fraction, self.bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// The most reserved memory may reach: the limit, or the device.
    pub fn capacity(&mut self, backend: &mut impl Backend) -> Result<u64, AllocError> {
        let total = self.device_total(backend)?;
        Ok(self.limit(backend)?.map_or(total, |l| l.min(total)))
    }

    /// Device capacity, read once from the backend.
    pub fn device_total(&mut self, backend: &mut impl Backend) -> Result<u64, AllocError> {
        if let Some(t) = self.total {
            return Ok(t);
        }
        let t = backend.mem_info()?.total;
        self.total = Some(t);
        Ok(t)
    }
}
