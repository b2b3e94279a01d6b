//! Forked children and the locks their parent's threads held.

use crate::support::{build_inline, run_sim, run_sim_with};

/// Note [Locks held at a fork]: a child forked while one thread of its
/// parent held device 0's lock and another was parked waiting for it
/// asks for the device from a thread of its own, which glibc gives the
/// parked thread's stack and thread-local memory. The call fails (the lock
/// is held for good there) without parking, which crashed the child.
#[test]
fn a_forked_child_does_not_park_where_its_parents_threads_were_parked() {
    let (_out, exe) = build_inline(
        "fork_parked",
        r#"#define _GNU_SOURCE
#include "gpualloc.h"
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int inside = 0, forked = 0;
static void observer(void *ctx, int d, int a, uint64_t x, uint64_t s, uint64_t st) {
  (void)ctx; (void)d; (void)a; (void)x; (void)s; (void)st;
  pthread_mutex_lock(&m); inside = 1; pthread_cond_broadcast(&c);
  while (!forked) pthread_cond_wait(&c, &m);
  pthread_mutex_unlock(&m);
}
static void *grow(void *arg) { (void)arg; void *q = gpualloc_malloc(64 << 20, 0, 0); gpualloc_free(q, 0, 0, 0); return NULL; }
static void *waiter(void *arg) { (void)arg; void *q = gpualloc_malloc(4096, 0, 0); gpualloc_free(q, 0, 0, 0); return NULL; }
static void *ask(void *arg) { (void)arg; struct GpuallocHeld h; for (int i = 0; i < 3; i++) (void)gpualloc_held(0, &h); return NULL; }
static pthread_t spawn_sized(void *(*f)(void *), size_t sz) {
  pthread_attr_t a; pthread_attr_init(&a); pthread_attr_setstacksize(&a, sz);
  pthread_t t; pthread_create(&t, &a, f, NULL); pthread_attr_destroy(&a); return t;
}
static pthread_t spawn(void *(*f)(void *)) { return spawn_sized(f, 2 << 20); }
int main(void) {
  void *p = gpualloc_malloc(4096, 0, 0);
  if (!p) return 2;
  gpualloc_set_segment_observer(observer, NULL);
  pthread_t t = spawn_sized(grow, 4 << 20);
  pthread_mutex_lock(&m); while (!inside) pthread_cond_wait(&c, &m); pthread_mutex_unlock(&m);
  pthread_t w[1];
  for (int i = 0; i < 1; i++) w[i] = spawn(waiter);
  struct timespec ts = {0, 200000000}; nanosleep(&ts, NULL);  /* they park */
  pid_t pid = fork();
  if (pid == 0) {
    alarm(60);
    pthread_t k = spawn(ask);  /* gets the parked thread's stack, and its TLS */
    pthread_join(k, NULL);
    _exit(0);
  }
  pthread_mutex_lock(&m); forked = 1; pthread_cond_broadcast(&c); pthread_mutex_unlock(&m);
  pthread_join(t, NULL);
  for (int i = 0; i < 1; i++) pthread_join(w[i], NULL);
  int st = 0; waitpid(pid, &st, 0);
  if (WIFSIGNALED(st)) printf("child killed by signal %d\n", WTERMSIG(st));
  else printf("child exit %d\n", WEXITSTATUS(st));
  return 0;
}
"#,
    );
    for _ in 0..2 {
        let out = run_sim_with(&exe, &[], &[]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "child exit 0\n");
    }
}

/// Note [Freeing in a forked child]: a child forked while another thread
/// holds a device lock (here: a segment observer, which runs under it,
/// waits until the fork happened) frees what it inherited without waiting
/// for that lock, which no thread of the child will ever release; it frees
/// nothing, the memory being its parent's. So do the calls that drop an
/// inherited graph's or MemPool's pool and an IPC tensor. The calls that
/// need the lock fail, naming the cause, instead of waiting for good, and
/// the inherited trace's mark, flush and exit handler pass over the device
/// (Note [Locks held at a fork]).
#[test]
fn a_forked_child_frees_without_the_locks_other_threads_held() {
    let (_out, exe) = build_inline(
        "fork_free",
        r#"#define _POSIX_C_SOURCE 200809L
#include "gpualloc.h"
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int inside = 0, forked = 0;
static void observer(void *ctx, int device, int action, uint64_t address, uint64_t size, uint64_t stream) {
  (void)ctx; (void)device; (void)action; (void)address; (void)size; (void)stream;
  pthread_mutex_lock(&m);
  inside = 1;
  pthread_cond_broadcast(&c);
  while (!forked) pthread_cond_wait(&c, &m);
  pthread_mutex_unlock(&m);
}
static void *grow(void *arg) {
  (void)arg;
  void *q = gpualloc_malloc(64 << 20, 0, 0);  /* a new segment: the observer runs under the lock */
  gpualloc_free(q, 64 << 20, 0, 0);
  return NULL;
}
int main(void) {
  char trace[64];
  snprintf(trace, sizeof trace, "/tmp/gpualloc-fork-lock-%d.gtrace", (int)getpid());
  if (gpualloc_trace_start(trace) != GPUALLOC_OK) return 3;
  void *p = gpualloc_malloc(4096, 0, 0);
  if (p == NULL) return 2;
  gpualloc_set_segment_observer(observer, NULL);
  pthread_t t;
  pthread_create(&t, NULL, grow, NULL);
  pthread_mutex_lock(&m);
  while (!inside) pthread_cond_wait(&c, &m);
  pthread_mutex_unlock(&m);
  pid_t pid = fork();
  if (pid == 0) {
    alarm(30);  /* a child stuck on the lock is killed, and the test fails */
    gpualloc_free(p, 4096, 0, 0);
    uint64_t size = 1;
    int owner = 0;
    if (gpualloc_free_sized(p, &size, &owner) != GPUALLOC_OK || owner != -1 || size != 0) _exit(3);
    /* An inherited graph, MemPool or IPC tensor dropped: nothing either. */
    if (gpualloc_release_pool(0, 9, 9) != GPUALLOC_OK) _exit(4);
    if (gpualloc_empty_pool_cache(0, 9, 9) != GPUALLOC_OK) _exit(5);
    if (gpualloc_ipc_close(p) != GPUALLOC_OK) _exit(6);
    /* An inherited MemPool's destructor and a scope left open. */
    if (gpualloc_set_pool_use_on_oom(0, 9, 9, 0) != GPUALLOC_OK) _exit(10);
    if (gpualloc_end_allocate_to_pool(0, 9, 9) != GPUALLOC_OK) _exit(11);
    if (gpualloc_set_pool_no_split(0, 9, 9) != GPUALLOC_OK) _exit(12);
    /* What waits for the device's lock fails, naming the cause, rather
     * than wait for good (Note [Locks held at a fork]). */
    struct GpuallocHeld held;
    if (gpualloc_held(0, &held) != GPUALLOC_ERR_UNAVAILABLE || !strstr(gpualloc_last_error(), "forked")) _exit(7);
    size_t needed = 0;
    if (gpualloc_snapshot_json(0, NULL, 0, &needed) != GPUALLOC_ERR_UNAVAILABLE) _exit(8);
    if (gpualloc_malloc(4096, 0, 0) != NULL || gpualloc_last_error_code() != GPUALLOC_ERR_UNAVAILABLE) _exit(9);
    gpualloc_record_stream(p, (cudaStream_t)5);  /* returns */
    /* The parent's trace, inherited: a mark, a stop and the exit handler
     * that completes a trace pass over the device. */
    (void)gpualloc_mark("in the child");
    (void)gpualloc_trace_flush();
    (void)gpualloc_trace_stop(NULL);
    exit(0);
  }
  pthread_mutex_lock(&m);
  forked = 1;
  pthread_cond_broadcast(&c);
  pthread_mutex_unlock(&m);
  pthread_join(t, NULL);
  int status = 0;
  waitpid(pid, &status, 0);
  gpualloc_free(p, 4096, 0, 0);
  gpualloc_trace_stop(NULL);
  unlink(trace);
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) printf("child exit %d\n", WEXITSTATUS(status));
  printf("child %s\n", WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "freed" : "stuck");
  return 0;
}
"#,
    );
    let out = run_sim(&exe, &[]);
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "child freed\n");
}
