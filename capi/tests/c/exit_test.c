/* Calls the ABI where thread-local storage is being torn down: from a
 * pthread key destructor (after the thread's other thread-locals are gone)
 * and from an atexit handler. Python finalizers and C++ static destructors
 * run exactly there. Nothing may abort: the process must exit 0 and print
 * "exit ok" last. */
#include "gpualloc.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static pthread_key_t key;

static void use_the_abi(const char *where) {
  GpuallocStats s = {0};
  s.size = sizeof s;
  int rc = gpualloc_get_stats(0, &s);
  gpualloc_empty_cache();
  gpualloc_free((void *)0x1234, 16, 0, 0); /* fails: not ours */
  void *p = gpualloc_malloc(4096, 0, 0);
  gpualloc_free(p, 4096, 0, 0);
  const char *e = gpualloc_last_error();
  printf("%s: stats=%d code=%d err=%s\n", where, rc, gpualloc_last_error_code(),
         e ? "set" : "none");
  fflush(stdout);
}

static void destructor(void *value) {
  (void)value;
  use_the_abi("key destructor");
}

static void *thread_main(void *arg) {
  (void)arg;
  /* Fill this thread's last error first, so that it has a destructor. */
  gpualloc_free((void *)0x1234, 16, 0, 0);
  pthread_setspecific(key, (void *)1);
  return NULL;
}

static void at_exit(void) {
  use_the_abi("atexit");
  printf("exit ok\n");
  fflush(stdout);
}

int main(void) {
  if (atexit(at_exit) != 0) return 2;
  gpualloc_free((void *)0x1234, 16, 0, 0);
  if (pthread_key_create(&key, destructor) != 0) return 3;
  pthread_t t;
  if (pthread_create(&t, NULL, thread_main, NULL) != 0) return 4;
  pthread_join(t, NULL);
  printf("joined\n");
  fflush(stdout);
  return 0;
}
