//! Memory limits: the device's capacity and the caps set by configuration
//! or at run time (`set_per_process_memory_fraction`, a byte limit).

use crate::backend::{Backend, BackendError};
use crate::config::Config;
use crate::device::DeviceAllocator;
use crate::error::AllocError;

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
}

impl<B: Backend> DeviceAllocator<B> {
    /// Sets the memory limit as a fraction of device memory
    /// (`set_per_process_memory_fraction`).
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(AllocError::Backend(BackendError::Unavailable(format!(
                "memory fraction {fraction} is not in (0, 1]"
            ))));
        }
        self.limits.fraction = Some(fraction);
        Ok(())
    }

    /// The fraction set by [`set_memory_fraction`](Self::set_memory_fraction), 1.0 when none.
    pub fn memory_fraction(&self) -> f64 {
        self.limits.fraction.unwrap_or(1.0)
    }

    /// Sets (or clears) a memory limit in bytes.
    pub fn set_memory_limit(&mut self, bytes: Option<u64>) {
        self.limits.bytes = bytes;
    }

    /// The memory limit in force, if any: the smaller of the byte limit and
    /// the fraction of device memory.
    pub(crate) fn limit(&mut self) -> Result<Option<u64>, AllocError> {
        let by_fraction = match self.limits.fraction {
            Some(f) if f < 1.0 => Some((self.device_total()? as f64 * f) as u64),
            _ => None,
        };
        Ok(match (by_fraction, self.limits.bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// The most reserved memory may reach: the limit, or the device.
    pub(crate) fn capacity(&mut self) -> Result<u64, AllocError> {
        Ok(match self.limit()? {
            Some(l) => l.min(self.device_total()?),
            None => self.device_total()?,
        })
    }

    /// Device capacity, read once from the backend.
    pub(crate) fn device_total(&mut self) -> Result<u64, AllocError> {
        if let Some(t) = self.limits.total {
            return Ok(t);
        }
        let t = self.backend.mem_info()?.total;
        self.limits.total = Some(t);
        Ok(t)
    }
}
