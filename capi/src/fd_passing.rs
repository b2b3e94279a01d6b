//! Copies of exported memory descriptors, from the sending process to the
//! receiving one.
//!
//! Note [Descriptor passing]
//! Rationale: a share names descriptor numbers that are open in the
//! sender. PyTorch's receiver copies them out with `pidfd_getfd`, which
//! needs ptrace rights over the sender; unprivileged containers refuse it
//! (pytorch#165685), and the tensor never arrives.
//! Approach: the first share starts a thread in the sender that listens on
//! the abstract Unix socket `gpualloc-ipc-<pid>`. A receiver connects,
//! names the descriptors it needs, and gets copies of them as `SCM_RIGHTS`
//! ancillary data. The server answers only a peer of the same user (or
//! root), checked as soon as it connects, each connection on its own thread
//! with a deadline; the receiver, in turn, accepts only a server that is
//! process `<pid>` itself of its own user (or root), so a name squatted by
//! another process, or a process with the same pid in another pid
//! namespace sharing the network namespace, is never believed. The server
//! hands out only descriptors of exported memory handles
//! (`exported::duplicate`, which copies under the same lock that closes
//! them, so a reused number is never sent); anything else is refused with
//! the reason. Without the socket (a sender under PyTorch's allocator, or
//! in another network namespace) the receiver falls back to `pidfd_getfd`,
//! as PyTorch does, and reports both failures if that fails too.
//! Any process of the same user may ask for any exported handle of this
//! process (as `pidfd_getfd` allows where ptrace is not restricted): the
//! user is the boundary, as for the process's memory.
//!
//! Wire: a request is `"GAFD"`, a u32 count (at most
//! [`MAX_PER_MESSAGE`]), then that many i32 descriptor numbers; a reply is
//! a u32 status (0: the descriptors ride along; 1: refused) and a u32 (the
//! count; or the length of the UTF-8 reason that follows). Little-endian.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

use gpualloc::backend::cuda::exported;
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, getsockopt, recvmsg, sendmsg, sockopt,
};
use parking_lot::Mutex;

/// Descriptors per message, below the kernel's `SCM_MAX_FD` (253).
pub(crate) const MAX_PER_MESSAGE: usize = 250;
const MAGIC: &[u8; 4] = b"GAFD";
/// How long a server waits on a silent client, and a client on the server.
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection may last.
const DEADLINE: Duration = Duration::from_secs(60);

/// The longest wait between two failed `accept`s.
const MAX_ACCEPT_WAIT: Duration = Duration::from_millis(100);

/// Waits between failed `accept`s of the server. A connection that cannot
/// be accepted (this process at its descriptor limit: each exported handle
/// holds one open) stays queued, so retrying at once would spin a CPU until
/// a descriptor frees up: the wait doubles from 1 ms to
/// [`MAX_ACCEPT_WAIT`], and an accepted connection starts it again.
#[derive(Default)]
struct AcceptBackoff {
    failures: u32,
}

impl AcceptBackoff {
    /// The wait after one more failure, and whether it is the first of a
    /// streak (the one to log).
    fn next(&mut self) -> (Duration, bool) {
        let wait = Duration::from_millis(1 << self.failures.min(7)).min(MAX_ACCEPT_WAIT);
        self.failures = self.failures.saturating_add(1);
        (wait, self.failures == 1)
    }
}

/// The socket name of process `pid`'s server.
fn socket_name(pid: i32) -> String {
    format!("gpualloc-ipc-{pid}")
}

/// The process id whose server runs (a forked child has none).
static SERVING: Mutex<Option<u32>> = Mutex::new(None);

/// Starts this process's descriptor server, once. A failure to listen is
/// logged: receivers then fall back to `pidfd_getfd`.
pub(crate) fn serve() {
    let pid = std::process::id();
    let mut serving = SERVING.lock();
    if *serving == Some(pid) {
        return;
    }
    *serving = Some(pid);
    let listener = SocketAddr::from_abstract_name(socket_name(pid as i32).as_bytes())
        .and_then(|a| UnixListener::bind_addr(&a));
    let listener = match listener {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(
                "gpualloc: no descriptor socket for shared memory: the name gpualloc-ipc-{pid} is taken ({e}); receivers will need pidfd_getfd"
            );
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("gpualloc-ipc".into())
        .spawn(move || {
            let mut backoff = AcceptBackoff::default();
            for stream in listener.incoming() {
                let stream = match stream {
                    Ok(s) => {
                        backoff = AcceptBackoff::default();
                        s
                    }
                    Err(e) => {
                        let (wait, first) = backoff.next();
                        if first {
                            tracing::warn!(
                                "gpualloc: the descriptor server cannot accept a connection ({e}); it retries, waiting up to {} ms",
                                MAX_ACCEPT_WAIT.as_millis()
                            );
                        }
                        std::thread::sleep(wait);
                        continue;
                    }
                };
                if !same_user(&stream) {
                    continue; // dropped: closed at once
                }
                let conn = std::thread::Builder::new()
                    .name("gpualloc-ipc-conn".into())
                    .spawn(move || {
                        if let Err(e) = answer(stream) {
                            tracing::debug!("gpualloc: descriptor request failed: {e}");
                        }
                    });
                if let Err(e) = conn {
                    tracing::debug!("gpualloc: cannot serve a descriptor request: {e}");
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("gpualloc: cannot start the descriptor server: {e}");
    }
}

/// This process's effective user.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether the peer of `stream` runs as this process's user, or as root.
fn same_user(stream: &UnixStream) -> bool {
    getsockopt(stream, sockopt::PeerCredentials).is_ok_and(|p| p.uid() == euid() || p.uid() == 0)
}

/// Serves one connection: requests until the client closes it, or the
/// deadline.
fn answer(mut stream: UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    let start = std::time::Instant::now();
    loop {
        if start.elapsed() > DEADLINE {
            return refuse(&stream, "the connection lasted too long");
        }
        let mut head = [0u8; 8];
        match stream.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let n = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
        if &head[..4] != MAGIC || n > MAX_PER_MESSAGE {
            return refuse(&stream, "a malformed request");
        }
        let mut body = vec![0u8; 4 * n];
        stream.read_exact(&mut body)?;
        let fds: Vec<i32> = body
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        match exported::duplicate(&fds) {
            Ok(copies) => {
                let raw: Vec<RawFd> = copies.iter().map(AsRawFd::as_raw_fd).collect();
                let mut reply = [0u8; 8];
                reply[4..].copy_from_slice(&(raw.len() as u32).to_le_bytes());
                let cmsg = [ControlMessage::ScmRights(&raw)];
                sendmsg::<UnixAddr>(
                    stream.as_raw_fd(),
                    &[IoSlice::new(&reply)],
                    if raw.is_empty() { &[] } else { &cmsg },
                    // A receiver gone before the reply (killed, or past its
                    // timeout) is an error here, not a SIGPIPE that a
                    // program restoring the default action dies of.
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )?;
            }
            Err((fd, None)) => {
                return refuse(
                    &stream,
                    &format!(
                        "descriptor {fd} of process {} is not an exported gpualloc memory handle (freed already?)",
                        std::process::id()
                    ),
                );
            }
            // The sender could not copy it: at its descriptor limit (each
            // exported handle holds one open), say.
            Err((fd, Some(e))) => {
                return refuse(
                    &stream,
                    &format!(
                        "process {} could not copy its descriptor {fd} of exported memory to send it ({e}; raise its open files limit, ulimit -n, if it is at it)",
                        std::process::id()
                    ),
                );
            }
        }
    }
}

fn refuse(mut stream: &UnixStream, why: &str) -> std::io::Result<()> {
    let mut reply = vec![0u8; 8];
    reply[..4].copy_from_slice(&1u32.to_le_bytes());
    reply[4..].copy_from_slice(&(why.len() as u32).to_le_bytes());
    reply.extend_from_slice(why.as_bytes());
    stream.write_all(&reply)
}

/// Copies of descriptors `fds` of process `pid`: from its server, else
/// through `pidfd_getfd`.
///
/// # Errors
/// Why neither way worked.
pub(crate) fn fetch(pid: i32, fds: &[i32]) -> Result<Vec<OwnedFd>, String> {
    let connected = SocketAddr::from_abstract_name(socket_name(pid).as_bytes())
        .and_then(|a| UnixStream::connect_addr(&a));
    let connected = connected.and_then(|s| {
        let peer = getsockopt(&s, sockopt::PeerCredentials)?;
        if peer.pid() != pid || (peer.uid() != euid() && peer.uid() != 0) {
            return Err(std::io::Error::other(format!(
                "the socket is held by process {} of user {}, not by process {pid} of user {} or root",
                peer.pid(),
                peer.uid(),
                euid()
            )));
        }
        Ok(s)
    });
    let stream = match connected {
        Ok(s) => s,
        Err(socket) => {
            return pidfd_getfd(pid, fds).map_err(|e| {
                format!(
                    "cannot reach process {pid}'s gpualloc descriptor socket ({socket}), and {e}"
                )
            });
        }
    };
    let mut out = Vec::with_capacity(fds.len());
    for chunk in fds.chunks(MAX_PER_MESSAGE) {
        out.extend(request(&stream, chunk).map_err(|e| format!("process {pid}: {e}"))?);
    }
    Ok(out)
}

fn request(mut stream: &UnixStream, fds: &[i32]) -> Result<Vec<OwnedFd>, String> {
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut msg = MAGIC.to_vec();
    msg.extend_from_slice(&(fds.len() as u32).to_le_bytes());
    for fd in fds {
        msg.extend_from_slice(&fd.to_le_bytes());
    }
    stream
        .write_all(&msg)
        .map_err(|e| format!("sending the request: {e}"))?;
    let mut head = [0u8; 8];
    let mut space = nix::cmsg_space!([RawFd; MAX_PER_MESSAGE]);
    let mut got = Vec::new();
    let read = {
        let mut iov = [IoSliceMut::new(&mut head)];
        let m = recvmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &mut iov,
            Some(space.as_mut_slice()),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| format!("reading the reply: {e}"))?;
        let cmsgs = m.cmsgs().map_err(|e| match e {
            nix::errno::Errno::ENOBUFS => format!(
                "the descriptors did not all arrive: this process may not open {} more (ulimit -n)",
                fds.len()
            ),
            e => format!("reading the reply: {e}"),
        })?;
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(v) = c {
                // SAFETY: each descriptor was just installed in this
                // process by the kernel (SCM_RIGHTS); nothing else owns it.
                got.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        m.bytes
    };
    if read < head.len() {
        stream
            .read_exact(&mut head[read..])
            .map_err(|e| format!("reading the reply: {e}"))?;
    }
    let status = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let n = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
    if status != 0 {
        let mut why = vec![0u8; n.min(4096)];
        let _ = stream.read_exact(&mut why);
        return Err(format!("refused: {}", String::from_utf8_lossy(&why)));
    }
    if got.len() != fds.len() || n != fds.len() {
        return Err(format!(
            "asked for {} descriptors, received {}",
            fds.len(),
            got.len()
        ));
    }
    Ok(got)
}

/// Copies descriptors out of process `pid` with `pidfd_getfd` (Linux 5.6;
/// needs ptrace rights over it).
fn pidfd_getfd(pid: i32, fds: &[i32]) -> Result<Vec<OwnedFd>, String> {
    // SAFETY: a system call with integer arguments only.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(format!(
            "pidfd_open({pid}): {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    let mut out = Vec::with_capacity(fds.len());
    for &fd in fds {
        // SAFETY: a system call with integer arguments only.
        let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if mine < 0 {
            return Err(format!(
                "pidfd_getfd(descriptor {fd} of process {pid}): {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: pidfd_getfd returned a new descriptor that nothing else owns.
        out.push(unsafe { OwnedFd::from_raw_fd(mine as RawFd) });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::{Seek, SeekFrom};

    use super::*;

    /// A file listed as exported memory, its number, and its contents.
    fn listed(text: &str) -> i32 {
        let path =
            std::env::temp_dir().join(format!("gpualloc-fd-{}-{}", std::process::id(), text.len()));
        std::fs::write(&path, text).unwrap();
        let f = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        exported::adopt(OwnedFd::from(f))
    }

    fn contents(fd: OwnedFd) -> String {
        let mut f = File::from(fd);
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn listed_descriptors_arrive_as_copies_and_others_are_refused() {
        let a = listed("first file");
        let b = listed("the second file");
        serve();
        let me = std::process::id() as i32;
        let got = fetch(me, &[b, a, b]).unwrap();
        assert_eq!(got.len(), 3);
        let texts: Vec<String> = got.into_iter().map(contents).collect();
        assert_eq!(texts, ["the second file", "first file", "the second file"]);

        // More than one message's worth.
        let many = vec![a; MAX_PER_MESSAGE * 2 + 3];
        assert_eq!(fetch(me, &many).unwrap().len(), many.len());

        // Standard input is open but not exported memory.
        let err = fetch(me, &[a, 0]).unwrap_err();
        assert!(
            err.contains("descriptor 0") && err.contains("not an exported"),
            "{err}"
        );

        // Closed and unlisted: refused, even if the number is reused.
        exported::close(a);
        let err = fetch(me, &[a]).unwrap_err();
        assert!(err.contains("not an exported"), "{err}");
        exported::close(b);
    }

    #[test]
    fn failed_accepts_wait_longer_each_time_up_to_a_bound() {
        let mut b = super::AcceptBackoff::default();
        let waits: Vec<(u64, bool)> = (0..10)
            .map(|_| {
                let (w, first) = b.next();
                (w.as_millis() as u64, first)
            })
            .collect();
        let ms: Vec<u64> = waits.iter().map(|w| w.0).collect();
        assert_eq!(ms, [1, 2, 4, 8, 16, 32, 64, 100, 100, 100]);
        assert!(waits[0].1 && waits[1..].iter().all(|w| !w.1), "{waits:?}");
        // Many failures later the wait stays at the bound (no overflow).
        let mut b = super::AcceptBackoff { failures: u32::MAX };
        assert_eq!(b.next(), (super::MAX_ACCEPT_WAIT, false));
    }

    /// For a test that changes its process (limits, signal actions): true
    /// in a child process running only test `name`; in the test's own
    /// process, runs that child, checks that it succeeded having printed
    /// `CHILD RAN`, and returns false.
    fn in_child(name: &str) -> bool {
        const CHILD: &str = "FD_PASSING_TEST_CHILD";
        if std::env::var_os(CHILD).is_some() {
            return true;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &format!("fd_passing::tests::{name}"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {text}", out.status);
        assert!(text.contains("CHILD RAN"), "{text}");
        false
    }

    /// A sender at its descriptor limit cannot copy the descriptors: the
    /// refusal says so, not that they are not exported memory (which sent
    /// the user after a use-after-free instead of `ulimit -n`). Runs in a
    /// child process of its own, whose limit it lowers.
    #[test]
    fn a_sender_out_of_descriptors_says_so() {
        if !in_child("a_sender_out_of_descriptors_says_so") {
            return;
        }
        let a = listed("a page");
        serve();
        // Room for the connection's two sockets and a few more, not for
        // a copy of each of the descriptors asked for.
        let probe = File::open("/dev/null").unwrap();
        let next = probe.as_raw_fd() as u64;
        drop(probe);
        let limit = libc::rlimit {
            rlim_cur: next + 8,
            rlim_max: libc::RLIM_INFINITY,
        };
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: valid pointers to rlimit structs for the calls.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut old), 0);
            let limit = libc::rlimit {
                rlim_max: old.rlim_max,
                ..limit
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit), 0);
        }
        let err = fetch(std::process::id() as i32, &[a; 64]).unwrap_err();
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const old) };
        assert!(!err.contains("not an exported"), "{err}");
        assert!(err.contains(&format!("descriptor {a}")), "{err}");
        assert!(err.contains("open files"), "{err}");
        println!("CHILD RAN");
    }

    /// A receiver that stops reading before its reply (killed, or past its
    /// timeout) costs the sender an error, not its life, also in a program
    /// that restored SIGPIPE's default action (`signal(SIGPIPE, SIG_DFL)`,
    /// for output piped to `head`). Runs in a child process of its own.
    #[test]
    fn a_receiver_gone_before_the_reply_does_not_kill_the_sender() {
        if !in_child("a_receiver_gone_before_the_reply_does_not_kill_the_sender") {
            return;
        }
        // SAFETY: setting a signal's disposition to its default, before
        // this process's server thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let a = listed("a page for a receiver that left");
        serve();
        let addr =
            SocketAddr::from_abstract_name(socket_name(std::process::id() as i32).as_bytes())
                .unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        // Reading shut down first: the reply meets EPIPE whenever it comes.
        s.shutdown(std::net::Shutdown::Read).unwrap();
        let mut request = MAGIC.to_vec();
        request.extend_from_slice(&1u32.to_le_bytes());
        request.extend_from_slice(&a.to_le_bytes());
        s.write_all(&request).unwrap();
        // The server closes the connection once its reply has failed;
        // until then more bytes go into the socket's buffer.
        let start = std::time::Instant::now();
        while s.write(b"?").is_ok() {
            assert!(
                start.elapsed() < TIMEOUT,
                "the server kept the connection open"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Still serving others.
        let got = fetch(std::process::id() as i32, &[a]).unwrap();
        assert_eq!(
            contents(got.into_iter().next().unwrap()),
            "a page for a receiver that left"
        );
        exported::close(a);
        println!("CHILD RAN");
    }

    #[test]
    fn without_a_server_the_reasons_of_both_ways_are_given() {
        // No process has this pid (above the kernel's maximum).
        let err = fetch(i32::MAX - 1, &[3]).unwrap_err();
        assert!(err.contains("descriptor socket"), "{err}");
        assert!(err.contains("pidfd_open"), "{err}");
    }

    #[test]
    fn a_malformed_request_is_refused() {
        serve();
        let addr =
            SocketAddr::from_abstract_name(socket_name(std::process::id() as i32).as_bytes())
                .unwrap();
        let mut s = UnixStream::connect_addr(&addr).unwrap();
        s.write_all(b"XXXX\x01\0\0\0").unwrap();
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).unwrap();
        assert_eq!(&reply[..4], &1u32.to_le_bytes());
        assert!(String::from_utf8_lossy(&reply[8..]).contains("malformed"));
    }
}
