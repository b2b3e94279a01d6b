//! What was asked of the allocator before it started: its configuration and
//! a trace to record.
//!
//! Note [Starting on first use]
//! Rationale: PyTorch initializes CUDA lazily, at the first call that needs
//! it. A program may choose its GPUs after `import torch` (Ultralytics'
//! `select_device` sets `CUDA_VISIBLE_DEVICES` just before its first CUDA
//! call; so do scripts in their first lines), and processes that never use
//! the GPU (DataLoader workers that import the script again under `spawn`)
//! never initialize CUDA at all. An allocator that starts when it is
//! installed initializes the driver there and then: the program's later
//! choice of GPUs is silently ignored, each such worker pays for a driver
//! it never uses, and a child forked afterwards cannot use CUDA.
//! Approach: `gpualloc_configure` checks the configuration (a bad one is
//! still an error at once) and keeps it, with a trace path, without
//! starting anything. The allocator starts at the first call that needs it
//! (PyTorch's CUDA initialization calls the bridge's `init`, which asks
//! for it; an allocation; `gpualloc_init`; a mark or a phase when a trace
//! will be recorded, which they go to; without one they start nothing) and
//! takes them then. Until then the trace counts as recording (`is_tracing`), and
//! stopping it forgets it. The Python package's `trace_start` keeps its
//! trace this way too (`gpualloc_configure(NULL, path)`), so that the
//! line at a script's top that a spawned worker runs again starts nothing.

use std::path::{Path, PathBuf};

use gpualloc::Config;
use parking_lot::Mutex;

use crate::boundary::{Error, GPUALLOC_ERR_ALREADY_INITIALIZED, GPUALLOC_ERR_IO};
use crate::global::clip;

/// See Note [Starting on first use].
#[derive(Clone, Debug, Default)]
pub(crate) struct Pending {
    /// The configuration to start with, checked.
    pub config: Option<String>,
    /// The trace to start once the allocator exists, its placeholders
    /// (`{pid}`, `{rank}`) filled in by the process that starts it: a child
    /// forked before the start writes its own file.
    pub trace: Option<PathBuf>,
    /// A stop before the start also called off `GPUALLOC_TRACE`'s trace.
    pub env_trace_stopped: bool,
    /// PyTorch's `per_process_memory_fraction` set at run time before the
    /// start (Note [PyTorch's fraction set at run time] in `global.rs`);
    /// 1 when it lifts the variable's cap.
    pub torch_fraction: Option<f64>,
}

impl Pending {
    /// Whether a trace will be recorded from the start: one kept, or
    /// `GPUALLOC_TRACE`'s unless a stop called it off.
    fn traces(&self) -> bool {
        self.trace.is_some() || (env_trace() && !self.env_trace_stopped)
    }
}

static PENDING: Mutex<Pending> = Mutex::new(Pending {
    config: None,
    trace: None,
    env_trace_stopped: false,
    torch_fraction: None,
});

/// What is kept for the start (a copy).
pub(crate) fn get() -> Pending {
    PENDING.lock().clone()
}

/// Forgets what was kept (once the allocator has started with it).
pub(crate) fn clear() {
    *PENDING.lock() = Pending::default();
}

/// Whether `GPUALLOC_TRACE` asks for a trace when the allocator starts.
pub(crate) fn env_trace() -> bool {
    std::env::var_os(gpualloc::trace::TRACE_ENV)
        .is_some_and(|v| !v.to_string_lossy().trim().is_empty())
}

/// Whether a trace will be recorded from the start ([`Pending::traces`]).
pub(crate) fn tracing() -> bool {
    PENDING.lock().traces()
}

/// Keeps `config` (checked now) and `trace` for the start. The caller holds
/// the start lock and has seen that the allocator has not started.
pub(crate) fn keep(config: Option<&str>, trace: Option<&Path>) -> Result<(), Error> {
    let mut p = PENDING.lock();
    if let Some(c) = config {
        // PyTorch's fraction is checked now too, as the start will read it
        // (Note [PyTorch's settings under gpualloc]); not under this lock,
        // which `start_fraction` takes.
        if Config::parse(c)?.memory_fraction.is_none() && p.torch_fraction.is_none() {
            gpualloc::torch_settings::memory_fraction_from_env()?;
        }
        if let Some(old) = p.config.as_deref().filter(|old| *old != c) {
            return Err(already_configured(old, c));
        }
    }
    if let Some(t) = trace
        && p.traces()
    {
        let what = match &p.trace {
            Some(old) => old.display().to_string(),
            None => "the path in GPUALLOC_TRACE".to_string(),
        };
        return Err(Error::new(
            GPUALLOC_ERR_IO,
            format!(
                "gpualloc is already tracing to {what} once the allocator starts; {} was not started",
                t.display()
            ),
        ));
    }
    if let Some(c) = config {
        p.config = Some(c.to_string());
    }
    if let Some(t) = trace {
        p.trace = Some(t.to_path_buf());
    }
    Ok(())
}

/// PyTorch's fraction set at run time, if any ([`Pending::torch_fraction`]).
pub(crate) fn torch_fraction() -> Option<f64> {
    PENDING.lock().torch_fraction
}

/// Keeps PyTorch's fraction `x` (checked by the caller) for the start. The
/// caller holds the start lock and has seen that the allocator has not
/// started.
pub(crate) fn keep_torch_fraction(x: f64) {
    PENDING.lock().torch_fraction = Some(x);
}

/// Forgets the kept configuration when it is `config`; whether it did.
/// The caller holds the start lock and has seen that the allocator has
/// not started.
pub(crate) fn forget(config: &str) -> bool {
    let mut p = PENDING.lock();
    let same = p.config.as_deref() == Some(config);
    if same {
        p.config = None;
    }
    same
}

/// Calls off the trace that would be recorded from the start (kept, or
/// `GPUALLOC_TRACE`'s); whether there was one. The caller holds the start
/// lock and has seen that the allocator has not started.
pub(crate) fn stop_trace() -> bool {
    let mut p = PENDING.lock();
    let was = p.traces();
    p.trace = None;
    p.env_trace_stopped = true;
    was
}

/// The error for a second, different configuration before the start.
pub(crate) fn already_configured(old: &str, new: &str) -> Error {
    Error::new(
        GPUALLOC_ERR_ALREADY_INITIALIZED,
        format!(
            "gpualloc: already initialized with configuration `{}` (given before the allocator's first use, which starts it with that); `{}` cannot take effect as well",
            clip(old),
            clip(new)
        ),
    )
}
