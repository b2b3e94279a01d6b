//! Compiles `tests/c/abi_test.c` with `gcc -Wall -Wextra -Werror` against
//! the generated header, links it to libgpualloc.so (built for this test
//! run, or `GPUALLOC_TEST_LIBRARY`), and runs it on the simulated
//! backend. The C program exercises the whole ABI and prints `ALL OK` when
//! every check passed.
//!
//! The helpers the tests share are in `support`; each other module holds
//! the tests of one topic.

mod callbacks;
mod configure;
mod crash;
mod driver;
mod entry_points;
mod environment;
mod errors;
mod exit_traces;
mod fork;
mod fuzz;
mod marks;
mod pools;
mod program;
mod segments;
mod streams;
mod support;
