//! PyTorch's allocator settings (`PYTORCH_CUDA_ALLOC_CONF`, which a
//! snapshot records in `allocator_settings`) in gpualloc's syntax, so that
//! an imported snapshot replays under the allocator that recorded it:
//! `policy:pytorch` plus the keys that mean the same thing in both.
//!
//! `expandable_segments:True` becomes [`PYTORCH_EXPANDABLE`]: gpualloc's
//! expandable segments without its defragmentation and stitching, mapped in
//! PyTorch's 20 MiB steps. Keys about pinned host memory or locking change
//! nothing on the device and are dropped; any other key without an
//! equivalent (`backend:cudaMallocAsync`, a later version's key, a value
//! gpualloc refuses) is left out and named in [`Translated::left_out`].

use gpualloc::Config;

/// PyTorch's own expandable segments, as closely as gpualloc's keys allow:
/// no defragmentation, no stitching, large-pool pages of 20 MiB.
pub const PYTORCH_EXPANDABLE: &str =
    "expandable_segments:true,defragment:false,stitch_min_mb:0,expandable_page_mb:20";

/// Keys that take the same values in both syntaxes.
const SAME: &[&str] = &[
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "per_process_memory_fraction",
];

/// Keys about host memory or locking: nothing to replay on the device.
const HOST_ONLY: &[&str] = &[
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
];

/// A configuration for gpualloc, and what of PyTorch's had no equivalent.
#[derive(Debug, PartialEq)]
pub struct Translated {
    /// gpualloc's configuration string (it parses).
    pub config: String,
    /// `key:value` entries left out, each with the reason.
    pub left_out: Vec<String>,
}

/// Translates PyTorch's setting string `conf` (`None`: not recorded).
pub fn translate(conf: Option<&str>) -> Translated {
    let mut parts = vec!["policy:pytorch".to_string()];
    let mut left_out = Vec::new();
    for entry in split(conf.unwrap_or("")) {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        let (key, value) = entry.split_once(':').unwrap_or((entry, ""));
        let (key, value) = (key.trim(), value.trim());
        let part = match key {
            k if SAME.contains(&k) => format!("{k}:{value}"),
            "expandable_segments" => match value.to_ascii_lowercase().as_str() {
                "true" | "1" => PYTORCH_EXPANDABLE.to_string(),
                "false" | "0" => continue,
                _ => {
                    left_out.push(format!("`{entry}` (not true or false)"));
                    continue;
                }
            },
            "backend" if value == "native" => continue,
            k if HOST_ONLY.contains(&k) => continue,
            _ => {
                left_out.push(format!("`{entry}` (no gpualloc equivalent)"));
                continue;
            }
        };
        let mut tried = parts.clone();
        tried.push(part.clone());
        match Config::parse(&tried.join(",")) {
            Ok(_) => parts.push(part),
            Err(e) => left_out.push(format!("`{entry}` ({e})")),
        }
    }
    Translated {
        config: parts.join(","),
        left_out,
    }
}

/// Splits on the commas outside brackets (`roundup_power2_divisions:[...]`).
fn split(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth <= 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytorch_settings_become_policy_pytorch_and_their_equivalents() {
        let t = translate(None);
        assert_eq!(t.config, "policy:pytorch");
        assert!(t.left_out.is_empty());
        let t = translate(Some(
            "expandable_segments:True, max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4],pinned_use_cuda_host_register:True",
        ));
        assert_eq!(
            t.config,
            format!(
                "policy:pytorch,{PYTORCH_EXPANDABLE},max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"
            )
        );
        assert!(t.left_out.is_empty(), "{:?}", t.left_out);
        let c = Config::parse(&t.config).unwrap();
        assert!(c.expandable_segments && !c.defragment && !c.cross_stream_reuse);
        assert_eq!(c.stitch_min, u64::MAX);
        assert_eq!(c.expandable_page, 20 << 20);
    }

    #[test]
    fn what_has_no_equivalent_is_named() {
        let t = translate(Some(
            "backend:cudaMallocAsync,max_split_size_mb:10,garbage_collection_threshold:0.6",
        ));
        assert_eq!(t.config, "policy:pytorch,garbage_collection_threshold:0.6");
        assert_eq!(t.left_out.len(), 2, "{:?}", t.left_out);
        assert!(t.left_out[0].contains("backend:cudaMallocAsync"));
        assert!(t.left_out[1].contains("max_split_size_mb:10"));
        assert!(t.left_out[1].contains("20..="), "{:?}", t.left_out);
    }
}
