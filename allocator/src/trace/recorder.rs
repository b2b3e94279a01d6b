//! Recording: per-device buffers filled under the device lock, handed whole
//! to one writer thread.
//!
//! The allocating thread does no I/O and never blocks: [`DeviceTrace::record`]
//! pushes 48 bytes into a preallocated `Vec`, and
//! when the buffer is full offers it to the writer through a bounded channel
//! with `try_send`. If the channel is full the buffer's events are counted as
//! dropped and the buffer is reused; the count travels with the next buffer
//! that gets through and is written into the trace as a DROPPED block.
//! Memory is bounded by `channel_blocks + 1` buffers per device plus the
//! recycled spares. Timestamps are the device's clock, read once per call
//! (Note [One clock for decisions and traces] in `clock.rs`); the writer
//! thread makes them relative to the trace's start.

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::backend::{DevicePtr, StreamId};
use crate::trace::format::{MAX_DEVICES, TraceHeader};
use crate::trace::writer::TraceWriter;
use crate::trace::{Action, TraceEvent};

// Note [A trace read through a pipe]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `GPUALLOC_TRACE` may name a named pipe, read by a compressor as the
// trace comes (`trace_file.rs`). When the reader goes away first, a write
// raises SIGPIPE, whose default action kills the process: every C or C++
// program that loads the library, and a Python program that restored the
// default. The writer thread blocks SIGPIPE for itself alone (signal masks
// are per thread), so its write fails with EPIPE instead, which ends the
// trace with an error as any failed write does; the program runs on.

/// Blocks SIGPIPE on the calling thread (Note [A trace read through a pipe]).
fn without_sigpipe() {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
    let mut pipe = SigSet::empty();
    pipe.add(Signal::SIGPIPE);
    // Fails only for an invalid `how`; without the mask a write may still
    // raise SIGPIPE, as before.
    let _ = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&pipe), None);
}

/// How a trace is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceOptions {
    /// Events per device buffer (one block in the file).
    pub buffer_events: usize,
    /// Full buffers that may wait for the writer before events are dropped.
    pub channel_blocks: usize,
    /// Wait for the writer instead of dropping (offline generators and tests only:
    /// an allocating thread may then block).
    pub lossless: bool,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions {
            buffer_events: 4096,
            channel_blocks: 64,
            lossless: false,
        }
    }
}

/// What [`trace_stop`](crate::Allocator::trace_stop) reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceSummary {
    /// Events written to the file.
    pub events: u64,
    /// Events recorded but not written (writer behind, or an I/O error).
    pub dropped: u64,
    /// Bytes of the file.
    pub bytes: u64,
}

pub(crate) enum Msg {
    Events {
        device: u32,
        events: Vec<TraceEvent>,
        dropped: u64,
    },
    Flush(Sender<io::Result<()>>),
    Stop,
}

static NEXT_THREAD: AtomicU32 = AtomicU32::new(1);
thread_local! {
    static THREAD: Cell<u32> = const { Cell::new(0) };
}

/// A small integer naming the calling thread (1, 2, ... in order of first
/// use); 0 once the thread's thread-locals are being destroyed (a call from
/// a thread-exit destructor).
#[inline]
pub fn thread_id() -> u32 {
    THREAD
        .try_with(|t| {
            let id = t.get();
            if id != 0 {
                return id;
            }
            let id = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            t.set(id);
            id
        })
        .unwrap_or(0)
}

/// One process's ends of the writer's channels: events go out on `tx`,
/// emptied buffers come back on `spare`.
#[derive(Clone)]
struct Ends {
    tx: Sender<Msg>,
    spare: Receiver<Vec<TraceEvent>>,
    /// The process that started the trace, whose writer thread reads `tx`.
    pid: u32,
}

impl Ends {
    /// Whether this process writes the trace: not a child forked from the
    /// one that started it (Note [Traces across fork]).
    fn is_own(&self) -> bool {
        self.pid == std::process::id()
    }
}

impl Drop for Ends {
    /// Note [Traces across fork]: a forked child never lets go of its copy
    /// of the parent's ends. Dropping the last of them would disconnect the
    /// channel, which takes a lock that the parent's writer thread may have
    /// held at the fork (crossbeam's waker mutex, taken as the writer
    /// starts or stops waiting): the child would wait forever, the likeliest
    /// cause of a hang of the Python package's fork test (3 runs in 40,
    /// once). The copy is leaked instead, in place of ends of a channel of
    /// its own.
    fn drop(&mut self) {
        if !self.is_own() {
            std::mem::forget(std::mem::replace(
                &mut self.tx,
                crossbeam_channel::bounded(0).0,
            ));
            std::mem::forget(std::mem::replace(
                &mut self.spare,
                crossbeam_channel::never(),
            ));
        }
    }
}

struct Sink {
    ends: Ends,
    lossless: bool,
}

/// One device's trace buffer.
pub struct DeviceTrace {
    device: u32,
    buf: Vec<TraceEvent>,
    cap: usize,
    /// The clock reading at the trace's start, subtracted from every stamp.
    start_ns: u64,
    sink: Option<Sink>,
    /// Dropped since the last buffer that reached the writer.
    dropped_pending: u64,
    dropped_total: u64,
    dropped_synced: u64,
    /// Events of each device the writer received but could not write.
    lost: Option<Lost>,
    /// The count of phase pushes and pops when this device joined (Note
    /// [Phases of a device that joins]).
    joined_phase_op: u64,
}

/// Per device, events the writer thread received but could not write (an
/// I/O error); the device's trace moves them into its dropped count.
type Lost = Arc<[AtomicU64]>;

impl DeviceTrace {
    /// A buffer for `device` that keeps every event in memory (tests, tools).
    pub fn in_memory(device: u32) -> DeviceTrace {
        DeviceTrace {
            device,
            buf: Vec::new(),
            cap: usize::MAX,
            start_ns: 0,
            sink: None,
            dropped_pending: 0,
            dropped_total: 0,
            dropped_synced: 0,
            lost: None,
            joined_phase_op: 0,
        }
    }

    /// Whether this device joined after phase push or pop number `op`, so
    /// that the phases it replayed when it joined include it (Note [Phases
    /// of a device that joins]).
    pub(crate) fn joined_after(&self, op: u64) -> bool {
        self.joined_phase_op >= op
    }

    /// Appends one event at clock reading `time` (nanoseconds, the clock of
    /// [`clock::now_ns`](crate::clock::now_ns) or the device's). Never blocks
    /// (unless the trace is lossless) and never does I/O.
    #[inline]
    pub fn record(
        &mut self,
        time: u64,
        action: Action,
        stream: StreamId,
        addr: DevicePtr,
        size: u64,
        aux: u64,
    ) {
        self.buf.push(TraceEvent {
            time_ns: time,
            action,
            device: self.device,
            stream,
            addr,
            size,
            aux,
            thread: thread_id(),
        });
        if self.buf.len() >= self.cap {
            self.hand_off();
        }
    }

    /// Events this buffer could not hand to the writer, since it was created.
    pub fn dropped(&self) -> u64 {
        self.dropped_total
    }

    /// Dropped events not yet reported through this method (for
    /// `DeviceStats::num_trace_dropped`): those the channel refused and
    /// those the writer could not write.
    #[inline]
    pub fn take_unsynced_drops(&mut self) -> u64 {
        if let Some(c) = self.lost.as_ref().and_then(|l| l.get(self.device as usize))
            // A relaxed load first: this runs on every event.
            && c.load(Ordering::Relaxed) != 0
        {
            self.dropped_total += c.swap(0, Ordering::Relaxed);
        }
        let n = self.dropped_total - self.dropped_synced;
        self.dropped_synced = self.dropped_total;
        n
    }

    /// The events buffered so far, timestamps relative to the trace's start
    /// (in-memory buffers keep everything, and their stamps as given).
    pub fn take_events(&mut self) -> Vec<TraceEvent> {
        let mut v = Vec::with_capacity(self.buf.len());
        for mut e in std::mem::take(&mut self.buf) {
            e.time_ns = e.time_ns.saturating_sub(self.start_ns);
            crate::trace::reader::expand(e, &mut v);
        }
        v
    }

    #[cold]
    fn hand_off(&mut self) {
        if self.sink.as_ref().is_some_and(|s| !s.ends.is_own()) {
            // A forked child's copy (Note [Traces across fork]): nothing
            // reads the channel here, and a send could spin forever on a
            // lock of the channel that the parent's writer thread held at
            // the fork. The child lets go of the channel and drops what it
            // records until a trace of its own starts.
            self.sink = None;
        }
        let Some(sink) = &self.sink else {
            let full = std::mem::take(&mut self.buf);
            self.drop_events(full);
            return;
        };
        let fresh = sink
            .ends
            .spare
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(self.cap));
        let full = std::mem::replace(&mut self.buf, fresh);
        let msg = Msg::Events {
            device: self.device,
            events: full,
            dropped: self.dropped_pending,
        };
        let refused = if sink.lossless {
            sink.ends.tx.send(msg).err().map(|e| e.0)
        } else {
            match sink.ends.tx.try_send(msg) {
                Ok(()) => None,
                Err(TrySendError::Full(m) | TrySendError::Disconnected(m)) => Some(m),
            }
        };
        match refused {
            None => self.dropped_pending = 0,
            Some(Msg::Events { events, .. }) => self.drop_events(events),
            Some(_) => unreachable!("only events are sent here"),
        }
    }

    /// Counts `events` as dropped and makes their emptied buffer the one
    /// recorded into (its capacity kept).
    fn drop_events(&mut self, mut events: Vec<TraceEvent>) {
        let n = crate::trace::reader::event_count(&events);
        self.dropped_pending += n;
        self.dropped_total += n;
        events.clear();
        self.buf = events;
    }

    /// The buffered events and the pending drop count as a message (flush,
    /// stop). The buffer that replaces them has the full capacity, so that
    /// recording after a flush does not grow it again, reallocating under
    /// the device lock.
    pub(crate) fn take_batch(&mut self) -> Option<Msg> {
        if self.buf.is_empty() && self.dropped_pending == 0 {
            return None;
        }
        let fresh = match &self.sink {
            Some(s) => s
                .ends
                .spare
                .try_recv()
                .unwrap_or_else(|_| Vec::with_capacity(self.cap)),
            // In memory (`cap` unbounded): grows as it records.
            None => Vec::new(),
        };
        let events = std::mem::replace(&mut self.buf, fresh);
        let dropped = std::mem::take(&mut self.dropped_pending);
        Some(Msg::Events {
            device: self.device,
            events,
            dropped,
        })
    }

    /// Hands everything buffered to the writer, waiting if the channel is full.
    pub(crate) fn finish(mut self) {
        self.send_rest();
    }

    /// Lets go of the buffer without handing it to the writer: for a forked
    /// child's copy, whose channel nothing reads (Note [Traces across fork]).
    pub(crate) fn abandon(mut self) {
        self.sink = None;
    }

    fn send_rest(&mut self) {
        let Some(tx) = self.sink.as_ref().map(|s| s.ends.tx.clone()) else {
            return;
        };
        if let Some(Msg::Events {
            events, dropped, ..
        }) = self.take_batch()
        {
            let n = crate::trace::reader::event_count(&events);
            if tx
                .send(Msg::Events {
                    device: self.device,
                    events,
                    dropped,
                })
                .is_err()
            {
                self.dropped_total += n;
            }
        }
    }
}

impl Drop for DeviceTrace {
    fn drop(&mut self) {
        self.send_rest();
    }
}

/// Most distinct phase and mark names a trace keeps (the rest share one entry).
const MAX_STRINGS: usize = 1 << 16;

struct Strings {
    ids: FxHashMap<String, u64>,
    table: Vec<String>,
}

/// What a device that joins a running trace replays, and what orders its
/// joining against phase operations and marks (Note [Phases of a device
/// that joins] in `trace_control.rs`).
#[derive(Default)]
struct Joining {
    /// The open phases, innermost last, each with its push's number among
    /// pushes and pops.
    phases: Vec<(u64, u64)>,
    /// Phase pushes and pops so far.
    ops: u64,
    /// Device traces made so far.
    devices: usize,
    /// Marks made before any device joined, with the time each was made
    /// and the number of phase pushes and pops before it: the first to
    /// join records them (at the time it joins, before its first event,
    /// each in its place among the open phases it replays); at the stop,
    /// device 0 does if none joined.
    early_marks: Vec<(u64, u64, u64)>,
}

/// Process-wide state of a running trace.
pub struct Recorder {
    opts: TraceOptions,
    /// [`clock::now_ns`](crate::clock::now_ns) at the start.
    start_ns: u64,
    ends: Ends,
    strings: Arc<Mutex<Strings>>,
    /// What a device that joins replays (Note [Phases of a device that
    /// joins] in `trace_control.rs`).
    joining: Mutex<Joining>,
    writer: Mutex<Option<JoinHandle<io::Result<TraceSummary>>>>,
    path: std::path::PathBuf,
    lost: Lost,
}

impl Recorder {
    /// Creates the file, writes the header, and starts the writer thread.
    /// A relative `path` is made absolute first, against the current
    /// folder: the writer checks the path it writes against the file
    /// (`check_path`), and a relative one would name another file once the
    /// program changes folder (a flush or stop then said the events were
    /// lost, of a file that was whole).
    pub fn start(
        path: &Path,
        config: &str,
        device_count: u32,
        opts: TraceOptions,
    ) -> io::Result<Recorder> {
        let opts = TraceOptions {
            buffer_events: opts.buffer_events.max(1),
            ..opts
        };
        let start_unix_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let header = TraceHeader {
            start_unix_ns,
            device_count,
            pid: std::process::id(),
            config: config.to_string(),
            producer: crate::trace::producer(),
        };
        // A header a reader would refuse (a configuration string above the
        // limit) is refused before the file is created.
        TraceWriter::new(io::sink(), &header)?;
        let path = std::path::absolute(path)?;
        // One writer per path (Note [One writer per trace file]): the path
        // written may be another, beside it.
        let (file, path) = crate::trace::trace_file::create(&path)?;
        let path = path.as_path();
        let writer = TraceWriter::new(file, &header)?;
        let start_ns = crate::clock::now_ns();
        let (tx, rx) = crossbeam_channel::bounded(opts.channel_blocks);
        let (spare_tx, spare) = crossbeam_channel::bounded(opts.channel_blocks);
        let strings = Arc::new(Mutex::new(Strings {
            ids: FxHashMap::default(),
            table: Vec::new(),
        }));
        let lost: Lost = (0..MAX_DEVICES).map(|_| AtomicU64::new(0)).collect();
        let ctx = WriterCtx {
            start_ns,
            strings: strings.clone(),
            spare: spare_tx,
            lost: lost.clone(),
            path: path.to_path_buf(),
        };
        let handle = std::thread::Builder::new()
            .name("gpualloc-trace".into())
            .spawn(move || {
                without_sigpipe();
                ctx.run(writer, rx)
            })?;
        Ok(Recorder {
            opts,
            start_ns,
            ends: Ends {
                tx,
                spare,
                pid: std::process::id(),
            },
            strings,
            joining: Mutex::new(Joining::default()),
            writer: Mutex::new(Some(handle)),
            path: path.to_path_buf(),
            lost,
        })
    }

    /// Whether this process writes the trace: not in a child forked from
    /// the process that started it, which has no writer thread (Note
    /// [Traces across fork]).
    pub fn is_own(&self) -> bool {
        self.ends.is_own()
    }

    fn foreign(&self) -> io::Error {
        io::Error::other(format!(
            "the trace {} is written by process {}, which this process was forked from",
            self.path.display(),
            self.ends.pid
        ))
    }

    /// The file being written (an absolute path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The buffer a device records into, joining at clock reading `now`. A
    /// device that joins while phases are open starts with their
    /// `phase_push` events.
    pub fn device_trace(&self, device: u32, now: u64) -> DeviceTrace {
        self.join(device, now, |_| now)
    }

    /// [`device_trace`](Self::device_trace), recording each held mark at
    /// `mark_time` of the time it was made. A held mark goes before the
    /// open phases pushed after it, so that it is not recorded inside a
    /// phase it was made outside of.
    fn join(&self, device: u32, now: u64, mark_time: impl Fn(u64) -> u64) -> DeviceTrace {
        let mut t = DeviceTrace {
            device,
            buf: Vec::with_capacity(self.opts.buffer_events),
            cap: self.opts.buffer_events,
            start_ns: self.start_ns,
            sink: Some(Sink {
                ends: self.ends.clone(),
                lossless: self.opts.lossless,
            }),
            dropped_pending: 0,
            dropped_total: 0,
            dropped_synced: 0,
            lost: Some(self.lost.clone()),
            joined_phase_op: 0,
        };
        let mut j = self.joining.lock();
        let mut marks = std::mem::take(&mut j.early_marks).into_iter().peekable();
        for &(id, pushed) in &j.phases {
            while let Some((mark, at, _)) = marks.next_if(|&(_, _, ops)| ops < pushed) {
                t.record(mark_time(at), Action::Mark, 0, 0, 0, mark);
            }
            t.record(now, Action::PhasePush, 0, 0, 0, id);
        }
        for (mark, at, _) in marks {
            t.record(mark_time(at), Action::Mark, 0, 0, 0, mark);
        }
        t.joined_phase_op = j.ops;
        j.devices += 1;
        t
    }

    /// Records on device 0, each at the time it was made, the marks no
    /// device took because none ever joined: a process whose allocations
    /// all bypassed the allocator (PyTorch's caching allocator switched off
    /// for good with `PYTORCH_NO_CUDA_MEMORY_CACHING=1`, whose mark says
    /// so) would otherwise leave a trace that says nothing. For the stop,
    /// after the devices have detached.
    pub(crate) fn record_held_marks(&self) {
        let first = {
            let j = self.joining.lock();
            if j.devices > 0 {
                return;
            }
            let Some(&(_, first, _)) = j.early_marks.first() else {
                return;
            };
            first
        };
        self.join(0, first, |at| at).finish();
    }

    /// Keeps mark `id` for the first device to join, when none has joined
    /// yet; false otherwise (the caller records it on the devices). Decided
    /// under the lock a device joins under, so no device joins in between
    /// and misses it.
    pub(crate) fn hold_mark_if_alone(&self, id: u64, now: u64) -> bool {
        let mut j = self.joining.lock();
        if j.devices > 0 {
            return false;
        }
        let ops = j.ops;
        j.early_marks.push((id, now, ops));
        true
    }

    /// Events of `device` the writer could not write and no device trace
    /// has taken into its dropped count yet (after the devices detach).
    pub(crate) fn take_lost(&self, device: u32) -> u64 {
        self.lost
            .get(device as usize)
            .map_or(0, |c| c.swap(0, Ordering::Relaxed))
    }

    /// The string id of `s`, adding it to the table.
    pub fn intern(&self, s: &str) -> u64 {
        let mut st = self.strings.lock();
        if let Some(&id) = st.ids.get(s) {
            return id;
        }
        // Memory stays bounded even when every mark has a new name
        // (`mark(f"step {i}")`): past the limit, new names share one entry.
        if st.table.len() >= MAX_STRINGS {
            return self.overflow_id(&mut st);
        }
        let id = st.table.len() as u64;
        st.table.push(s.to_string());
        st.ids.insert(s.to_string(), id);
        id
    }

    #[cold]
    fn overflow_id(&self, st: &mut Strings) -> u64 {
        const OVERFLOW: &str = "(more names than the trace keeps)";
        if let Some(&id) = st.ids.get(OVERFLOW) {
            return id;
        }
        let id = st.table.len() as u64;
        st.table.push(OVERFLOW.to_string());
        st.ids.insert(OVERFLOW.to_string(), id);
        id
    }

    /// Opens a phase; returns its string id.
    /// Returns its id and the push's number among pushes and pops.
    pub(crate) fn push_phase(&self, name: &str) -> (u64, u64) {
        let id = self.intern(name);
        let mut j = self.joining.lock();
        j.ops += 1;
        let op = j.ops;
        j.phases.push((id, op));
        (id, op)
    }

    /// Closes the innermost phase; its id and the pop's number among pushes
    /// and pops, or `None` when none is open.
    pub(crate) fn pop_phase(&self) -> Option<(u64, u64)> {
        let mut j = self.joining.lock();
        let (id, _) = j.phases.pop()?;
        j.ops += 1;
        Some((id, j.ops))
    }

    /// Sends a message, waiting for room (control paths only).
    pub(crate) fn send(&self, msg: Msg) {
        let _ = self.ends.tx.send(msg);
    }

    /// Waits until everything sent so far is written and flushed.
    pub(crate) fn flush(&self) -> io::Result<()> {
        if !self.is_own() {
            return Err(self.foreign()); // no writer would ever answer
        }
        let (ack_tx, ack) = crossbeam_channel::bounded(1);
        self.ends
            .tx
            .send(Msg::Flush(ack_tx))
            .map_err(|_| io::Error::other("gpualloc trace writer has stopped"))?;
        ack.recv()
            .map_err(|_| io::Error::other("gpualloc trace writer has stopped"))?
    }

    /// Stops the writer: writes the END block, closes the file.
    pub(crate) fn stop(&self) -> io::Result<TraceSummary> {
        let Some(handle) = self.writer.lock().take() else {
            return Err(io::Error::other("gpualloc trace already stopped"));
        };
        if !self.is_own() {
            // The writer thread is the parent's: nothing here to join or
            // detach.
            std::mem::forget(handle);
            return Err(self.foreign());
        }
        let _ = self.ends.tx.send(Msg::Stop);
        handle
            .join()
            .map_err(|_| io::Error::other("gpualloc trace writer panicked"))?
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

struct WriterCtx {
    start_ns: u64,
    strings: Arc<Mutex<Strings>>,
    spare: Sender<Vec<TraceEvent>>,
    lost: Lost,
    path: std::path::PathBuf,
}

impl WriterCtx {
    fn run(self, mut w: TraceWriter<File>, rx: Receiver<Msg>) -> io::Result<TraceSummary> {
        let mut failed: Option<io::Error> = None;
        let mut lost = 0u64;
        let mut last_ns = 0u64;
        for msg in rx.iter() {
            match msg {
                Msg::Events {
                    device,
                    mut events,
                    dropped,
                } => {
                    for e in &mut events {
                        e.time_ns = e.time_ns.saturating_sub(self.start_ns);
                    }
                    if let Some(l) = events.last() {
                        last_ns = last_ns.max(l.time_ns);
                    }
                    if failed.is_none() {
                        let r = self.write(&mut w, device, &events, dropped, last_ns);
                        if let Err(e) = r {
                            failed = Some(e);
                        }
                    }
                    if failed.is_some() {
                        let n = crate::trace::reader::event_count(&events);
                        lost += n + dropped;
                        if let Some(c) = self.lost.get(device as usize) {
                            c.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                    events.clear();
                    let _ = self.spare.try_send(events);
                }
                Msg::Flush(ack) => {
                    let r = match &failed {
                        Some(e) => Err(io::Error::new(e.kind(), e.to_string())),
                        None => w.flush().and_then(|()| self.still_there(w.get_ref(), &w)),
                    };
                    let _ = ack.send(r);
                }
                Msg::Stop => break,
            }
        }
        if let Some(e) = failed {
            return Err(io::Error::new(
                e.kind(),
                format!("{e} ({lost} trace events could not be written)"),
            ));
        }
        self.sync_strings(&mut w)?;
        let end_ns = crate::clock::now_ns()
            .saturating_sub(self.start_ns)
            .max(last_ns);
        let (events, dropped) = (w.events(), w.dropped());
        let (file, _) = w.finish(Some(end_ns))?;
        let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        self.check_path(&file, events, bytes)?;
        Ok(TraceSummary {
            events,
            dropped,
            bytes,
        })
    }

    fn still_there(&self, file: &File, w: &TraceWriter<File>) -> io::Result<()> {
        self.check_path(file, w.events(), w.bytes())
    }

    /// An error when the path no longer names the file being written (its
    /// directory removed, the file deleted or replaced): the writes
    /// succeeded, into a file nobody can open.
    fn check_path(&self, file: &File, events: u64, bytes: u64) -> io::Result<()> {
        let open = file.metadata()?;
        let same = std::fs::metadata(&self.path).is_ok_and(|m| same_file(&m, &open));
        if same {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "the file was removed or replaced while it was written: its {events} events ({bytes} bytes) are lost"
            ),
        ))
    }

    fn write(
        &self,
        w: &mut TraceWriter<File>,
        device: u32,
        events: &[TraceEvent],
        dropped: u64,
        now: u64,
    ) -> io::Result<()> {
        self.sync_strings(w)?;
        if dropped > 0 {
            w.write_dropped(device, dropped, now)?;
        }
        w.write_events(device, events)
    }

    fn sync_strings(&self, w: &mut TraceWriter<File>) -> io::Result<()> {
        let new: Vec<String> = {
            let st = self.strings.lock();
            st.table[w.string_count() as usize..].to_vec()
        };
        w.write_strings(&new)
    }
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    a.len() == b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flush takes the buffer's events and leaves a buffer of full
    /// capacity, not an empty `Vec` that regrows over the next events.
    #[test]
    fn a_taken_batch_leaves_a_buffer_of_full_capacity() {
        let path = crate::trace::control_tests_path("batch-capacity");
        let opts = TraceOptions {
            buffer_events: 64,
            ..TraceOptions::default()
        };
        let rec = Recorder::start(&path, "", 1, opts).unwrap();
        let mut t = rec.device_trace(0, rec.start_ns);
        for i in 0..10 {
            t.record(rec.start_ns + i, Action::Mark, 0, 0, 0, 0);
        }
        let batch = t.take_batch().expect("ten events");
        assert!(t.buf.is_empty());
        assert!(t.buf.capacity() >= 64, "{}", t.buf.capacity());
        rec.send(batch);
        t.finish();
        assert_eq!(rec.stop().unwrap().events, 10);
        std::fs::remove_file(rec.path()).unwrap();
    }

    /// Note [Traces across fork]: a forked child's copy of a device buffer
    /// never sends on the parent's channel (a send could spin on a lock
    /// the parent's writer thread held at the fork); what it records is
    /// counted as dropped, in bounded memory.
    #[test]
    fn a_forked_childs_buffer_lets_the_channel_go_and_drops_its_events() {
        let path = crate::trace::control_tests_path("forked-buffer");
        let opts = TraceOptions {
            buffer_events: 64,
            ..TraceOptions::default()
        };
        let rec = Recorder::start(&path, "", 1, opts).unwrap();
        let mut t = rec.device_trace(0, rec.start_ns);
        // As in a child: the channel's reader is another process's thread.
        t.sink.as_mut().unwrap().ends.pid = std::process::id().wrapping_add(1);
        for i in 0..1000 {
            t.record(rec.start_ns + i, Action::Mark, 0, 0, 0, 0);
            assert!(t.buf.len() <= 64, "bounded: {}", t.buf.len());
        }
        assert!(t.sink.is_none(), "the channel is let go of");
        assert_eq!(t.dropped(), 1000 / 64 * 64);
        t.abandon();
        assert_eq!(rec.stop().unwrap().events, 0, "nothing reached the writer");
        std::fs::remove_file(rec.path()).unwrap();
    }

    /// Note [Traces across fork]: a forked child's copy of the channel
    /// ends is leaked, never dropped: dropping the last of them would
    /// disconnect the parent's channel, under a lock its writer thread may
    /// have held at the fork. Its own process's ends disconnect as usual.
    #[test]
    fn a_forked_childs_channel_ends_are_leaked_not_dropped() {
        use crossbeam_channel::{TryRecvError, TrySendError};
        for (pid, leaked) in [
            (std::process::id().wrapping_add(1), true),
            (std::process::id(), false),
        ] {
            let (tx, rx) = crossbeam_channel::bounded::<Msg>(1);
            let (spare_tx, spare) = crossbeam_channel::bounded(1);
            drop(Ends { tx, spare, pid });
            if leaked {
                assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
                assert!(spare_tx.try_send(Vec::new()).is_ok());
            } else {
                assert!(matches!(rx.try_recv(), Err(TryRecvError::Disconnected)));
                assert!(matches!(
                    spare_tx.try_send(Vec::new()),
                    Err(TrySendError::Disconnected(_))
                ));
            }
        }
    }

    /// Note [Phases of a device that joins]: a device that joins between a
    /// push (or pop) and its visit of the devices replayed it already; one
    /// that joined before did not.
    #[test]
    fn a_device_that_joins_after_a_phase_operation_is_passed_over_by_it() {
        let path = crate::trace::control_tests_path("phase-join");
        let rec = Recorder::start(&path, "", 2, TraceOptions::default()).unwrap();
        let early = rec.device_trace(0, rec.start_ns);
        let (id, push) = rec.push_phase("p");
        let late = rec.device_trace(1, rec.start_ns);
        assert!(
            !early.joined_after(push),
            "joined before: it records the push"
        );
        assert!(late.joined_after(push), "joined after: its replay had it");
        let replayed = late
            .buf
            .iter()
            .filter(|e| e.action == Action::PhasePush)
            .count();
        assert_eq!(replayed, 1);
        let (popped, pop) = rec.pop_phase().unwrap();
        assert_eq!(popped, id);
        assert!(pop > push);
        let later = rec.device_trace(1, rec.start_ns);
        assert!(late.joined_after(push) && !late.joined_after(pop));
        assert!(
            later.joined_after(pop),
            "joined after the pop: nothing to close"
        );
        assert!(later.buf.is_empty(), "no phase open when it joined");
        for t in [early, late, later] {
            t.finish();
        }
        rec.stop().unwrap();
        std::fs::remove_file(rec.path()).unwrap();
    }

    /// A mark made before any device joined goes to the first that joins;
    /// once one has, marks are the caller's to record on the devices.
    #[test]
    fn a_mark_before_any_device_is_kept_for_the_first_to_join() {
        let path = crate::trace::control_tests_path("early-mark");
        let rec = Recorder::start(&path, "", 2, TraceOptions::default()).unwrap();
        let id = rec.intern("start");
        assert!(rec.hold_mark_if_alone(id, rec.start_ns));
        let first = rec.device_trace(0, rec.start_ns);
        let marks = |t: &DeviceTrace| t.buf.iter().filter(|e| e.action == Action::Mark).count();
        assert_eq!(marks(&first), 1);
        assert!(
            !rec.hold_mark_if_alone(id, rec.start_ns),
            "a device has joined"
        );
        let second = rec.device_trace(1, rec.start_ns);
        assert_eq!(marks(&second), 0, "held marks go to the first only");
        first.finish();
        second.finish();
        rec.stop().unwrap();
        std::fs::remove_file(rec.path()).unwrap();
    }
}
