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
//! The string is read as torch 2.11 reads it ([`memory_fraction_in`]). A
//! fraction PyTorch would refuse (not a number, or outside `[0, 1]`) is an
//! error naming the variable, not a silently uncapped process, from
//! `gpualloc_configure` (so `install()` raises it) and every call after.
//! Everything else in the string is PyTorch's, and left to it.
//!
//! Two limits. A replay applies the recorded cap as it applies caps the
//! program set (a trace cannot tell them apart, and both are outside the
//! configuration), also under a `--config` with a fraction of its own,
//! where a live run would have ignored PyTorch's key. And a fraction given
//! through `torch.cuda.memory._set_allocator_settings` before CUDA starts
//! is read from the strings the Python package hands on (Note [PyTorch's
//! fraction set at run time] in the C ABI crate): before `install()`, only
//! the last one torch took counts.
//!
//! [`Allocator::with_start_fraction`]: crate::Allocator::with_start_fraction

use crate::config::ConfigError;

/// PyTorch's variables for its allocator's settings, in the order torch
/// reads them: the first one set is the one used.
pub const TORCH_ALLOC_CONF_VARS: [&str; 2] = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"];

/// PyTorch's key for the cap on each device's reserved memory.
pub const FRACTION_KEY: &str = "per_process_memory_fraction";

/// The `per_process_memory_fraction` of PyTorch's settings string `conf`,
/// read as torch 2.11 reads it (`ConfigTokenizer` and
/// `CUDAAllocatorConfig::parseArgs`): whitespace anywhere is dropped; `,`,
/// `:`, `[` and `]` are tokens of their own; a key is followed by one
/// separator token and its value (a bracketed list for some keys); the
/// value is read as `std::stod` reads it, the longest number at its start.
/// The last occurrence counts, as in PyTorch. `None` when the string has
/// none. `var` names the variable in errors.
///
/// # Errors
/// A value that is not a number in `[0, 1]`, or no value after the key:
/// what PyTorch's allocator refuses too.
pub fn memory_fraction_in(var: &str, conf: &str) -> Result<Option<f64>, ConfigError> {
    let tokens = tokens(conf);
    let refuse = |why: String| ConfigError {
        key: format!("{var}: {FRACTION_KEY}"),
        reason: format!(
            "{why} (PyTorch's allocator refuses it too): correct {var}, or give gpualloc's own per_process_memory_fraction, which then wins"
        ),
    };
    let mut found = None;
    let mut i = 0;
    while i < tokens.len() {
        // The key, then one separator, then the value.
        let key = &tokens[i];
        i += 2;
        if key == FRACTION_KEY {
            let Some(value) = tokens.get(i) else {
                return Err(refuse("no value follows the key".to_string()));
            };
            match stod(value) {
                Some(x) if crate::is_memory_fraction(x) => found = Some(x),
                _ => {
                    return Err(refuse(format!(
                        "`{}` is not a number in [0, 1]",
                        clip(value)
                    )));
                }
            }
        } else if tokens.get(i).is_some_and(|t| t == "[") {
            // Another key's list: up to its `]`.
            while i < tokens.len() && tokens[i] != "]" {
                i += 1;
            }
        }
        // Past the value and the `,` after it.
        i += 2;
    }
    Ok(found)
}

/// PyTorch's `per_process_memory_fraction` from the environment (the first
/// of [`TORCH_ALLOC_CONF_VARS`] that is set, even empty, as torch takes
/// it); `None` when unset, absent, or 1 (no cap).
///
/// # Errors
/// As [`memory_fraction_in`].
pub fn memory_fraction_from_env() -> Result<Option<f64>, ConfigError> {
    for var in TORCH_ALLOC_CONF_VARS {
        // PyTorch reads bytes; the key is ASCII, so a value that is not
        // UTF-8 elsewhere still reads.
        if let Some(conf) = std::env::var_os(var) {
            let conf = conf.to_string_lossy();
            return Ok(memory_fraction_in(var, &conf)?.filter(|&x| x < 1.0));
        }
    }
    Ok(None)
}

/// PyTorch's tokens of a settings string (`ConfigTokenizer`).
fn tokens(conf: &str) -> Vec<String> {
    let (mut out, mut word) = (Vec::new(), String::new());
    for ch in conf.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !word.is_empty() {
                out.push(std::mem::take(&mut word));
            }
            out.push(ch.to_string());
        } else if !ch.is_ascii_whitespace() && ch != '\u{b}' {
            word.push(ch);
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// The number at the start of `s` as C's `strtod` (and so `std::stod`)
/// reads it: decimal or hexadecimal, `inf` and `nan` included; `None`
/// when nothing at its start is a number.
fn stod(s: &str) -> Option<f64> {
    let (sign, rest) = match s.as_bytes().first() {
        Some(b'-') => (-1.0, &s[1..]),
        Some(b'+') => (1.0, &s[1..]),
        _ => (1.0, s),
    };
    if rest.starts_with(['+', '-']) {
        return None;
    }
    if let Some(hex) = rest.strip_prefix("0x").or_else(|| rest.strip_prefix("0X")) {
        // A hexadecimal float needs a digit after `0x`; else `0` is the number.
        return Some(sign * hex_float(hex).unwrap_or(0.0));
    }
    // The longest prefix Rust reads as a number is the one `strtod` reads
    // (Rust takes no hexadecimal, handled above, and no trailing text).
    (1..=rest.len())
        .rev()
        .filter(|&n| rest.is_char_boundary(n))
        .find_map(|n| rest[..n].parse::<f64>().ok())
        .map(|x| sign * x)
}

/// The value of hexadecimal float digits after `0x` (`1.8p-1`), reading as
/// many as form one; `None` when no digit comes first.
fn hex_float(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    let (mut i, mut value, mut digits, mut scale) = (0, 0.0f64, 0, 0i32);
    let mut point = false;
    while i < b.len() {
        match b[i] {
            b'.' if !point => point = true,
            c if c.is_ascii_hexdigit() => {
                value = value * 16.0 + f64::from((c as char).to_digit(16)?);
                digits += 1;
                if point {
                    scale -= 4;
                }
            }
            _ => break,
        }
        i += 1;
    }
    if digits == 0 {
        return None;
    }
    let mut exp = 0i32;
    if i < b.len() && (b[i] == b'p' || b[i] == b'P') {
        let rest = &s[i + 1..];
        let end = rest
            .char_indices()
            .find(|&(k, c)| !(c.is_ascii_digit() || (k == 0 && (c == '-' || c == '+'))))
            .map_or(rest.len(), |(k, _)| k);
        if let Ok(e) = rest[..end].parse::<i32>() {
            exp = e;
        }
    }
    Some(value * 2f64.powi(scale.saturating_add(exp)))
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

    fn read(conf: &str) -> Option<f64> {
        memory_fraction_in(VAR, conf).unwrap()
    }

    #[test]
    fn the_fraction_is_read_among_pytorchs_other_keys() {
        let conf = "expandable_segments:True, per_process_memory_fraction : 0.25 ,\
                    roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6";
        assert_eq!(read(conf), Some(0.25));
        assert_eq!(read("per_process_memory_fraction:1"), Some(1.0));
        assert_eq!(read("per_process_memory_fraction:0"), Some(0.0));
        // The last one counts, as in PyTorch's parser.
        let twice = "per_process_memory_fraction:0.5,per_process_memory_fraction:0.75";
        assert_eq!(read(twice), Some(0.75));
        // After a list, and a list after it.
        let lists = "roundup_power2_divisions:[256:1,>:8],per_process_memory_fraction:0.5,\
                     roundup_power2_divisions:[1:2]";
        assert_eq!(read(lists), Some(0.5));
    }

    /// What torch 2.11's tokenizer and `std::stod` make of unusual strings
    /// (checked against its `_accelerator_setAllocatorSettings`).
    #[test]
    fn strings_read_as_pytorch_reads_them() {
        for (conf, want) in [
            // Whitespace is dropped anywhere, also inside a key or value.
            ("per_process _memory_fraction:0.5", Some(0.5)),
            ("per_process_memory_fraction:0. 5", Some(0.5)),
            ("\tper_process_memory_fraction\u{b}:\n0.5", Some(0.5)),
            // Any one token separates key and value.
            ("per_process_memory_fraction,0.5", Some(0.5)),
            ("per_process_memory_fraction:0.5]", Some(0.5)),
            // `std::stod` reads the number at the start.
            ("per_process_memory_fraction:0.5abc", Some(0.5)),
            ("per_process_memory_fraction:5e-1", Some(0.5)),
            ("per_process_memory_fraction:.5", Some(0.5)),
            ("per_process_memory_fraction:+0.5", Some(0.5)),
            ("per_process_memory_fraction:0x1p-1", Some(0.5)),
            ("per_process_memory_fraction:0x.8", Some(0.5)),
            ("per_process_memory_fraction:0x", Some(0.0)),
            ("per_process_memory_fraction:1e", Some(1.0)),
            // Inside another key's list it is that key's.
            (
                "roundup_power2_divisions:[per_process_memory_fraction:0.5]",
                None,
            ),
            ("", None),
            ("expandable_segments:True", None),
            ("my_per_process_memory_fraction:0.5", None),
        ] {
            assert_eq!(read(conf), want, "{conf:?}");
        }
    }

    #[test]
    fn a_fraction_pytorch_refuses_is_an_error_naming_the_variable() {
        for bad in [
            "1.5", "-0.1", "half", "nan", "inf", "--0.5", "-", ",", "0x1p1",
        ] {
            let conf = format!("expandable_segments:True,per_process_memory_fraction:{bad}");
            let e = memory_fraction_in(VAR, &conf).unwrap_err();
            assert!(e.key.contains(VAR) && e.key.contains(FRACTION_KEY), "{e}");
            assert!(
                e.reason
                    .contains("gpualloc's own per_process_memory_fraction"),
                "{e}"
            );
            if bad != "," {
                assert!(e.reason.contains(&format!("`{bad}`")), "{e}");
            }
        }
        for end in [
            "per_process_memory_fraction",
            "per_process_memory_fraction:",
        ] {
            let e = memory_fraction_in(VAR, end).unwrap_err();
            assert!(e.reason.contains("no value"), "{e}");
        }
    }

    #[test]
    fn stod_reads_numbers_as_c_does() {
        assert_eq!(stod("0.25xyz"), Some(0.25));
        assert_eq!(stod("infinite"), Some(f64::INFINITY));
        assert_eq!(stod("-0x1.8p1"), Some(-3.0));
        assert_eq!(stod("0X10"), Some(16.0));
        assert_eq!(stod("abc"), None);
        assert_eq!(stod(""), None);
        assert!(stod("nan").is_some_and(f64::is_nan));
    }
}
