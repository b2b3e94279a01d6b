//! PyTorch's current stream, read from c10 where it is loaded.

use crate::support::{fresh_dir, gcc, gxx, library, ran_to_done, run_sim};
use std::path::Path;

/// `gpualloc_free` reads PyTorch's current stream where libc10_cuda.so is
/// loaded (a stand-in built with g++ from `tests/c/c10_stand_in.cpp`, so
/// the compiler mangles the names and returns the values as c10 does): a
/// block freed while another stream is current is not reused at once; the
/// same program without the stand-in reuses it, until it loads the
/// stand-in itself and the lookup is tried again; c10 is never asked of a
/// device it does not count (Note [The current stream without the
/// bridge]).
#[test]
fn free_reads_pytorchs_current_stream_where_c10_is_loaded() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = fresh_dir("current_stream");
    let c10 = dir.join("libc10_cuda.so");
    gxx(
        &manifest.join("tests/c/c10_stand_in.cpp"),
        &c10,
        &[
            "-shared".as_ref(),
            "-fPIC".as_ref(),
            "-Wl,-soname,libc10_cuda.so".as_ref(),
        ],
    );
    let lib = library();
    let path = std::env::join_paths([dir.as_path(), lib.parent().unwrap()]).unwrap();
    let src = manifest.join("tests/c/current_stream_test.c");
    for with_c10 in [true, false] {
        let exe = dir.join(format!("current_stream_test_{with_c10}"));
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "-L".as_ref(),
            lib.parent().unwrap().as_os_str(),
            "-lgpualloc".as_ref(),
        ];
        if with_c10 {
            args.extend(["-L".as_ref(), dir.as_os_str(), "-lc10_cuda".as_ref()]);
        } else {
            args.extend::<[&std::ffi::OsStr; 2]>(["-DWITHOUT_C10".as_ref(), "-ldl".as_ref()]);
        }
        gcc(&src, &exe, &args);
        let run = run_sim(
            &exe,
            &[
                ("LD_LIBRARY_PATH", path.as_os_str()),
                ("GPUALLOC_SIM_DEVICES", "2".as_ref()),
                ("C10_STAND_IN", c10.as_os_str()),
            ],
        );
        let stderr = ran_to_done(&run);
        assert_eq!(stderr, "", "with c10: {with_c10}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
