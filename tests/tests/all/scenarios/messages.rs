//! Error texts: the out-of-memory message names the numbers (reference 1.8),
//! and configuration errors name the key (reference 1.11).

use gpualloc::{AllocError, Config};
use gpualloc_tests::{Checked, MIB};

#[test]
fn out_of_memory_message_names_the_numbers() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let _a = c.alloc(30 * MIB, 0);
    let _b = c.alloc(14 * MIB, 0);
    let err = c.malloc(22 * MIB, 0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)));
    let msg = err.to_string();
    // PyTorch's own opening, word for word: libraries that shrink the batch
    // on out-of-memory errors recognize them by it (accelerate's
    // `should_reduce_batch_size` looks for " out of memory.").
    assert!(
        msg.starts_with("CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has"),
        "{msg}"
    );
    for part in [
        "Tried to allocate 22.00 MiB",
        "GPU 0",
        "total capacity of 64.00 MiB",
        "20.00 MiB is free",
        "44.00 MiB is allocated",
    ] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
}

#[test]
fn out_of_memory_message_names_the_limit_and_private_pools() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,memory_limit:40MiB",
    );
    c.begin_pool((1, 0), None);
    let _p = c.alloc(30 * MIB, 0);
    let err = c.malloc(20 * MIB, 0).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("40.00 MiB"), "limit missing: {msg}");
    assert!(
        msg.contains("30.00 MiB in private pools"),
        "private pools missing: {msg}"
    );
    c.end_pool((1, 0));
}

#[test]
fn too_large_message_says_it_never_fits() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let msg = c.malloc(100 * MIB, 0).unwrap_err().to_string();
    // PyTorch's opening word for word (its own tests match it), then why.
    assert_eq!(
        msg,
        "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of \
         64.00 MiB. gpualloc needed 100.00 MiB for it, which can never fit: the most this \
         device can hold is 64.00 MiB."
    );
    // From 1 EB on, PyTorch's text names no size.
    let msg = c.malloc(1 << 62, 0).unwrap_err().to_string();
    assert!(
        msg.starts_with("CUDA out of memory. Tried to allocate more than 1EB memory. GPU 0 has"),
        "{msg}"
    );
}

#[test]
fn too_large_message_under_a_limit_names_it() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,memory_limit:64MiB",
    );
    let msg = c.malloc(100 * MIB, 0).unwrap_err().to_string();
    assert!(
        msg.starts_with("CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of 1024.00 MiB."),
        "{msg}"
    );
    assert!(
        msg.ends_with("the most this device can hold is 64.00 MiB under the memory limit."),
        "{msg}"
    );
}

#[test]
fn config_errors_name_the_key() {
    for (s, key) in [
        ("max_split_size_mb:10", "max_split_size_mb"),
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("max_non_split_rounding_mb:-1", "max_non_split_rounding_mb"),
        (
            "garbage_collection_threshold:0",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:1",
            "garbage_collection_threshold",
        ),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[300:2]",
            "roundup_power2_divisions",
        ),
        (
            "roundup_power2_divisions:[64:3]",
            "roundup_power2_divisions",
        ),
        ("large_segment_size_mb:3", "large_segment_size_mb"),
        (
            "per_process_memory_fraction:0",
            "per_process_memory_fraction",
        ),
        (
            "per_process_memory_fraction:1.5",
            "per_process_memory_fraction",
        ),
        ("memory_limit:12XB", "memory_limit"),
        ("cross_stream_reuse:maybe", "cross_stream_reuse"),
        ("expandable_segments:yes", "expandable_segments"),
        ("expandable_page_mb:3", "expandable_page_mb"),
        ("defragment:2", "defragment"),
        ("policy:fast", "policy"),
        ("expandable_handle_mb:6", "expandable_handle_mb"),
        ("defragment_headroom:1.5", "defragment_headroom"),
        ("stitch_budget:2", "stitch_budget"),
        ("max_split_size_mb:64,no_such_key:1", "no_such_key"),
    ] {
        let e = Config::parse(s).unwrap_err();
        assert_eq!(e.key, key, "{s}: {e}");
        assert!(e.to_string().contains(key), "{s}: {e}");
    }
    assert!(
        Config::parse("max_split_size_mb").is_err(),
        "a key without a value"
    );
    assert!(Config::parse("roundup_power2_divisions:[1:2").is_err());
}

#[test]
fn valid_configs_parse() {
    let c = Config::parse(
        " max_split_size_mb:20 , roundup_power2_divisions:[1:2,>:4],memory_limit:1.5G",
    )
    .unwrap();
    assert_eq!(c.max_split_size, 20 * MIB);
    assert_eq!(c.memory_limit, Some(3 << 29));
    assert_eq!(Config::parse("").unwrap(), Config::default());
}

/// PyTorch's `format_size` keeps a size in the smaller unit up to and
/// including the next power of 1024 (`1024 bytes`, `1024.00 KiB`,
/// `1024.00 MiB`) and has no unit above GiB.
#[test]
fn sizes_are_formatted_as_pytorchs_format_size() {
    use gpualloc::error::format_bytes;
    use gpualloc_tests::{GIB, KIB};
    for (b, s) in [
        (512, "512 bytes"),
        (KIB, "1024 bytes"),
        (KIB + 1, "1.00 KiB"),
        (MIB, "1024.00 KiB"),
        (22 * MIB, "22.00 MiB"),
        (GIB, "1024.00 MiB"),
        (3 * GIB / 2, "1.50 GiB"),
        (2048 * GIB, "2048.00 GiB"),
    ] {
        assert_eq!(format_bytes(b), s, "{b}");
    }
    let mut c = Checked::with(4 * GIB, "policy:pytorch");
    let _a = c.alloc(3 * GIB + GIB / 2, 0);
    let msg = c.malloc(GIB, 0).unwrap_err().to_string();
    assert!(
        msg.starts_with("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 4.00 GiB"),
        "{msg}"
    );
}
