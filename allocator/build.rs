//! Names the commit the library is built from (`BUILD_GIT_COMMIT`, empty
//! outside a git checkout), so that a trace says which build recorded it
//! (`gpualloc 0.1.0+1efb512c4a3d`): a replay that departs from its
//! recording is then told apart from a policy that changed since.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !s.trim().is_empty()).then(|| s.trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_default();
    println!("cargo:rustc-env=BUILD_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=build.rs");
    // Built again when HEAD moves: HEAD itself, the branch it names, and
    // packed refs; only files that exist (a missing one would rebuild
    // every time).
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
        watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
        for f in watched {
            let p = Path::new(&dir).join(f);
            if p.is_file() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
}
