//! Note [Helpers at exit] in `backend/unmapper.rs`, in a process of its
//! own: once `quiesce_all` ran, no helper thread starts any more (the
//! first unmapping of a device that had none is then done by the caller).

use gpualloc::backend::unmapper::{Unmapper, quiesce_all};
use std::time::Duration;

#[test]
fn no_helper_starts_once_the_process_is_exiting() {
    let before = Unmapper::start("before".into(), Box::new(|_| Ok(())));
    assert!(before.is_ok(), "a helper starts before the exit");
    quiesce_all(Duration::from_millis(100));
    let after = Unmapper::start("after".into(), Box::new(|_| Ok(())));
    let err = after.err().expect("no helper starts after quiesce_all");
    assert!(err.to_string().contains("exiting"), "{err}");
}
