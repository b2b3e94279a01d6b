//! PyTorch's allocator settings that gpualloc honours.
//!
//! Note [PyTorch's settings under gpualloc]
//! `PYTORCH_CUDA_ALLOC_CONF` (or, when it is not set, `PYTORCH_ALLOC_CONF`:
//! the order torch 2.11's `CUDAAllocatorConfig` reads them in) configures
//! PyTorch's own allocator. gpualloc takes its policy from its own
//! configuration, but two of PyTorch's keys are no policy: they are the
//! user's word about the process, which must hold whichever allocator runs.
//!
//! - `per_process_memory_fraction` (0 to 1) caps the memory the process may
//!   reserve on each device; PyTorch applies it to each device when its
//!   allocator starts there, as `set_per_process_memory_fraction` would. A
//!   user sharing a GPU sets it so that this process leaves the rest alone.
//!   gpualloc does the same ([`Allocator::with_start_fraction`]): each device
//!   starts with the cap, recorded in a trace as a cap set at run time (so a
//!   replay applies it), and `set_per_process_memory_fraction` replaces it.
//!   gpualloc's own key of the same name, when given, wins.
//! - `graph_capture_record_stream_reuse` is read by the C++ bridge from
//!   PyTorch when a capture begins (Note [Reuse inside a capture]).
//!
//! A fraction PyTorch would refuse (not a number, or outside `[0, 1]`) is an
//! error naming the variable, not a silently uncapped process. Everything
//! else in the string is PyTorch's, and left to it: keys it does not know,
//! brackets it cannot read.
//!
//! [`Allocator::with_start_fraction`]: crate::Allocator::with_start_fraction

use crate::config::ConfigError;

/// PyTorch's variables for its allocator's settings, in the order torch
/// reads them: the first one set is the one used.
pub const TORCH_ALLOC_CONF_VARS: [&str; 2] = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"];

/// PyTorch's key for the cap on each device's reserved memory.
pub const FRACTION_KEY: &str = "per_process_memory_fraction";

/// The `per_process_memory_fraction` of PyTorch's settings string `conf`
/// (its last occurrence, as PyTorch's parser keeps the last); `None` when
/// the string has none or cannot be read into entries. `var` names the
/// variable in errors.
///
/// # Errors
/// A value that is not a number in `[0, 1]`.
pub fn memory_fraction_in(var: &str, conf: &str) -> Result<Option<f64>, ConfigError> {
    // Unbalanced brackets: PyTorch's to report.
    let Ok(entries) = crate::config::split_top_level(conf) else {
        return Ok(None);
    };
    let mut found = None;
    for entry in entries {
        let Some((key, value)) = entry.split_once(':') else {
            continue;
        };
        if key.trim() != FRACTION_KEY {
            continue;
        }
        let value = value.trim();
        match value.parse::<f64>() {
            Ok(x) if crate::is_memory_fraction(x) => found = Some(x),
            _ => {
                return Err(ConfigError {
                    key: format!("{var}: {FRACTION_KEY}"),
                    reason: format!(
                        "`{}` is not a number in [0, 1] (PyTorch refuses it too)",
                        clip(value)
                    ),
                });
            }
        }
    }
    Ok(found)
}

/// PyTorch's `per_process_memory_fraction` from the environment (the first
/// of [`TORCH_ALLOC_CONF_VARS`] that is set); `None` when unset, absent,
/// or 1 (no cap).
///
/// # Errors
/// As [`memory_fraction_in`]; a value that is not UTF-8.
pub fn memory_fraction_from_env() -> Result<Option<f64>, ConfigError> {
    for var in TORCH_ALLOC_CONF_VARS {
        match std::env::var(var) {
            Ok(conf) => return Ok(memory_fraction_in(var, &conf)?.filter(|&x| x < 1.0)),
            Err(std::env::VarError::NotPresent) => continue,
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(ConfigError {
                    key: var.to_string(),
                    reason: "the value is not valid UTF-8".to_string(),
                });
            }
        }
    }
    Ok(None)
}

/// At most 40 characters of `s`, for messages.
fn clip(s: &str) -> String {
    match s.char_indices().nth(40) {
        None => s.to_string(),
        Some((i, _)) => format!("{}...", &s[..i]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VAR: &str = "PYTORCH_CUDA_ALLOC_CONF";

    #[test]
    fn the_fraction_is_read_among_pytorchs_other_keys() {
        let conf = "expandable_segments:True, per_process_memory_fraction : 0.25 ,\
                    roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6";
        assert_eq!(memory_fraction_in(VAR, conf), Ok(Some(0.25)));
        assert_eq!(
            memory_fraction_in(VAR, "per_process_memory_fraction:1"),
            Ok(Some(1.0))
        );
        assert_eq!(
            memory_fraction_in(VAR, "per_process_memory_fraction:0"),
            Ok(Some(0.0))
        );
        assert_eq!(
            memory_fraction_in(VAR, "per_process_memory_fraction:5e-1"),
            Ok(Some(0.5))
        );
        // The last one counts, as in PyTorch's parser.
        let twice = "per_process_memory_fraction:0.5,per_process_memory_fraction:0.75";
        assert_eq!(memory_fraction_in(VAR, twice), Ok(Some(0.75)));
    }

    #[test]
    fn strings_without_the_fraction_give_none() {
        for conf in [
            "",
            "expandable_segments:True",
            "max_split_size_mb:128,backend:native",
            // Inside a bracket it is part of another key's value.
            "roundup_power2_divisions:[per_process_memory_fraction:0.5]",
            // Unreadable: left to PyTorch.
            "per_process_memory_fraction:0.5]",
            "my_per_process_memory_fraction:0.5",
        ] {
            assert_eq!(memory_fraction_in(VAR, conf), Ok(None), "{conf:?}");
        }
    }

    #[test]
    fn a_fraction_pytorch_refuses_is_an_error_naming_the_variable() {
        for bad in ["1.5", "-0.1", "half", "", "nan", "inf"] {
            let conf = format!("expandable_segments:True,per_process_memory_fraction:{bad}");
            let e = memory_fraction_in(VAR, &conf).unwrap_err();
            assert!(e.key.contains(VAR) && e.key.contains(FRACTION_KEY), "{e}");
            assert!(e.reason.contains(&format!("`{bad}`")), "{e}");
        }
    }
}
