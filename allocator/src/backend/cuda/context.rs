//! Contexts: each driver call runs in its device's context, made current on
//! the calling thread for the call and the caller's put back after
//! ([`bind_context`]); streams and events of other devices get theirs
//! (Note [Streams of other devices] in `stream.rs`); and a call that may
//! run while a graph is captured runs in relaxed capture mode
//! ([`RelaxedCaptureMode`]).

use cudarc::driver::sys;

use super::{CudaBackend, check, create_event, driver, event_of, stream_of};
use crate::backend::{BackendError, EventId, StreamId, other_device_stream};
use crate::cost::DriverCall;

impl CudaBackend {
    /// Records an event on `stream` in the stream's own context when that
    /// is not this device's (an error otherwise). Such events are kept out
    /// of the pool and destroyed in their context (`destroy_event`).
    pub(super) fn record_foreign(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `stream` is a stream handle PyTorch passed; `ctx` is a
        // valid out-pointer. On a stream destroyed since, CUDA leaves the
        // call undefined and the driver reports an invalid handle; PyTorch's
        // own allocator records events on such streams as well.
        check("cuStreamGetCtx", unsafe {
            driver::cuStreamGetCtx(stream_of(stream), &mut ctx)
        })?;
        if ctx.is_null() || ctx == self.ctx {
            return Err(BackendError::Unavailable(
                "the stream belongs to this device's context".into(),
            ));
        }
        self.record_in(ctx, stream_of(stream))
    }

    /// Records an event on `stream`, a stream of context `ctx` (another
    /// device's), as `record_foreign` does.
    pub(super) fn record_in(
        &mut self,
        ctx: sys::CUcontext,
        stream: sys::CUstream,
    ) -> Result<EventId, BackendError> {
        let _bound = bind_context(ctx)?;
        let ev = create_event()?;
        // SAFETY: `ev` and `stream` both belong to `ctx`, which is current
        // (a shared handle such as 0 names `ctx`'s own default stream).
        let r = self.timed(DriverCall::EventRecord, (0, 0), || unsafe {
            driver::cuEventRecord(ev, stream)
        });
        if let Err(e) = check("cuEventRecord", r) {
            // SAFETY: `ev` was just created in the current context and is
            // referred to nowhere else.
            let _ = unsafe { driver::cuEventDestroy_v2(ev) };
            return Err(e);
        }
        self.foreign_events.insert(ev as usize, ctx);
        Ok(ev as usize as EventId)
    }

    /// The primary context of device `ordinal`, retained on first use and
    /// released on drop (Note [Streams of other devices]).
    pub(super) fn context_of(&mut self, ordinal: u32) -> Result<sys::CUcontext, BackendError> {
        if ordinal == self.ordinal {
            return Ok(self.ctx);
        }
        if let Some(&ctx) = self.other_contexts.get(&ordinal) {
            return Ok(ctx);
        }
        let dev = cu_device(ordinal)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `dev` came from cuDeviceGet; `ctx` is a valid out-pointer.
        // The retain is balanced by the release in `Drop`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            driver::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        self.other_contexts.insert(ordinal, ctx);
        Ok(ctx)
    }

    /// Binds the context `stream` belongs to, with its driver handle: for a
    /// shared handle of another device (Note [Streams of other devices])
    /// that device's context and the plain handle, else this device's.
    pub(super) fn bind_stream(
        &mut self,
        stream: StreamId,
    ) -> Result<(Bound, sys::CUstream), BackendError> {
        match other_device_stream(stream) {
            Some((device, handle)) => {
                let ctx = self.context_of(device)?;
                Ok((bind_context(ctx)?, stream_of(handle)))
            }
            None => Ok((self.bind()?, stream_of(stream))),
        }
    }

    /// Binds the context `event` was made in: this device's, or the
    /// stream's for an event of `record_foreign`.
    pub(super) fn bind_for(&self, event: EventId) -> Result<Bound, BackendError> {
        let ctx = self.foreign_events.get(&(event_of(event) as usize));
        bind_context(ctx.copied().unwrap_or(self.ctx))
    }
}

/// The driver's handle of device `ordinal` (the driver is initialized).
pub(super) fn cu_device(ordinal: u32) -> Result<sys::CUdevice, BackendError> {
    let o = std::ffi::c_int::try_from(ordinal)
        .map_err(|_| BackendError::Unavailable(format!("no CUDA device {ordinal}")))?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: the driver is initialized (callers hold a backend or have
    // counted devices); `dev` is a valid out-pointer.
    check("cuDeviceGet", unsafe { driver::cuDeviceGet(&mut dev, o) })?;
    Ok(dev)
}

/// Makes `ctx` current on this thread if it is not; the guard restores the
/// previous one.
pub(super) fn bind_context(ctx: sys::CUcontext) -> Result<Bound, BackendError> {
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is initialized (a backend exists only after `new`
    // succeeded); `cur` is a valid out-pointer.
    check("cuCtxGetCurrent", unsafe {
        driver::cuCtxGetCurrent(&mut cur)
    })?;
    if cur == ctx {
        return Ok(Bound { previous: None });
    }
    // SAFETY: `ctx` is a live context: a primary context retained by a
    // backend, or the context an event of `record_foreign` was recorded
    // in. That is another device's primary context for PyTorch's streams,
    // which lives until the process ends. A context a library created
    // itself is not retained here: it must outlive the events recorded in
    // it until they are found done, which holds while the library keeps
    // the stream whose blocks are pending (a limit, not checked; it is
    // this function's one unchecked precondition).
    check("cuCtxSetCurrent", unsafe { driver::cuCtxSetCurrent(ctx) })?;
    Ok(Bound {
        previous: Some(cur),
    })
}

/// Puts the thread's previous context back when dropped (`bind_context`).
#[must_use = "the context is current only while the guard lives"]
pub(super) struct Bound {
    /// The context current before, when it was another one (null: none).
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(prev) = self.previous {
            // SAFETY: `prev` was current on this thread when the guard was
            // made, within the same backend call, so it is still alive (or
            // null, which makes no context current). A failure cannot be
            // reported from `drop`; it leaves this device's context current,
            // as before guards existed.
            let _ = unsafe { driver::cuCtxSetCurrent(prev) };
        }
    }
}

/// Restores the thread's previous stream-capture mode when dropped.
pub(super) struct RelaxedCaptureMode {
    /// The previous `CUstreamCaptureMode`, as the driver's integer.
    previous: u32,
}

impl RelaxedCaptureMode {
    pub(super) fn enter() -> Result<RelaxedCaptureMode, BackendError> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED as u32;
        // SAFETY: `mode` is a valid in/out pointer; the call only swaps the
        // calling thread's capture mode.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            driver::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        Ok(RelaxedCaptureMode { previous: mode })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; restores the mode saved there. A failure
        // cannot be reported from `drop` and leaves the mode relaxed, which
        // only makes later calls on this thread more permissive.
        let _ = unsafe { driver::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}
