//! The committed header (and the Python package's copy) is exactly what
//! cbindgen generates from the crate.
//! `UPDATE_HEADER=1 cargo test -p gpualloc-capi --test header` regenerates it.

#[test]
fn header_is_up_to_date() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config =
        cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen runs on the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    // The Python package ships a copy: its torch bridge compiles against it.
    for path in [
        format!("{dir}/include/gpualloc.h"),
        format!("{dir}/../python-shim/gpualloc/include/gpualloc.h"),
    ] {
        if std::env::var_os("UPDATE_HEADER").is_some() {
            std::fs::create_dir_all(std::path::Path::new(&path).parent().unwrap())
                .expect("create include dir");
            std::fs::write(&path, &generated).expect("write header");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "{path} is stale: run `UPDATE_HEADER=1 cargo test -p gpualloc-capi --test header`"
        );
    }
    for name in [
        "gpualloc_malloc",
        "gpualloc_free",
        "gpualloc_last_error",
        "GpuallocStats",
        "GPUALLOC_ERR_OUT_OF_MEMORY",
    ] {
        assert!(generated.contains(name), "{name} missing from the header");
    }
}
