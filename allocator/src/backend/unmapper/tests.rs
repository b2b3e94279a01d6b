use super::*;
use std::sync::mpsc;
use std::time::Duration;

fn unmap(ptr: DevicePtr, size: u64) -> Job {
    Job::Unmap {
        ptr,
        size,
        handles: 1,
    }
}

/// An unmapper whose jobs are reported on a channel, each taking
/// `pause`; a job at 0xbad fails.
fn recording(pause: Duration) -> (Unmapper, mpsc::Receiver<Job>) {
    let (tx, rx) = mpsc::channel();
    let u = Unmapper::start(
        "test-unmapper".into(),
        Box::new(move |job| {
            std::thread::sleep(pause);
            tx.send(job).unwrap();
            match job {
                Job::Unmap { ptr: 0xbad, .. } => Err(BackendError::Driver {
                    call: "cuMemUnmap",
                    code: 1,
                    name: "CUDA_ERROR_INVALID_VALUE".into(),
                }),
                _ => Ok(()),
            }
        }),
    )
    .unwrap();
    (u, rx)
}

#[test]
fn quiescing_lets_the_running_job_end_and_no_other_start() {
    // Note [Helpers at exit].
    let (u, rx) = recording(Duration::from_millis(30));
    for i in 0..5 {
        assert!(u.push(unmap(i << 21, 1 << 21)));
    }
    std::thread::sleep(Duration::from_millis(10)); // the first is running
    u.quiesce(Duration::from_secs(5));
    let done: Vec<Job> = rx.try_iter().collect();
    assert!(!done.is_empty() && done.len() <= 2, "{done:?}");
    assert!(
        !u.push(unmap(9 << 21, 1 << 21)),
        "later work is the caller's"
    );
    u.wait_all(); // returns: nothing queued or running
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(rx.try_iter().count(), 0, "no job started after quiescing");
    // The jobs not started are listed as failed, for the caller to redo.
    let left = u.failed();
    assert_eq!(done.len() + left.len(), 5, "{done:?} {left:?}");
    assert!(left.iter().all(|j| !done.contains(j)));
}

/// Note [One VMM call at a time]: while the allocating thread has its
/// turn, no job is inside its call; without it, jobs run meanwhile
/// (which shows the check can see one).
#[test]
fn no_job_runs_during_the_allocating_threads_turn() {
    use std::sync::atomic::AtomicBool;
    let inside = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&inside);
    let u = Unmapper::start(
        "test-unmapper".into(),
        Box::new(move |_| {
            flag.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(200));
            flag.store(false, Ordering::SeqCst);
            Ok(())
        }),
    )
    .unwrap();
    for i in 0..400 {
        assert!(u.push(unmap(i << 21, 2 << 20)));
    }
    let mut seen_without = false;
    for _ in 0..200 {
        {
            let _turn = u.turn().expect("the helper runs here");
            for _ in 0..5 {
                assert!(!inside.load(Ordering::SeqCst), "a job ran during the turn");
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        std::thread::sleep(Duration::from_micros(300));
        seen_without |= inside.load(Ordering::SeqCst);
    }
    assert!(seen_without, "no job was ever seen running between turns");
    u.wait_all();
}

#[test]
fn jobs_run_in_order_and_dropping_finishes_them() {
    let (u, rx) = recording(Duration::from_millis(1));
    let jobs: Vec<Job> = (0..5)
        .map(|i| unmap(i << 21, 2 << 20))
        .chain([Job::Free {
            ptr: 0,
            size: 10 << 20,
        }])
        .collect();
    for &j in &jobs {
        assert!(u.push(j));
    }
    drop(u);
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), jobs);
}

#[test]
fn dropping_runs_held_jobs_too() {
    let (u, rx) = recording(Duration::ZERO);
    u.hold(true);
    assert!(u.push(unmap(0, 512)));
    drop(u);
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![unmap(0, 512)]);
}

#[test]
fn held_jobs_wait_until_let_go() {
    let (u, rx) = recording(Duration::ZERO);
    u.hold(true);
    assert!(u.push(unmap(0, 512)));
    std::thread::sleep(Duration::from_millis(20));
    assert!(rx.try_recv().is_err(), "a held job ran");
    assert!(!u.is_idle());
    u.hold(false);
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        unmap(0, 512)
    );
}

#[test]
fn waiting_for_a_range_runs_held_jobs_up_to_the_last_over_it() {
    let (u, rx) = recording(Duration::from_millis(2));
    u.hold(true);
    let (a, b, c) = (
        unmap(0x1000_0000, 4 << 20),
        unmap(0x2000_0000, 2 << 20),
        unmap(0x3000_0000, 2 << 20),
    );
    for j in [a, b, c] {
        assert!(u.push(j));
    }
    // Nothing over this range: no wait, nothing runs.
    u.wait_range(0x4000_0000, 0x5000_0000);
    assert!(rx.try_recv().is_err());
    // The second job is over it: it and the one before are done on return.
    u.wait_range(0x2000_0000 + 4096, 0x2000_0000 + 8192);
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![a, b]);
    assert!(!u.is_idle(), "the third job stays held");
    u.wait_all();
    assert!(u.is_idle());
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![c]);
}

#[test]
fn a_job_that_panics_fails_and_the_helper_goes_on() {
    let u = Unmapper::start(
        "panicking".into(),
        Box::new(|job| match job {
            Job::Unmap { ptr: 0xbad, .. } => panic!("a job that panics"),
            _ => Ok(()),
        }),
    )
    .unwrap();
    assert!(u.push(unmap(0xbad, 512)));
    assert!(u.push(unmap(0x1000, 512)));
    u.wait_all(); // returns: the helper is alive and idle again
    assert_eq!(u.failed(), vec![unmap(0xbad, 512)]);
    u.forget(&[unmap(0xbad, 512)]);
    assert!(u.is_idle());
}

#[test]
fn jobs_listed_as_failed_wait_for_the_caller_and_hold_back_their_free() {
    // What a range given up part-way through an exit leaves: jobs the
    // helper never got, listed for the caller's next wait.
    let (u, rx) = recording(Duration::ZERO);
    let left = unmap(0x2000, 512);
    assert!(u.add_failed(&[left]));
    assert!(!u.is_idle(), "the caller still has a job to do");
    let free = Job::Free {
        ptr: 0x2000,
        size: 0x1000,
    };
    assert!(u.push(free));
    u.wait_all();
    assert!(
        rx.try_recv().is_err(),
        "the Free waits for the listed unmap"
    );
    assert_eq!(u.failed(), vec![left, free]);
    u.forget(&[left, free]);
    assert!(u.is_idle());
}

#[test]
fn a_failed_job_is_kept_for_the_caller_and_the_queue_goes_on() {
    let (u, rx) = recording(Duration::ZERO);
    assert!(u.push(unmap(0xbad, 512)));
    assert!(u.push(Job::Free { ptr: 0, size: 512 }));
    u.wait_all();
    assert_eq!(rx.try_iter().count(), 2);
    assert!(!u.is_idle(), "a failed job is not done");
    assert_eq!(u.failed(), vec![unmap(0xbad, 512)]);
    // Listed until the caller says it did it.
    assert!(u.push(unmap(0xbad, 1024)));
    u.wait_all();
    assert_eq!(u.failed(), vec![unmap(0xbad, 512), unmap(0xbad, 1024)]);
    u.forget(&[unmap(0xbad, 512)]);
    assert_eq!(u.failed(), vec![unmap(0xbad, 1024)]);
    u.forget(&[unmap(0xbad, 1024)]);
    assert!(u.is_idle());
}

#[test]
fn the_free_of_a_reservation_waits_with_its_failed_unmap() {
    let (u, rx) = recording(Duration::ZERO);
    u.hold(true);
    let free = Job::Free {
        ptr: 0x800,
        size: 4096,
    };
    let other = Job::Free {
        ptr: 0x10_0000,
        size: 4096,
    };
    for j in [unmap(0xbad, 512), free, other] {
        assert!(u.push(j));
    }
    u.wait_all(); // returns though the blocked Free never ran
    assert_eq!(
        rx.try_iter().collect::<Vec<_>>(),
        vec![unmap(0xbad, 512), other]
    );
    assert_eq!(u.failed(), vec![unmap(0xbad, 512), free]);
}

/// The Free given after its reservation's Unmap failed waits too.
#[test]
fn a_free_given_after_the_failure_waits_too() {
    let (u, rx) = recording(Duration::ZERO);
    assert!(u.push(unmap(0xbad, 512)));
    u.wait_all();
    let free = Job::Free {
        ptr: 0x800,
        size: 4096,
    };
    assert!(u.push(free));
    u.wait_all();
    assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![unmap(0xbad, 512)]);
    assert_eq!(u.failed(), vec![unmap(0xbad, 512), free]);
}

/// Two failed Unmaps in one reservation: its Free comes after both.
#[test]
fn a_free_comes_after_every_failed_unmap_inside() {
    let (u, rx) = recording(Duration::ZERO);
    u.hold(true);
    // Both fail (the recorder fails every Unmap starting at 0xbad).
    let (h1, h2) = (unmap(0xbad, 512), unmap(0xbad, 1024));
    let free = Job::Free {
        ptr: 0x800,
        size: 4096,
    };
    for j in [h1, h2, free] {
        assert!(u.push(j));
    }
    u.wait_all();
    assert_eq!(rx.try_iter().count(), 2, "the Free never ran");
    assert_eq!(u.failed(), vec![h1, h2, free]);
}

#[test]
fn redo_takes_the_jobs_over_the_range_and_the_unmaps_a_free_needs() {
    let (a, b, c) = (unmap(0x1000, 512), unmap(0x2000, 512), unmap(0x3000, 512));
    let free = Job::Free {
        ptr: 0x2000,
        size: 0x2000,
    };
    // Only the jobs over the range, in order.
    let mut ran = Vec::new();
    let (r, done) = redo(&[a, b, c], Some((0x2000, 0x2001)), |j| {
        ran.push(j);
        Ok(())
    });
    assert!(r.is_ok());
    assert_eq!((ran, done), (vec![b], vec![b]));
    // Nothing over the range: nothing runs.
    let (r, done) = redo(&[a, b], Some((0x9000, 0x9001)), |_| unreachable!());
    assert!(r.is_ok() && done.is_empty());
    // A Free over the range brings the Unmaps inside its reservation
    // (c too, though not over the range itself), before it.
    let mut ran = Vec::new();
    let (r, _) = redo(&[a, b, c, free], Some((0x2000, 0x2001)), |j| {
        ran.push(j);
        Ok(())
    });
    assert!(r.is_ok());
    assert_eq!(ran, vec![b, c, free]);
    // A failure holds back only the Free of its reservation: the jobs
    // after it, and another reservation's Unmap and Free, still run.
    let (d, other) = (
        unmap(0x8000, 512),
        Job::Free {
            ptr: 0x8000,
            size: 0x1000,
        },
    );
    let mut ran = Vec::new();
    let (r, done) = redo(&[a, b, free, c, d, other], None, |j| {
        ran.push(j);
        if j == b {
            Err(BackendError::Unavailable("again".into()))
        } else {
            Ok(())
        }
    });
    assert!(r.is_err(), "the failure is reported");
    assert_eq!(ran, vec![a, b, c, d, other]);
    assert_eq!(done, vec![a, c, d, other]);
    // An Unmap listed after the Free of its reservation (a job that was
    // running when `quiesce` listed the queue, and failed) still runs
    // first: the Free never comes while a range inside it is mapped.
    let mut ran = Vec::new();
    let (r, done) = redo(&[free, b, a], None, |j| {
        ran.push(j);
        Ok(())
    });
    assert!(r.is_ok());
    assert_eq!(ran, vec![b, a, free]);
    assert_eq!(done, vec![b, a, free]);
    // And one that fails again holds that Free back.
    let mut ran = Vec::new();
    let (r, done) = redo(&[free, c], Some((0x2000, 0x2001)), |j| {
        ran.push(j);
        if j == c {
            Err(BackendError::Unavailable("again".into()))
        } else {
            Ok(())
        }
    });
    assert!(r.is_err());
    assert_eq!((ran, done), (vec![c], vec![]));
}

#[test]
fn jobs_pushed_from_several_threads_all_run() {
    let (u, rx) = recording(Duration::ZERO);
    let u = Arc::new(u);
    let pushers: Vec<_> = (0..4u64)
        .map(|t| {
            let u = Arc::clone(&u);
            std::thread::spawn(move || {
                for i in 0..50u64 {
                    let at = (t * 1000 + i) << 21;
                    assert!(u.push(unmap(at, 2 << 20)));
                    if i % 10 == 0 {
                        u.wait_range(at, at + 1);
                    }
                }
            })
        })
        .collect();
    for p in pushers {
        p.join().unwrap();
    }
    u.wait_all();
    assert_eq!(rx.try_iter().count(), 200);
}
