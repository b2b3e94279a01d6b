//! Plain memory by default under WSL.
//!
//! Note [Plain memory on WSL]
//! Rationale: under WSL 2, CUDA's virtual memory management (the
//! `cuMemCreate` / `cuMemMap` / `cuMemSetAccess` that expandable memory is
//! made of) fails where native Linux does not. Drivers before R615 refuse
//! `cuMemSetAccess` with "unknown error" on memory created capable of
//! GPUDirect RDMA, which they advertise (pytorch/pytorch#192330), so every
//! allocation fails; and WSL's residency path refuses mapped memory on
//! others (`dxgkio_make_resident -12`, kernels failing with "device not
//! ready"), which projects answer by turning PyTorch's
//! `expandable_segments` off under WSL. gpualloc's default is that kind of
//! memory, so a WSL user who never asked for it would meet those failures.
//! Approach: on the CUDA backend under WSL, a configuration that does not
//! give `expandable_segments` itself takes plain segments, and the library
//! says so once on stderr. The key is added to the configuration in force
//! (`expandable_segments:false`), so that its string, a trace's header and a
//! replay show and do what the live run did. Given, either way, it wins:
//! `expandable_segments:true` brings gpualloc's expandable memory back.

use gpualloc::Config;

use crate::boundary::Error;

/// Whether this process runs under WSL: the variables WSL sets, or the
/// kernel's release string.
pub(crate) fn detected() -> bool {
    let set = |name| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    if set("WSL_DISTRO_NAME") || set("WSL_INTEROP") {
        return true;
    }
    std::fs::read_to_string("/proc/sys/kernel/osrelease").is_ok_and(|r| release_is_wsl(&r))
}

/// Whether a kernel release string is WSL's (`...-microsoft-standard-WSL2`,
/// `...-Microsoft` for WSL 1).
fn release_is_wsl(release: &str) -> bool {
    let r = release.to_ascii_lowercase();
    r.contains("microsoft") || r.contains("wsl")
}

/// `config` as it holds under WSL (`wsl`): plain segments unless it gives
/// `expandable_segments` itself (Note [Plain memory on WSL]). Whether it
/// changed comes back too, for the caller to say.
pub(crate) fn effective(config: Config, wsl: bool) -> Result<(Config, bool), Error> {
    if !wsl || !config.expandable_segments || config.states("expandable_segments") {
        return Ok((config, false));
    }
    let given = config.source.trim();
    let plain = if given.is_empty() {
        "expandable_segments:false".to_string()
    } else {
        format!("{given},expandable_segments:false")
    };
    Ok((Config::parse(&plain)?, true))
}

/// Said once when the WSL default applies.
pub(crate) const SAID: &str = "gpualloc: WSL detected: memory comes from plain segments by default, as CUDA's virtual memory management fails under WSL on several drivers (cuMemSetAccess 'unknown error' before R615, dxgkio_make_resident); GPUALLOC_CONF=expandable_segments:true brings gpualloc's expandable memory back";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wsl_kernels_are_told_from_others() {
        assert!(release_is_wsl("6.6.87.2-microsoft-standard-WSL2\n"));
        assert!(release_is_wsl("4.4.0-19041-Microsoft"));
        assert!(!release_is_wsl("6.8.0-1015-aws"));
        assert!(!release_is_wsl("5.15.0-119-generic"));
    }

    #[test]
    fn under_wsl_a_configuration_silent_on_the_key_takes_plain_segments() {
        let parse = |s: &str| Config::parse(s).unwrap();
        // Not WSL: unchanged.
        let (c, changed) = effective(parse("defragment:false"), false).unwrap();
        assert!(c.expandable_segments && !changed);
        // WSL: plain, with the key in the string in force.
        let (c, changed) = effective(parse(""), true).unwrap();
        assert!(!c.expandable_segments && changed);
        assert_eq!(c.source, "expandable_segments:false");
        let (c, changed) = effective(parse("max_split_size_mb:256"), true).unwrap();
        assert!(!c.expandable_segments && changed);
        assert_eq!(c.max_split_size, 256 << 20);
        assert_eq!(c.source, "max_split_size_mb:256,expandable_segments:false");
        // Given, either way, it wins; policy:pytorch is plain already.
        for given in [
            "expandable_segments:true",
            "expandable_segments:false",
            "policy:pytorch",
        ] {
            let (c, changed) = effective(parse(given), true).unwrap();
            assert!(!changed && c.source == given, "{given}");
        }
    }
}
