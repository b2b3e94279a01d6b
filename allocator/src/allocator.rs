//! [`Allocator`]: every device of a process, each behind its own lock.
//!
//! Devices are created on first use through a factory, so a process that
//! touches only GPU 0 never initializes the others. Every call takes the
//! device's `parking_lot::Mutex` once; nothing else is shared on the hot path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::backend::{Backend, BackendError, DevicePtr, StreamId};
use crate::checkpoint::{CheckpointBlock, RestoreDelta};
use crate::config::Config;
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::observer::SegmentObserver;
use crate::pool::PoolKey;
use crate::private_pool::StreamFilter;
use crate::segment_source::SegmentSource;
use crate::snapshot::SegmentSnapshot;
use crate::stats::DeviceStats;
use crate::trace::recorder::Recorder;

/// Note [Locks held at a fork]
/// Rationale: a child forked while another thread of its parent held a
/// device's lock (a DataLoader worker forked while an autograd thread
/// allocated) inherits the lock held, by a thread it does not have. Any
/// call of the child that takes the lock (statistics, a snapshot, an
/// allocation on the simulator) would wait forever: the worker hangs with
/// no message. Frees there never wait (Note [Freeing in a forked child] in
/// the C ABI crate).
/// Approach: the C ABI's fork handler calls [`note_forked_child`]; from
/// then on the device locks are taken with a timeout of
/// [`LOCK_WAIT_AFTER_FORK`], which a lock a thread of the child holds
/// outlasts only in a call far longer than any the allocator makes, and
/// a lock held at the fork never ends: the call fails with
/// [`AllocError::HeldAtFork`], naming the likely cause, instead of hanging,
/// and later calls on that device fail at once. The trace's calls over
/// every device (stopping, flushing, marks, and the exit handler that
/// completes the trace) pass over such a device. One relaxed load per lock
/// taken. The child polls (`try_lock` and short sleeps) and never parks:
/// `parking_lot`'s process-wide wait queues may still link the wait
/// records of parent threads that were parked at the fork, which live in
/// those threads' memory, and a thread the child creates may be given that
/// memory; parking it linked its record twice and crashed the next park
/// (a review found 5 of 150 children of a C program killed by SIGSEGV,
/// their exit handler's `trace_stop` among them). The trace's recorder
/// slot is taken the same way, so that a trace call of the child cannot
/// hang on a slot a parent thread held at the fork.
static FORKED_CHILD: AtomicBool = AtomicBool::new(false);

/// How long a device lock is waited for in a forked child (Note [Locks
/// held at a fork]).
pub const LOCK_WAIT_AFTER_FORK: std::time::Duration = std::time::Duration::from_secs(2);

/// Marks this process as a child forked from one whose allocator ran (Note
/// [Locks held at a fork]). Only stores an atomic: a fork handler may call it.
pub fn note_forked_child() {
    FORKED_CHILD.store(true, Ordering::Relaxed);
}

/// Whether [`note_forked_child`] was called in this process.
#[inline]
pub fn in_forked_child() -> bool {
    FORKED_CHILD.load(Ordering::Relaxed)
}

/// Devices (by bit, the first 64) whose lock a forked child waited for in
/// vain: later calls fail at once (Note [Locks held at a fork]).
static HELD_AT_FORK: AtomicU64 = AtomicU64::new(0);

/// Locks `slot`, device `device`'s; in a forked child, with the timeout of
/// Note [Locks held at a fork], once per device.
#[inline]
pub(crate) fn take<T>(slot: &Mutex<T>, device: i64) -> Result<MutexGuard<'_, T>, AllocError> {
    if !in_forked_child() {
        return Ok(slot.lock());
    }
    let bit = u32::try_from(device)
        .ok()
        .and_then(|d| 1u64.checked_shl(d))
        .unwrap_or(0);
    let wait = if HELD_AT_FORK.load(Ordering::Relaxed) & bit != 0 {
        std::time::Duration::ZERO
    } else {
        LOCK_WAIT_AFTER_FORK
    };
    match poll_lock(slot, wait) {
        Some(g) => Ok(g),
        None => {
            HELD_AT_FORK.fetch_or(bit, Ordering::Relaxed);
            Err(AllocError::HeldAtFork { device })
        }
    }
}

/// Takes `m` within `wait` by polling, never parking (a forked child's
/// way, Note [Locks held at a fork]); `None` when it stayed held.
pub(crate) fn poll_lock<T>(m: &Mutex<T>, wait: std::time::Duration) -> Option<MutexGuard<'_, T>> {
    crate::backoff::poll_until(Some(std::time::Instant::now() + wait), || m.try_lock())
}

/// Creates the backend of a device on first use.
pub type BackendFactory<B> = Box<dyn Fn(u32) -> Result<B, BackendError> + Send + Sync>;

/// The caching allocator of a process: one [`DeviceAllocator`] per device.
pub struct Allocator<B: Backend> {
    pub(crate) config: Config,
    pub(crate) devices: Vec<Mutex<Option<DeviceAllocator<B>>>>,
    pub(crate) factory: BackendFactory<B>,
    /// The trace recorder while tracing; devices created later join it.
    pub(crate) recorder: Mutex<Option<Arc<Recorder>>>,
    /// The segment observer; devices created later get it too.
    observer: Mutex<Option<SegmentObserver>>,
    /// Frees called back from another allocator's call, run once no lock
    /// is held (Note [Frees called back from a source] in
    /// `segment_source.rs`).
    deferred_frees: Mutex<Vec<DevicePtr>>,
    /// Whether `deferred_frees` may hold any: the hot paths read only this.
    has_deferred_frees: AtomicBool,
    /// The cap each device starts with, as a fraction of its memory, beside
    /// the configuration's (Note [PyTorch's settings under gpualloc]).
    start_fraction: Option<f64>,
    /// PyTorch's `expandable_segments` says off (Note [PyTorch's
    /// expandable_segments switch] in `plain_requests.rs`); devices created
    /// later start so.
    plain_requests: AtomicBool,
}

impl<B: Backend> Allocator<B> {
    /// An allocator for `device_count` devices whose backends `factory` creates.
    pub fn new(config: Config, device_count: usize, factory: BackendFactory<B>) -> Self {
        // The process clock calibrates on its first reading (up to a few
        // hundred ms): here, rather than in a `malloc` under a device lock.
        crate::clock::now_ns();
        Allocator {
            config,
            devices: (0..device_count).map(|_| Mutex::new(None)).collect(),
            factory,
            recorder: Mutex::new(None),
            observer: Mutex::new(None),
            deferred_frees: Mutex::new(Vec::new()),
            has_deferred_frees: AtomicBool::new(false),
            start_fraction: None,
            plain_requests: AtomicBool::new(false),
        }
    }

    /// Each device starts capped at `fraction` of its memory, as if
    /// `set_per_process_memory_fraction` had been called before its first
    /// use (a trace records the cap when the device starts; Note
    /// [PyTorch's settings under gpualloc]). `None`: the configuration's cap.
    ///
    /// # Errors
    /// A fraction outside `[0, 1]`.
    pub fn with_start_fraction(mut self, fraction: Option<f64>) -> Result<Self, AllocError> {
        if let Some(f) = fraction {
            crate::limits::check_fraction(f)?;
        }
        self.start_fraction = fraction;
        Ok(self)
    }

    /// The fraction a device not yet started would be capped at (1.0: none).
    pub fn start_fraction(&self) -> f64 {
        self.start_fraction
            .or(self.config.memory_fraction)
            .unwrap_or(1.0)
    }

    /// The configuration every device starts with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Locks device `device`, creating it on first use.
    ///
    /// # Errors
    /// [`AllocError::InvalidDevice`], or the backend's failure to start.
    pub fn lock(&self, device: i64) -> Result<DeviceGuard<'_, B>, AllocError> {
        let slot = self.slot(device)?;
        let mut guard = take(slot, device)?;
        if guard.is_none() {
            let backend = (self.factory)(device as u32)?;
            let mut dev = DeviceAllocator::new(device as u32, backend, self.config.clone());
            if let Some(f) = self.start_fraction {
                // Checked in `with_start_fraction`; recorded by `start_trace`
                // below, as a cap differing from the configuration's.
                dev.set_memory_fraction(f)?;
            }
            // Not under the slot's lock: starting reads the device's size.
            let recorder = self.recorder_slot().ok().and_then(|s| s.clone());
            if let Some(r) = recorder {
                let now = dev.backend.now_ns();
                dev.start_trace(r.device_trace(device as u32, now));
            }
            dev.observer = self.observer.lock().clone();
            dev.set_plain_requests(self.plain_requests.load(Ordering::Relaxed));
            *guard = Some(dev);
        }
        let d = MutexGuard::map(guard, |d| d.as_mut().expect("created above"));
        if d.poisoned {
            return Err(AllocError::Poisoned {
                device: device as u32,
            });
        }
        Ok(DeviceGuard::new(d))
    }

    fn slot(&self, device: i64) -> Result<&Mutex<Option<DeviceAllocator<B>>>, AllocError> {
        // Its lock may be held by this very thread (Note [Pools served by
        // another allocator]).
        if crate::segment_source::in_source_call() {
            return Err(AllocError::CalledBack { device });
        }
        usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or(AllocError::InvalidDevice {
                device,
                count: self.devices.len(),
            })
    }

    /// Installs (or, with `None`, removes) the observer of segment events on
    /// every device, created or not (Note [Segment events] in `observer.rs`).
    /// Once this returns, no device calls the previous observer.
    pub fn set_segment_observer(&self, observer: Option<SegmentObserver>) {
        *self.observer.lock() = observer;
        // Each device reads the observer under its own lock (as `lock` does
        // when it creates one), so concurrent calls leave every device with
        // the last observer stored.
        for (i, slot) in self.devices.iter().enumerate() {
            // A device locked at a fork keeps its observer (its calls
            // cannot run in this child).
            if let Ok(mut g) = take(slot, i as i64)
                && let Some(d) = g.as_mut()
            {
                d.observer = self.observer.lock().clone();
            }
        }
    }

    /// PyTorch's `expandable_segments` says off (`true`) or on again, on
    /// every device, created or not (Note [PyTorch's expandable_segments
    /// switch] in `plain_requests.rs`).
    ///
    /// # Errors
    /// As [`for_each_created`](Self::for_each_created): called back from
    /// another allocator's call, or a device locked at a fork.
    pub fn set_plain_requests(&self, on: bool) -> Result<(), AllocError> {
        self.plain_requests.store(on, Ordering::Relaxed);
        // Read again under each device's lock (as `lock` does when it
        // creates one): concurrent calls leave every device with the last.
        self.for_each_created(|d| {
            d.set_plain_requests(self.plain_requests.load(Ordering::Relaxed));
            Ok(())
        })
    }

    /// Locks device `device` if it has been created; `None` otherwise (read-only
    /// callers use this so that asking about a device never starts it).
    ///
    /// # Errors
    /// [`AllocError::InvalidDevice`].
    pub fn peek(&self, device: i64) -> Result<Option<DeviceGuard<'_, B>>, AllocError> {
        let slot = self.slot(device)?;
        Ok(MutexGuard::try_map(take(slot, device)?, |d| d.as_mut())
            .ok()
            .map(DeviceGuard::new))
    }

    /// Runs `f` on every device that has been created.
    pub fn for_each_created(
        &self,
        mut f: impl FnMut(&mut DeviceAllocator<B>) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        if crate::segment_source::in_source_call() {
            return Err(AllocError::CalledBack { device: -1 });
        }
        for (i, slot) in self.devices.iter().enumerate() {
            if let Ok(d) = MutexGuard::try_map(take(slot, i as i64)?, |d| d.as_mut()) {
                let mut d = DeviceGuard::new(d);
                if !d.poisoned {
                    f(&mut d)?;
                }
            }
        }
        Ok(())
    }

    /// [`DeviceAllocator::malloc`] on a device.
    #[inline]
    pub fn malloc(
        &self,
        device: i64,
        size: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        let p = self.lock(device)?.malloc(size, stream);
        self.after_deferred_frees(p)
    }

    /// [`DeviceAllocator::free`] on a device; a negative `device` means the
    /// device that allocated `ptr` (one lookup per created device, for
    /// callers such as a deleter that knows only the pointer).
    #[inline]
    pub fn free(&self, device: i64, ptr: DevicePtr) -> Result<(), AllocError> {
        self.free_from(device, ptr, None)
    }

    /// [`free`](Self::free) made where `current` is the current stream, if
    /// known ([`DeviceAllocator::free_from`]).
    #[inline]
    pub fn free_from(
        &self,
        device: i64,
        ptr: DevicePtr,
        current: Option<StreamId>,
    ) -> Result<(), AllocError> {
        match self.free_now(device, ptr, current) {
            // Called back from a source: nothing was read or changed.
            Err(AllocError::CalledBack { .. }) => {
                self.defer_free(ptr);
                Ok(())
            }
            r => self.after_deferred_frees(r),
        }
    }

    /// [`free`](Self::free) now; [`AllocError::CalledBack`] from a source's
    /// call, before anything is read.
    fn free_now(
        &self,
        device: i64,
        ptr: DevicePtr,
        current: Option<StreamId>,
    ) -> Result<(), AllocError> {
        if device < 0 {
            return self.free_anywhere(ptr);
        }
        // A device never used holds nothing to free, and is not started
        // for the error; a pointer of another device is freed there, as a
        // free that knows only the pointer would (where the current stream
        // is another device's: not told).
        let elsewhere = |e| self.with_owner(ptr, |d| d.free(ptr)).unwrap_or(Err(e));
        let here = match self.peek(device) {
            // No such device: the pointer is found where it lives, as for a
            // negative device, rather than left allocated for good.
            Err(e @ AllocError::InvalidDevice { .. }) => return elsewhere(e),
            r => r?,
        };
        match here {
            // A poisoned device is not read; the pointer may be another's.
            Some(d) if d.poisoned => {
                drop(d);
                elsewhere(AllocError::Poisoned {
                    device: device as u32,
                })
            }
            Some(mut d) => match d.free_from(ptr, current) {
                Err(e @ AllocError::InvalidPointer { .. }) => {
                    drop(d);
                    elsewhere(e)
                }
                r => r,
            },
            None => elsewhere(AllocError::InvalidPointer {
                ptr,
                device: device as u32,
            }),
        }
    }

    /// [`free`](Self::free) with the owner found from the pointer, giving
    /// the device and the block size freed (torch's memory profiler is told
    /// of each free's size).
    ///
    /// # Errors
    /// As [`free`](Self::free).
    /// Called back from a source, the free is deferred (Note [Frees called
    /// back from a source]) and reported as 0 bytes of device 0: its block
    /// cannot be read meanwhile.
    pub fn free_sized(&self, ptr: DevicePtr) -> Result<(u32, u64), AllocError> {
        let r = self.with_owner(ptr, |d| {
            let size = d.allocation_size(ptr).unwrap_or(0);
            d.free(ptr).map(|()| (d.device, size))
        });
        match r {
            // Called back from a source: nothing was read or changed.
            Some(Err(AllocError::CalledBack { .. })) => {
                self.defer_free(ptr);
                Ok((0, 0))
            }
            r => self.after_deferred_frees(r.unwrap_or(Err(AllocError::InvalidPointer {
                ptr,
                device: crate::error::ANY_DEVICE,
            }))),
        }
    }

    /// `r`, once the frees deferred meanwhile have run: the end of every
    /// entry point that may call a source (Note [Frees called back from a
    /// source]).
    #[inline]
    fn after_deferred_frees<T>(&self, r: T) -> T {
        self.run_deferred_frees();
        r
    }

    /// Keeps a free called back from a source for later (Note [Frees
    /// called back from a source]).
    fn defer_free(&self, ptr: DevicePtr) {
        self.deferred_frees.lock().push(ptr);
        self.has_deferred_frees.store(true, Ordering::Release);
    }

    /// Runs the frees deferred while a source was called (Note [Frees
    /// called back from a source]), unless this thread is inside a
    /// source's call itself. Each entry point that may call a source runs
    /// them once it let go of the device, and so does every later
    /// `malloc` and `free`, of any thread. A failure (a pointer gpualloc
    /// does not hold) is logged, as the deleter that asked could not be
    /// told any more.
    pub fn run_deferred_frees(&self) {
        if !self.has_deferred_frees.load(Ordering::Acquire)
            || crate::segment_source::in_source_call()
        {
            return;
        }
        loop {
            let ptrs = {
                let mut q = self.deferred_frees.lock();
                self.has_deferred_frees.store(false, Ordering::Release);
                std::mem::take(&mut *q)
            };
            if ptrs.is_empty() {
                return;
            }
            for ptr in ptrs {
                if let Err(e) = self.free_anywhere(ptr) {
                    crate::log::deferred_free_failed(ptr, &e);
                }
            }
        }
    }

    /// The block size of the live allocation at `ptr`, on whichever device
    /// holds it; None for a pointer no device holds.
    ///
    /// # Errors
    /// [`AllocError::Poisoned`] or [`AllocError::HeldAtFork`] from the
    /// device that may hold it.
    pub fn allocation_size(&self, ptr: DevicePtr) -> Result<Option<u64>, AllocError> {
        self.with_owner(ptr, |d| Ok(d.allocation_size(ptr)))
            .transpose()
            .map(Option::flatten)
    }

    fn free_anywhere(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.with_owner(ptr, |d| d.free(ptr))
            .unwrap_or(Err(AllocError::InvalidPointer {
                ptr,
                device: crate::error::ANY_DEVICE,
            }))
    }

    /// Runs `f` on the created device that allocated `ptr` (a live
    /// allocation); None when none did, [`AllocError::Poisoned`] when that
    /// device is. Devices another thread holds now are asked last: with
    /// several GPUs in one process, a caller that knows only the pointer
    /// (a deleter) then waits for the device that owns it, not for each
    /// device before it.
    pub fn with_owner<R>(
        &self,
        ptr: DevicePtr,
        f: impl FnOnce(&mut DeviceAllocator<B>) -> Result<R, AllocError>,
    ) -> Option<Result<R, AllocError>> {
        self.with_owner_waiting(ptr, true, f)
    }

    /// [`with_owner`](Self::with_owner); without `wait`, the devices other
    /// threads hold are passed over rather than waited for.
    fn with_owner_waiting<R>(
        &self,
        ptr: DevicePtr,
        wait: bool,
        f: impl FnOnce(&mut DeviceAllocator<B>) -> Result<R, AllocError>,
    ) -> Option<Result<R, AllocError>> {
        if crate::segment_source::in_source_call() {
            return Some(Err(AllocError::CalledBack { device: -1 }));
        }
        let mut busy = Vec::new();
        let mut owner = None;
        for (i, slot) in self.devices.iter().enumerate() {
            match slot.try_lock() {
                Some(guard) => {
                    owner = Self::owning(guard, ptr);
                    if owner.is_some() {
                        break;
                    }
                }
                None => busy.push((i, slot)),
            }
        }
        for (i, slot) in busy {
            if owner.is_some() || !wait {
                break;
            }
            match take(slot, i as i64) {
                Ok(guard) => owner = Self::owning(guard, ptr),
                Err(e) => return Some(Err(e)),
            }
        }
        owner.map(|mut d| {
            if d.poisoned {
                Err(AllocError::Poisoned { device: d.device })
            } else {
                f(&mut d)
            }
        })
    }

    /// Frees `ptr` on the created device that allocated it, without waiting
    /// for any device lock: a device another thread holds now is passed
    /// over, and so is `ptr` if that device holds it (a process forked
    /// while another thread held a lock, which no thread of the child will
    /// release). Whether `ptr` was freed.
    ///
    /// # Errors
    /// As [`DeviceAllocator::free`]; [`AllocError::Poisoned`].
    pub fn free_if_unlocked(&self, ptr: DevicePtr) -> Result<bool, AllocError> {
        self.with_owner_waiting(ptr, false, |d| d.free(ptr))
            .map_or(Ok(false), |r| r.map(|()| true))
    }

    /// The device `guard` holds, if it is created and allocated `ptr`.
    fn owning(
        guard: MutexGuard<'_, Option<DeviceAllocator<B>>>,
        ptr: DevicePtr,
    ) -> Option<DeviceGuard<'_, B>> {
        let d = MutexGuard::try_map(guard, |d| d.as_mut()).ok()?;
        d.live.contains_key(&ptr).then(|| DeviceGuard::new(d))
    }

    /// [`DeviceAllocator::record_stream`] on a device.
    pub fn record_stream(
        &self,
        device: i64,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        self.lock(device)?.record_stream(ptr, stream)
    }

    /// [`DeviceAllocator::record_stream`] on the device that allocated
    /// `ptr`, with a stream of device `stream_device` (None: the pointer's
    /// own; Note [Streams of other devices]).
    ///
    /// # Errors
    /// [`AllocError::InvalidDevice`] for a `stream_device` that does not
    /// exist; [`AllocError::InvalidPointer`] (device [`ANY_DEVICE`]) for a
    /// pointer no device allocated.
    ///
    /// [`ANY_DEVICE`]: crate::error::ANY_DEVICE
    pub fn record_stream_anywhere(
        &self,
        ptr: DevicePtr,
        stream: StreamId,
        stream_device: Option<u32>,
    ) -> Result<(), AllocError> {
        if let Some(sd) = stream_device {
            // Its events would go to a context that does not exist.
            self.slot(i64::from(sd))?;
        }
        self.with_owner(ptr, |d| match stream_device {
            Some(sd) => d.record_stream_of_device(ptr, stream, sd),
            None => d.record_stream(ptr, stream),
        })
        .unwrap_or(Err(AllocError::InvalidPointer {
            ptr,
            device: crate::error::ANY_DEVICE,
        }))
    }

    /// PyTorch's `enablePeerAccess(peer, device)`: kernels on `peer` may
    /// now read and write `device`'s memory, so every mapping of `device`,
    /// present and future, is made accessible to `peer` too. Starts
    /// `device` if it was not (peer access is enabled for a copy between
    /// two devices in use).
    ///
    /// # Errors
    /// [`AllocError::InvalidDevice`] for either index; the driver's refusal.
    pub fn add_peer_access(&self, device: i64, peer: i64) -> Result<(), AllocError> {
        let p = self.slot(peer).map(|_| peer as u32)?;
        Ok(self.lock(device)?.backend_mut().add_peer(p)?)
    }

    /// `empty_cache` on every created device.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let r = self.for_each_created(|d| d.empty_cache());
        self.after_deferred_frees(r)
    }

    /// A device's stats; all zero for a device not created yet (which this
    /// does not create).
    pub fn stats(&self, device: i64) -> Result<DeviceStats, AllocError> {
        Ok(match self.peek(device)? {
            Some(d) => d.stats_snapshot(),
            None => DeviceStats::for_config(&self.config),
        })
    }

    /// `reset_peak_memory_stats` on a device; one never used has nothing to
    /// reset and is not started (as PyTorch, which touches no context).
    pub fn reset_peak_stats(&self, device: i64) -> Result<(), AllocError> {
        if let Some(mut d) = self.peek(device)? {
            d.reset_peak_stats();
        }
        Ok(())
    }

    /// `reset_accumulated_memory_stats` on a device; not started if never used.
    pub fn reset_accumulated_stats(&self, device: i64) -> Result<(), AllocError> {
        if let Some(mut d) = self.peek(device)? {
            d.reset_accumulated_stats();
        }
        Ok(())
    }

    /// `set_per_process_memory_fraction` on a device.
    pub fn set_memory_fraction(&self, device: i64, fraction: f64) -> Result<(), AllocError> {
        self.lock(device)?.set_memory_fraction(fraction)
    }

    /// A device's segments and blocks; none for a device not created yet,
    /// which this does not create (a snapshot of another rank's GPU must
    /// not start a context there).
    pub fn snapshot(&self, device: i64) -> Result<Vec<SegmentSnapshot>, AllocError> {
        Ok(self
            .peek_healthy(device)?
            .map(|d| d.snapshot())
            .unwrap_or_default())
    }

    /// [`DeviceAllocator::set_graph_capture_record_stream_reuse`] on a device.
    pub fn set_graph_capture_record_stream_reuse(
        &self,
        device: i64,
        on: bool,
    ) -> Result<(), AllocError> {
        self.lock(device)?.set_graph_capture_record_stream_reuse(on);
        Ok(())
    }

    /// [`DeviceAllocator::begin_allocate_to_pool`] on a device.
    pub fn begin_allocate_to_pool(
        &self,
        device: i64,
        pool: PoolKey,
        filter: Option<StreamFilter>,
    ) -> Result<(), AllocError> {
        self.lock(device)?.begin_allocate_to_pool(pool, filter)
    }

    /// [`DeviceAllocator::end_allocate_to_pool`] on a device.
    pub fn end_allocate_to_pool(&self, device: i64, pool: PoolKey) -> Result<(), AllocError> {
        self.lock(device)?.end_allocate_to_pool(pool)
    }

    /// [`DeviceAllocator::release_pool`] on a device.
    pub fn release_pool(&self, device: i64, pool: PoolKey) -> Result<(), AllocError> {
        let r = self.lock(device)?.release_pool(pool);
        self.after_deferred_frees(r)
    }

    /// [`DeviceAllocator::create_or_incref_pool`] on a device.
    pub fn create_or_incref_pool(&self, device: i64, pool: PoolKey) -> Result<(), AllocError> {
        self.lock(device)?.create_or_incref_pool(pool);
        Ok(())
    }

    /// [`DeviceAllocator::create_or_incref_pool_from`] on a device.
    pub fn create_or_incref_pool_from(
        &self,
        device: i64,
        pool: PoolKey,
        source: Box<dyn SegmentSource>,
    ) -> Result<(), AllocError> {
        self.lock(device)?.create_or_incref_pool_from(pool, source);
        Ok(())
    }

    /// [`DeviceAllocator::set_pool_use_on_oom`] on a device.
    pub fn set_pool_use_on_oom(
        &self,
        device: i64,
        pool: PoolKey,
        on: bool,
    ) -> Result<(), AllocError> {
        self.lock(device)?.set_pool_use_on_oom(pool, on)
    }

    /// [`DeviceAllocator::set_pool_no_split`] on a device.
    pub fn set_pool_no_split(&self, device: i64, pool: PoolKey) -> Result<(), AllocError> {
        self.lock(device)?.set_pool_no_split(pool)
    }

    /// [`DeviceAllocator::pool_use_count`] on a device; 0 on a device not
    /// created yet (which this does not create).
    pub fn pool_use_count(&self, device: i64, pool: PoolKey) -> Result<u32, AllocError> {
        Ok(self.peek(device)?.map_or(0, |d| d.pool_use_count(pool)))
    }

    /// [`DeviceAllocator::empty_pool_cache`] on a device (nothing to do on
    /// one not created yet).
    pub fn empty_pool_cache(&self, device: i64, pool: PoolKey) -> Result<(), AllocError> {
        let r = self
            .with_pool(device, pool, |d| d.empty_pool_cache(pool))
            .or_else(|e| match e {
                AllocError::UnknownPool { .. } => Ok(()),
                e => Err(e),
            });
        self.after_deferred_frees(r)
    }

    /// Runs `f` on a created device (refusing a poisoned one, as
    /// [`lock`](Self::lock) does); on one not created yet, pool `pool`
    /// cannot exist.
    fn with_pool<T, E: From<AllocError>>(
        &self,
        device: i64,
        pool: PoolKey,
        f: impl FnOnce(&mut DeviceAllocator<B>) -> Result<T, E>,
    ) -> Result<T, E> {
        match self.peek_healthy(device)? {
            Some(mut d) => f(&mut d),
            None => Err(AllocError::UnknownPool { pool }.into()),
        }
    }

    /// [`peek`](Self::peek), refusing a poisoned device as
    /// [`lock`](Self::lock) does: for callers that read its blocks, which
    /// a panic may have left half-updated.
    ///
    /// # Errors
    /// [`AllocError::InvalidDevice`]; [`AllocError::Poisoned`].
    pub fn peek_healthy(&self, device: i64) -> Result<Option<DeviceGuard<'_, B>>, AllocError> {
        match self.peek(device)? {
            Some(d) if d.poisoned => Err(AllocError::Poisoned {
                device: device as u32,
            }),
            d => Ok(d),
        }
    }

    /// [`DeviceAllocator::pool_live_allocations`] on a device.
    pub fn pool_live_allocations(
        &self,
        device: i64,
        pool: PoolKey,
    ) -> Result<Vec<DevicePtr>, AllocError> {
        self.with_pool(device, pool, |d| d.pool_live_allocations(pool))
    }

    /// [`DeviceAllocator::pool_checkpoint`] on a device.
    pub fn pool_checkpoint(
        &self,
        device: i64,
        pool: PoolKey,
    ) -> Result<Vec<CheckpointBlock>, AllocError> {
        self.with_pool(device, pool, |d| d.pool_checkpoint(pool))
    }

    /// [`DeviceAllocator::pool_checkpoint_if`] on a device.
    pub fn pool_checkpoint_if(
        &self,
        device: i64,
        pool: PoolKey,
        taken: impl FnOnce(&[CheckpointBlock]) -> bool,
    ) -> Result<Vec<CheckpointBlock>, AllocError> {
        self.with_pool(device, pool, |d| d.pool_checkpoint_if(pool, taken))
    }

    /// [`DeviceAllocator::restore_pool_if`] on a device, under one lock.
    pub fn restore_pool_if<E: From<AllocError>>(
        &self,
        device: i64,
        pool: PoolKey,
        blocks: &[CheckpointBlock],
        accept: impl FnOnce(&RestoreDelta) -> Result<(), E>,
    ) -> Result<RestoreDelta, E> {
        self.with_pool(device, pool, |d| d.restore_pool_if(pool, blocks, accept))
    }
}

/// A locked device. If a panic unwinds while it is held, the device is
/// marked poisoned (`parking_lot` locks do not poison by themselves), and
/// [`Allocator::lock`] refuses it from then on.
pub struct DeviceGuard<'a, B: Backend>(parking_lot::MappedMutexGuard<'a, DeviceAllocator<B>>);

impl<'a, B: Backend> DeviceGuard<'a, B> {
    /// A guard over a locked device: a new call, which reads the clock
    /// afresh (Note [One clock for decisions and traces]).
    fn new(mut d: parking_lot::MappedMutexGuard<'a, DeviceAllocator<B>>) -> Self {
        d.begin_call();
        DeviceGuard(d)
    }
}

impl<B: Backend> std::ops::Deref for DeviceGuard<'_, B> {
    type Target = DeviceAllocator<B>;
    fn deref(&self) -> &DeviceAllocator<B> {
        &self.0
    }
}

impl<B: Backend> std::ops::DerefMut for DeviceGuard<'_, B> {
    fn deref_mut(&mut self) -> &mut DeviceAllocator<B> {
        &mut self.0
    }
}

impl<B: Backend> Drop for DeviceGuard<'_, B> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poisoned = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimBackend;

    fn two_devices() -> Arc<Allocator<SimBackend>> {
        Arc::new(Allocator::new(
            Config::default(),
            2,
            Box::new(|_| Ok(SimBackend::new(1 << 30))),
        ))
    }

    /// A deleter's free (no device) of device 1's memory while device 0 is
    /// held elsewhere finishes without waiting for device 0.
    #[test]
    fn a_free_without_a_device_does_not_wait_for_another_busy_device() {
        let a = two_devices();
        let p0 = a.malloc(0, 1 << 20, 0).unwrap();
        let p1 = a.malloc(1, 1 << 20, 0).unwrap();
        let held = a.lock(0).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let b = Arc::clone(&a);
        std::thread::spawn(move || tx.send(b.free(-1, p1)).unwrap());
        let freed = rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(held);
        assert!(matches!(freed, Ok(Ok(()))), "{freed:?}");
        assert_eq!(a.stats(1).unwrap().allocated_bytes.all.current, 0);
        a.free(-1, p0).unwrap();
        assert!(matches!(
            a.free(-1, p0),
            Err(AllocError::InvalidPointer { .. })
        ));
        a.lock(0).unwrap().check_invariants().unwrap();
        a.lock(1).unwrap().check_invariants().unwrap();
    }

    /// A free that names a device that does not exist finds the pointer
    /// where it lives, as one that names none does, instead of leaving it
    /// allocated; a pointer no device owns still fails on the device.
    #[test]
    fn a_free_naming_no_such_device_frees_where_the_pointer_lives() {
        let a = two_devices();
        let p = a.malloc(1, 3 << 20, 0).unwrap();
        a.free(7, p).unwrap();
        assert_eq!(a.stats(1).unwrap().allocated_bytes.all.current, 0);
        assert!(matches!(
            a.free(7, p),
            Err(AllocError::InvalidDevice { device: 7, .. })
        ));
        a.lock(1).unwrap().check_invariants().unwrap();
    }
}
