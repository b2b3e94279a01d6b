use super::*;

#[test]
fn states_only_keys_the_string_gives() {
    let c =
        Config::parse(" expandable_segments : true ,roundup_power2_divisions:[256:1,>:2]").unwrap();
    assert!(c.states("expandable_segments") && c.states("roundup_power2_divisions"));
    assert!(!c.states("defragment") && !c.states("256") && !c.states(">"));
    let p = Config::parse("policy:pytorch").unwrap();
    assert!(!p.expandable_segments && !p.states("expandable_segments"));
    assert!(!Config::parse("").unwrap().states("expandable_segments"));
}

#[test]
fn parses_every_key() {
    let c = Config::parse(
        "max_split_size_mb:64, garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,512:2,1024:4,>:8],\
         large_segment_size_mb:32,per_process_memory_fraction:0.5,memory_limit:24GiB,cross_stream_reuse:false,\
         max_non_split_rounding_mb:40,expandable_segments:false,graph_capture_record_stream_reuse:true",
    )
    .unwrap();
    assert_eq!(c.max_split_size, 64 * MIB);
    assert_eq!(c.gc_threshold, 0.6);
    assert_eq!(c.power2_divisions_for(256 * MIB), 1);
    assert_eq!(c.power2_divisions_for(512 * MIB), 2);
    assert_eq!(c.power2_divisions_for(1024 * MIB), 4);
    assert_eq!(c.power2_divisions_for(4096 * MIB), 8);
    assert_eq!(
        c.power2_divisions_for(MIB),
        1,
        "the first entry covers smaller sizes"
    );
    assert_eq!(c.large_segment_size, 32 * MIB);
    assert_eq!(c.memory_fraction, Some(0.5));
    assert_eq!(c.memory_limit, Some(24 << 30));
    assert!(!c.cross_stream_reuse);
    assert!(c.graph_capture_record_stream_reuse);
    assert_eq!(c.max_non_split_rounding, 40 * MIB);
}

#[test]
fn errors_name_the_key() {
    for (s, key) in [
        ("bogus:1", "bogus"),
        ("max_split_size_mb:10", "max_split_size_mb"),
        (
            "garbage_collection_threshold:1.5",
            "garbage_collection_threshold",
        ),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[300:2]",
            "roundup_power2_divisions",
        ),
        ("memory_limit:12XB", "memory_limit"),
        ("cross_stream_reuse:maybe", "cross_stream_reuse"),
        ("expandable_segments:yes", "expandable_segments"),
    ] {
        let e = Config::parse(s).unwrap_err();
        assert_eq!(e.key, key, "{s}: {e}");
        assert!(e.to_string().contains(key));
    }
    assert!(Config::parse("max_split_size_mb").is_err());
    assert!(Config::parse("roundup_power2_divisions:[1:2").is_err());
    assert_eq!(Config::parse("").unwrap(), Config::default());
    for (s, key) in [
        ("policy:fast", "policy"),
        ("expandable_page_mb:17592186044416", "expandable_page_mb"),
        ("expandable_handle_mb:6", "expandable_handle_mb"),
        ("expandable_handle_mb:2048", "expandable_handle_mb"),
        ("defragment_headroom:1.5", "defragment_headroom"),
        ("defragment_pressure:1.5", "defragment_pressure"),
        ("defragment_pressure:-0.1", "defragment_pressure"),
        ("stitch_short_share:1025", "stitch_short_share"),
        ("stitch_short_share:-1", "stitch_short_share"),
        ("stitch_budget:1.5", "stitch_budget"),
        ("stitch_budget:-0.1", "stitch_budget"),
    ] {
        assert_eq!(Config::parse(s).unwrap_err().key, key, "{s}");
    }
    // A number the rule refuses says what the rule is.
    for v in ["-0", "1e-3", "+0.5", ".", "0.1.2"] {
        let e = Config::parse(&format!("defragment_headroom:{v}")).unwrap_err();
        assert!(e.to_string().contains("plain decimal"), "{v}: {e}");
    }
}

/// Every numeric key has a range: nothing overflows, wraps or saturates
/// into another meaning.
#[test]
fn numeric_keys_are_range_checked() {
    for (s, key) in [
        (
            "large_segment_size_mb:17592186044416",
            "large_segment_size_mb",
        ),
        ("large_segment_size_mb:2048", "large_segment_size_mb"),
        ("max_split_size_mb:17592186044416", "max_split_size_mb"),
        ("max_split_size_mb:-20", "max_split_size_mb"),
        (
            "max_split_size_mb:99999999999999999999999",
            "max_split_size_mb",
        ),
        (
            "max_non_split_rounding_mb:17592186044416",
            "max_non_split_rounding_mb",
        ),
        ("stitch_min_mb:17592186044416", "stitch_min_mb"),
        ("expandable_page_mb:0", "expandable_page_mb"),
        (
            "expandable_handle_mb:17592186044416",
            "expandable_handle_mb",
        ),
        (
            "roundup_power2_divisions:1099511627776",
            "roundup_power2_divisions",
        ),
        (
            "roundup_power2_divisions:[1099511627776:2]",
            "roundup_power2_divisions",
        ),
        ("memory_limit:2PiB", "memory_limit"),
        ("memory_limit:1e30", "memory_limit"),
        ("memory_limit:inf", "memory_limit"),
        (
            "garbage_collection_threshold:nan",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:-0.5",
            "garbage_collection_threshold",
        ),
        (
            "per_process_memory_fraction:1e-1",
            "per_process_memory_fraction",
        ),
    ] {
        let e = Config::parse(s).unwrap_err();
        assert_eq!(e.key, key, "{s}: {e}");
    }
    let c = Config::parse("large_segment_size_mb:1024,max_split_size_mb:16777216").unwrap();
    assert_eq!(c.large_segment_size, 1024 * MIB);
    assert_eq!(c.max_split_size, MAX_MB * MIB);
}

/// A value means one thing or is refused.
#[test]
fn values_never_change_meaning_silently() {
    for (s, why) in [
        ("memory_limit:0", "no limit"),
        ("memory_limit:0.5", "whole number"),
        ("memory_limit:-0", "byte count"),
        ("memory_limit:1.1G", "whole number"),
        ("memory_limit:1G,memory_limit:2G", "more than once"),
        ("policy:pytorch,policy:gpualloc", "more than once"),
        ("roundup_power2_divisions:[>:8,>:4]", "follows the last"),
        ("roundup_power2_divisions:[512:2,256:1]", "later interval"),
        ("roundup_power2_divisions:[256:2,256:4]", "later interval"),
        ("roundup_power2_divisions:[>:2,256:4]", "follows the last"),
        ("memory_limit:1G\0,bogus:1", "NUL"),
    ] {
        let e = Config::parse(s).unwrap_err().to_string();
        assert!(e.contains(why), "{s}: {e}");
    }
    assert_eq!(
        Config::parse("memory_limit:1.5G").unwrap().memory_limit,
        Some(3 << 29)
    );
    assert_eq!(parse_bytes("k", "1PiB").unwrap(), MAX_BYTES);
    assert_eq!(parse_bytes("k", "2PiB").unwrap_err().key, "k");
    assert_eq!(parse_bytes("k", "1EiB").unwrap_err().key, "k");
    assert_eq!(parse_bytes("k", "1TiB").unwrap(), 1 << 40);
}

/// A huge configuration string gives a short message.
#[test]
fn messages_are_bounded() {
    let long = "x".repeat(100_000);
    for s in [
        format!("memory_limit:{long}"),
        format!("{long}:1"),
        long.clone(),
        format!("policy:{long}"),
        format!("roundup_power2_divisions:[{long}]"),
    ] {
        let e = Config::parse(&s).unwrap_err().to_string();
        assert!(e.len() < 600, "{} bytes: {}", e.len(), &e[..200]);
    }
}

#[test]
fn policy_sets_the_defaults_wherever_it_is_written() {
    let d = Config::default();
    assert!(d.expandable_segments && d.defragment && d.cross_stream_reuse);
    let p = Config::parse("policy:pytorch").unwrap();
    assert!(!p.expandable_segments && !p.cross_stream_reuse);
    let q = Config::parse("expandable_segments:true,policy:pytorch").unwrap();
    assert!(q.expandable_segments, "keys override the policy's defaults");
    assert!(!q.cross_stream_reuse);
    // PyTorch's expandable segments: no moves, no stitches, 20 MiB pages.
    assert!(!q.defragment && q.stitch_min == u64::MAX);
    assert_eq!(q.expandable_page, 20 * MIB);
    assert_eq!(q.source, "expandable_segments:true,policy:pytorch");
    let g = Config::parse("policy:gpualloc").unwrap();
    assert_eq!(
        Config {
            source: String::new(),
            ..g
        },
        Config::default()
    );
}
