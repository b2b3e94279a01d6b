//! The process-wide allocator: backend chosen at run time, created once.
//!
//! `GPUALLOC_BACKEND=sim` selects the simulated device (capacity
//! `GPUALLOC_SIM_CAPACITY`, default 80GiB; `GPUALLOC_SIM_DEVICES` devices,
//! default 1); unset or `cuda` selects the CUDA driver. The configuration is
//! the string given to `gpualloc_init`, else `GPUALLOC_CONF`. A bad value is
//! an error returned by every call until a good `gpualloc_init`; never an abort.

use std::sync::OnceLock;

use gpualloc::backend::cuda::{self, CudaBackend};
use gpualloc::backend::{
    Backend, BackendError, DevicePtr, DriverCalls, EventId, HandleId, MemInfo, StreamId,
};
use gpualloc::{Allocator, Config, SimBackend};
use parking_lot::Mutex;

use crate::boundary::{
    Error, GPUALLOC_ERR_ALREADY_INITIALIZED, GPUALLOC_ERR_CONFIG, GPUALLOC_ERR_UNAVAILABLE,
};

/// Default simulated capacity: an 80 GiB device.
const DEFAULT_SIM_CAPACITY: u64 = 80 << 30;

/// Which backend the process runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BackendKind {
    Cuda,
    Sim,
}

/// The backend of one device, chosen at run time (no `dyn` on the hot path).
pub(crate) enum AnyBackend {
    Cuda(Box<CudaBackend>),
    Sim(Box<SimBackend>),
}

macro_rules! dispatch {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::Cuda($b) => $e,
            AnyBackend::Sim($b) => $e,
        }
    };
}

impl Backend for AnyBackend {
    fn alignment(&self) -> u64 {
        dispatch!(self, b => b.alignment())
    }
    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        dispatch!(self, b => b.mem_info())
    }
    fn allocate(&mut self, size: u64, capturing: bool) -> Result<DevicePtr, BackendError> {
        dispatch!(self, b => b.allocate(size, capturing))
    }
    fn release(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.release(ptr, size))
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        dispatch!(self, b => b.record_event(stream))
    }
    fn event_done(&mut self, event: EventId) -> Result<bool, BackendError> {
        dispatch!(self, b => b.event_done(event))
    }
    fn wait_event(&mut self, event: EventId) -> Result<(), BackendError> {
        dispatch!(self, b => b.wait_event(event))
    }
    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        dispatch!(self, b => b.stream_wait_event(stream, event))
    }
    fn destroy_event(&mut self, event: EventId) {
        dispatch!(self, b => b.destroy_event(event))
    }
    fn vmm_granularity(&mut self) -> Option<u64> {
        dispatch!(self, b => b.vmm_granularity())
    }
    fn reserve(&mut self, size: u64) -> Result<DevicePtr, BackendError> {
        dispatch!(self, b => b.reserve(size))
    }
    fn free_reservation(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.free_reservation(ptr, size))
    }
    fn create_handle(&mut self, size: u64, capturing: bool) -> Result<HandleId, BackendError> {
        dispatch!(self, b => b.create_handle(size, capturing))
    }
    fn release_handle(&mut self, handle: HandleId, size: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.release_handle(handle, size))
    }
    fn map_handles(
        &mut self,
        ptr: DevicePtr,
        handles: &[(HandleId, u64)],
        capturing: bool,
    ) -> Result<(), BackendError> {
        dispatch!(self, b => b.map_handles(ptr, handles, capturing))
    }
    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.unmap(ptr, size))
    }
    fn synchronize(&mut self) -> Result<(), BackendError> {
        dispatch!(self, b => b.synchronize())
    }
    fn driver_calls(&self) -> DriverCalls {
        dispatch!(self, b => b.driver_calls())
    }
}

/// The allocator and how it was made.
pub(crate) struct Global {
    pub alloc: Allocator<AnyBackend>,
    pub kind: BackendKind,
}

static GLOBAL: OnceLock<Global> = OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());

/// The allocator, created on first use from the environment.
#[inline]
pub(crate) fn global() -> Result<&'static Global, Error> {
    match GLOBAL.get() {
        Some(g) => Ok(g),
        None => init(None),
    }
}

/// The allocator if it exists already (never creates it).
pub(crate) fn existing() -> Option<&'static Global> {
    GLOBAL.get()
}

/// Creates the allocator with `config` (None: `GPUALLOC_CONF`). Asking again
/// with the configuration in force is fine; another one is an error.
pub(crate) fn init(config: Option<&str>) -> Result<&'static Global, Error> {
    let _serial = INIT.lock();
    if let Some(g) = GLOBAL.get() {
        return match config {
            Some(c) if c != g.alloc.config().source => Err(Error::new(
                GPUALLOC_ERR_ALREADY_INITIALIZED,
                format!(
                    "gpualloc: already initialized with configuration `{}` (by gpualloc_init or the first allocation); `{c}` can no longer take effect",
                    g.alloc.config().source
                ),
            )),
            _ => Ok(g),
        };
    }
    let config = match config {
        Some(c) => Config::parse(c)?,
        None => Config::from_env()?,
    };
    let g = build(config)?;
    let g = GLOBAL.get_or_init(|| g);
    start_tracing(&g.alloc);
    Ok(g)
}

/// `GPUALLOC_TRACE` and friends, read once the allocator exists.
fn start_tracing(alloc: &Allocator<AnyBackend>) {
    crate::trace::from_env(alloc);
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn build(config: Config) -> Result<Global, Error> {
    let kind = match env("GPUALLOC_BACKEND").as_deref().map(str::trim) {
        None | Some("cuda") => BackendKind::Cuda,
        Some("sim") => BackendKind::Sim,
        Some(other) => {
            return Err(Error::new(
                GPUALLOC_ERR_CONFIG,
                format!("gpualloc: GPUALLOC_BACKEND=`{other}` is neither `cuda` nor `sim`"),
            ));
        }
    };
    match kind {
        BackendKind::Sim => {
            let capacity = match env("GPUALLOC_SIM_CAPACITY") {
                Some(v) => gpualloc::config::parse_bytes("GPUALLOC_SIM_CAPACITY", &v)?,
                None => DEFAULT_SIM_CAPACITY,
            };
            let devices = match env("GPUALLOC_SIM_DEVICES") {
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| (1..=64).contains(&n))
                    .ok_or_else(|| {
                        Error::new(
                            GPUALLOC_ERR_CONFIG,
                            format!(
                                "gpualloc: GPUALLOC_SIM_DEVICES=`{v}` is not a count in 1..=64"
                            ),
                        )
                    })?,
                None => 1,
            };
            let alloc = Allocator::new(
                config,
                devices,
                Box::new(move |d| {
                    Ok(AnyBackend::Sim(Box::new(
                        SimBackend::with_alignment(capacity, 256).for_device(d),
                    )))
                }),
            );
            Ok(Global { alloc, kind })
        }
        BackendKind::Cuda => {
            let devices = cuda::device_count()?;
            if devices == 0 {
                return Err(Error::new(
                    GPUALLOC_ERR_UNAVAILABLE,
                    "gpualloc: CUDA reports no devices",
                ));
            }
            let alloc = Allocator::new(
                config,
                devices,
                Box::new(|d| CudaBackend::new(d).map(|b| AnyBackend::Cuda(Box::new(b)))),
            );
            Ok(Global { alloc, kind })
        }
    }
}
