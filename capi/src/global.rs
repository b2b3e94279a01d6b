//! The process-wide allocator: backend chosen at run time, created once.
//!
//! `GPUALLOC_BACKEND=sim` selects the simulated device (capacity
//! `GPUALLOC_SIM_CAPACITY`, default 80GiB; `GPUALLOC_SIM_DEVICES` devices,
//! default 1); unset or `cuda` selects the CUDA driver. The configuration is
//! the string given to `gpualloc_init`, else `GPUALLOC_CONF`. A bad value is
//! an error returned by every call until a good `gpualloc_init`; never an abort.
//!
//! Read-only calls (stats, `free(NULL)`, `is_tracing`, ...) never create the
//! allocator: before the first allocation they answer from [`idle`], so a
//! later `gpualloc_init` still takes effect.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use gpualloc::backend::cuda::{self, CudaBackend};
use gpualloc::backend::{
    Backend, BackendError, CaptureNodes, DevicePtr, DriverCalls, EventId, GraphNode, HandleId,
    MemInfo, StreamId,
};
use gpualloc::{AllocError, Allocator, Config, SegmentObserver, SimBackend};
use parking_lot::Mutex;

use crate::boundary::{
    Error, GPUALLOC_ERR_ALREADY_INITIALIZED, GPUALLOC_ERR_CONFIG, GPUALLOC_ERR_UNAVAILABLE,
};
use crate::{pending, wsl};

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
    fn now_ns(&mut self) -> u64 {
        dispatch!(self, b => b.now_ns())
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
    fn call_other_allocator(
        &mut self,
        capturing: bool,
        call: &mut dyn FnMut(),
    ) -> Result<(), BackendError> {
        dispatch!(self, b => b.call_other_allocator(capturing, call))
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
    fn unmap_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.unmap_later(ptr, size))
    }
    fn free_reservation_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.free_reservation_later(ptr, size))
    }
    fn hold_later_work(&mut self, held: bool) {
        dispatch!(self, b => b.hold_later_work(held))
    }
    fn add_peer(&mut self, peer: u32) -> Result<(), BackendError> {
        dispatch!(self, b => b.add_peer(peer))
    }
    fn stream_capture(&mut self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        dispatch!(self, b => b.stream_capture(stream))
    }
    fn capture_terminals(
        &mut self,
        stream: StreamId,
    ) -> Result<Option<CaptureNodes>, BackendError> {
        dispatch!(self, b => b.capture_terminals(stream))
    }
    fn node_dependencies(&mut self, node: GraphNode) -> Result<Vec<GraphNode>, BackendError> {
        dispatch!(self, b => b.node_dependencies(node))
    }
    fn synchronize(&mut self) -> Result<(), BackendError> {
        dispatch!(self, b => b.synchronize())
    }
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), BackendError> {
        dispatch!(self, b => b.synchronize_stream(stream))
    }
    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        dispatch!(self, b => b.copy(dst, src, bytes))
    }
    fn export_handle(&mut self, handle: HandleId) -> Result<i32, BackendError> {
        dispatch!(self, b => b.export_handle(handle))
    }
    fn driver_calls(&self) -> DriverCalls {
        dispatch!(self, b => b.driver_calls())
    }
    fn helper_calls(&self) -> DriverCalls {
        dispatch!(self, b => b.helper_calls())
    }
}

/// The allocator and how it was made.
pub(crate) struct Global {
    pub alloc: Allocator<AnyBackend>,
    pub kind: BackendKind,
    /// The configuration string as given (`alloc`'s may add what the
    /// platform asks: Note [Plain memory on WSL]), which a later call's
    /// must equal.
    pub given: String,
}

static GLOBAL: OnceLock<Global> = OnceLock::new();
static INIT: Mutex<()> = Mutex::new(());
/// The segment observer, kept for the allocator until it starts (under `INIT`).
static OBSERVER: Mutex<Option<SegmentObserver>> = Mutex::new(None);

/// Installs the segment observer on the allocator, now if it exists, else
/// when it starts: under `INIT`, so that no allocator starts without it.
pub(crate) fn set_segment_observer(observer: Option<SegmentObserver>) {
    let _serial = INIT.lock();
    *OBSERVER.lock() = observer.clone();
    if let Some(g) = GLOBAL.get() {
        g.alloc.set_segment_observer(observer);
    }
}

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
    gpualloc::log::install_from_env();
    gpualloc::env_vars::warn_unknown_once();
    crate::crash_report::install_from_env();
    let _serial = INIT.lock();
    if let Some(g) = GLOBAL.get() {
        return match config {
            Some(c) if c != g.given => Err(Error::new(
                GPUALLOC_ERR_ALREADY_INITIALIZED,
                format!(
                    "gpualloc: already initialized with configuration `{}` (by gpualloc_init, or by the first call that needed the allocator: an allocation, a mark or phase, a trace start; or by `python -m gpualloc run`); `{}` can no longer take effect: configure that first call instead",
                    clip(&g.given),
                    clip(c)
                ),
            )),
            _ => Ok(g),
        };
    }
    // What `gpualloc_configure` kept (Note [Starting on first use]).
    let kept = pending::get();
    if let (Some(c), Some(old)) = (config, kept.config.as_deref())
        && c != old
    {
        return Err(pending::already_configured(old, c));
    }
    let config = parse_or_env(config.or(kept.config.as_deref()))?;
    let g = build(config)?;
    g.alloc.set_segment_observer(OBSERVER.lock().clone());
    // No device exists yet: this cannot fail.
    let _ = g
        .alloc
        .set_plain_requests(PLAIN_REQUESTS.load(Ordering::Relaxed));
    let g = GLOBAL.get_or_init(|| g);
    quiesce_helpers_at_exit();
    crate::fork::watch();
    pending::clear();
    tracing::info!(
        backend = ?g.kind,
        devices = g.alloc.device_count(),
        config = %g.alloc.config().source,
        "allocator started"
    );
    // A trace given before the start is the one asked for: `GPUALLOC_TRACE`
    // set since (by `python -m gpualloc run`, for the processes it starts)
    // names the same file.
    match kept.trace {
        Some(path) => crate::trace::start_kept(&g.alloc, &path),
        None if !kept.env_trace_stopped => start_tracing(&g.alloc),
        None => {}
    }
    Ok(g)
}

/// PyTorch's `expandable_segments` says off, as told before or after the
/// start (Note [PyTorch's expandable_segments switch] in the core).
static PLAIN_REQUESTS: AtomicBool = AtomicBool::new(false);

/// `gpualloc_set_plain_requests`: kept for the start, and told to every
/// device once the allocator runs (telling it starts nothing).
pub(crate) fn set_plain_requests(plain: bool) -> Result<(), Error> {
    let _serial = INIT.lock();
    PLAIN_REQUESTS.store(plain, Ordering::Relaxed);
    if let Some(g) = GLOBAL.get() {
        g.alloc.set_plain_requests(plain)?;
    }
    Ok(())
}

/// `config` parsed, or `GPUALLOC_CONF` when there is none.
fn parse_or_env(config: Option<&str>) -> Result<Config, Error> {
    Ok(match config {
        Some(c) => Config::parse(c)?,
        None => Config::from_env()?,
    })
}

/// Before the allocator starts: calls off the trace it would record (Note
/// [Starting on first use]); `None` once it runs (stop that trace instead).
pub(crate) fn stop_trace_before_start() -> Option<bool> {
    let _serial = INIT.lock();
    match GLOBAL.get() {
        Some(_) => None,
        None => Some(pending::stop_trace()),
    }
}

/// Registers, once, the exit handler that stops the unmapping helpers
/// before the CUDA driver tears itself down (Note [Helpers at exit] in
/// `allocator/src/backend/unmapper.rs`). Called when the allocator starts,
/// after CUDA, so the handler runs before the driver's.
fn quiesce_helpers_at_exit() {
    extern "C" fn quiesce() {
        // A forked child's helpers are its parent's (Note [Freeing in a
        // forked child]).
        if crate::fork::in_forked_child() {
            return;
        }
        // Never unwind out of an exit handler. The wait covers a job the
        // driver makes wait for the GPU's last work (a process exiting
        // while long kernels run); only a driver that never returns is
        // left behind, after 10 s, rather than hold the exit forever.
        let _ = std::panic::catch_unwind(|| {
            gpualloc::backend::unmapper::quiesce_all(std::time::Duration::from_secs(10));
        });
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: as in `stop_at_exit`: a plain `extern "C"` function that
        // lives as long as the library and cannot unwind.
        unsafe {
            crate::trace::atexit(quiesce);
        }
    });
}

/// Before the allocator starts: checks `config` and keeps it, with a trace
/// path, for the start, initializing nothing (Note [Starting on first use]
/// in `pending.rs`). Once it runs: as [`init`], then a trace start.
pub(crate) fn configure(
    config: Option<&str>,
    trace: Option<&std::path::Path>,
) -> Result<(), Error> {
    gpualloc::log::install_from_env();
    gpualloc::env_vars::warn_unknown_once();
    {
        let _serial = INIT.lock();
        if GLOBAL.get().is_none() {
            return pending::keep(config, trace);
        }
    }
    let g = init(config)?;
    if let Some(path) = trace {
        crate::trace::start_now(&g.alloc, path, "trace_start")?;
    }
    Ok(())
}

/// Before the start: forgets the kept configuration when it is `config`;
/// whether it did. Refused once the allocator runs.
pub(crate) fn forget_config(config: &str) -> Result<bool, Error> {
    let _serial = INIT.lock();
    if let Some(g) = GLOBAL.get() {
        return Err(Error::new(
            GPUALLOC_ERR_ALREADY_INITIALIZED,
            format!(
                "gpualloc: the allocator runs with configuration `{}`; it cannot be forgotten",
                clip(&g.alloc.config().source)
            ),
        ));
    }
    Ok(pending::forget(config))
}

/// Before the allocator exists: the configuration it would start with, once
/// `device` is checked against the device count it would have. Creates
/// nothing (the CUDA driver may be initialized to count devices).
pub(crate) fn idle(device: i64) -> Result<Config, Error> {
    let (config, count) = idle_count()?;
    if device < 0 || device as u64 >= count as u64 {
        return Err(AllocError::InvalidDevice { device, count }.into());
    }
    Ok(config)
}

/// The configuration in force once the allocator runs; before, the one
/// kept for its start, else the environment's. Creates nothing.
pub(crate) fn config_now() -> Result<Config, Error> {
    match GLOBAL.get() {
        Some(g) => Ok(g.alloc.config().clone()),
        None => {
            let config = parse_or_env(pending::get().config.as_deref())?;
            let wsl = backend_kind()? == BackendKind::Cuda && wsl::detected();
            Ok(wsl::effective(config, wsl)?.0)
        }
    }
}

/// Before the allocator exists: its configuration and device count.
pub(crate) fn idle_count() -> Result<(Config, usize), Error> {
    // The configuration kept for the start, else the environment's.
    let config = parse_or_env(pending::get().config.as_deref())?;
    let count = match backend_kind()? {
        BackendKind::Sim => sim_devices()?,
        BackendKind::Cuda => cuda::device_count()?,
    };
    Ok((config, count))
}

/// The cap each device starts with beside `config`'s: PyTorch's
/// `per_process_memory_fraction`, as set at run time before the start, else
/// from its settings variable, unless `config` has its own fraction (Note
/// [PyTorch's settings under gpualloc]).
pub(crate) fn start_fraction(config: &Config) -> Result<Option<f64>, Error> {
    if config.memory_fraction.is_some() {
        return Ok(None);
    }
    if let Some(x) = pending::torch_fraction() {
        return Ok(Some(x).filter(|&x| x < 1.0));
    }
    Ok(gpualloc::torch_settings::memory_fraction_from_env()?)
}

// Note [PyTorch's fraction set at run time]
// Rationale: torch 2.10 and later read `per_process_memory_fraction` from a
// settings string set at run time (`torch.cuda.memory._set_allocator_settings`,
// `torch._C._accelerator_setAllocatorSettings`) as from its variable, and
// its allocator applies it to each device when the allocator starts, at
// CUDA's initialization; set later, it changes nothing there.
// Approach: the Python package's wrapper of torch's setters (installed by
// `install()`, which also hands on the last string torch took before it)
// gives each string torch took to `gpualloc_set_torch_settings`. Before gpualloc starts
// (which PyTorch's CUDA initialization does, unless a call of gpualloc's
// own, an allocation or a traced mark, came first), its fraction is kept
// and replaces the variable's as the cap each device starts with;
// gpualloc's own key still wins. Once gpualloc runs, it changes nothing,
// as under PyTorch once CUDA has started, and the caller says so.

/// PyTorch's settings string `settings`, which torch took at run time: its
/// `per_process_memory_fraction`, before the start, becomes the cap each
/// device starts with (Note [PyTorch's fraction set at run time]). Whether
/// it did: false when the string has none, the allocator runs already, or
/// gpualloc's configuration gives its own fraction.
pub(crate) fn set_torch_settings(settings: &str) -> Result<bool, Error> {
    let Some(x) = gpualloc::torch_settings::memory_fraction_in("the settings string", settings)?
    else {
        return Ok(false);
    };
    let _serial = INIT.lock();
    if GLOBAL.get().is_some() {
        return Ok(false);
    }
    let config = parse_or_env(pending::get().config.as_deref())?;
    if config.memory_fraction.is_some() {
        return Ok(false);
    }
    pending::keep_torch_fraction(x);
    Ok(true)
}

/// At most 200 characters of `s`, for messages.
pub(crate) fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        None => s.to_string(),
        Some((i, _)) => format!("{}... ({} bytes)", &s[..i], s.len()),
    }
}

/// `GPUALLOC_TRACE` and friends, read once the allocator exists.
fn start_tracing(alloc: &Allocator<AnyBackend>) {
    crate::trace::from_env(alloc);
}

/// A set, non-blank variable; one that is not UTF-8 is an error, not unset.
fn env(name: &str) -> Result<Option<String>, Error> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v).filter(|v| !v.trim().is_empty())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(Error::new(
            GPUALLOC_ERR_CONFIG,
            format!("gpualloc: {name} is not valid UTF-8"),
        )),
    }
}

fn backend_kind() -> Result<BackendKind, Error> {
    match env("GPUALLOC_BACKEND")?.as_deref().map(str::trim) {
        None | Some("cuda") => Ok(BackendKind::Cuda),
        Some("sim") => Ok(BackendKind::Sim),
        Some(other) => Err(Error::new(
            GPUALLOC_ERR_CONFIG,
            format!(
                "gpualloc: GPUALLOC_BACKEND=`{}` is neither `cuda` nor `sim`",
                clip(other)
            ),
        )),
    }
}

/// `GPUALLOC_SIM_DEVICES`: 1 to 64, default 1.
fn sim_devices() -> Result<usize, Error> {
    match env("GPUALLOC_SIM_DEVICES")? {
        Some(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| (1..=64).contains(&n))
            .ok_or_else(|| {
                Error::new(
                    GPUALLOC_ERR_CONFIG,
                    format!(
                        "gpualloc: GPUALLOC_SIM_DEVICES=`{}` is not a count in 1..=64",
                        clip(&v)
                    ),
                )
            }),
        None => Ok(1),
    }
}

/// `GPUALLOC_SIM_CAPACITY`: 1 MiB to 1 PiB, default 80 GiB.
fn sim_capacity() -> Result<u64, Error> {
    let Some(v) = env("GPUALLOC_SIM_CAPACITY")? else {
        return Ok(DEFAULT_SIM_CAPACITY);
    };
    let bytes = gpualloc::config::parse_bytes("GPUALLOC_SIM_CAPACITY", &v)?;
    if bytes < 1 << 20 {
        return Err(Error::new(
            GPUALLOC_ERR_CONFIG,
            format!("gpualloc: GPUALLOC_SIM_CAPACITY={bytes} bytes is below 1 MiB"),
        ));
    }
    Ok(bytes)
}

fn build(config: Config) -> Result<Global, Error> {
    let kind = backend_kind()?;
    let fraction = start_fraction(&config)?;
    let given = config.source.clone();
    // Note [Plain memory on WSL].
    let (config, plain) = wsl::effective(config, kind == BackendKind::Cuda && wsl::detected())?;
    if plain {
        crate::boundary::say(format_args!("{}", wsl::SAID));
    }
    match kind {
        BackendKind::Sim => {
            let capacity = sim_capacity()?;
            let devices = sim_devices()?;
            let alloc = Allocator::new(
                config,
                devices,
                Box::new(move |d| {
                    Ok(AnyBackend::Sim(Box::new(
                        SimBackend::with_alignment(capacity, 256)
                            .for_device(d)
                            .with_wall_clock(),
                    )))
                }),
            )
            .with_start_fraction(fraction)?;
            Ok(Global { alloc, kind, given })
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
            )
            .with_start_fraction(fraction)?;
            Ok(Global { alloc, kind, given })
        }
    }
}
