//! Byte counts and durations, formatted for people and parsed from them.

/// `1.50 GiB`, `512 B`.
pub fn bytes(b: u64) -> String {
    gpualloc::error::format_bytes_as(b, "B")
}

/// As [`bytes`] with four decimals (`2.2796 GiB`), for sizes that
/// [`bytes`] would print alike.
pub fn precise_bytes(b: u64) -> String {
    let short = bytes(b);
    match short.split_once(' ') {
        Some((_, unit)) if b >= 1024 => {
            let exp = ["KiB", "MiB", "GiB", "TiB"]
                .iter()
                .position(|u| *u == unit)
                .map_or(1, |i| i as i32 + 1);
            format!("{:.4} {unit}", b as f64 / 1024f64.powi(exp))
        }
        _ => short,
    }
}

/// Signed byte difference: `+1.00 MiB`, `-512 B`.
pub fn delta(a: u64, b: u64) -> String {
    if b >= a {
        format!("+{}", bytes(b - a))
    } else {
        format!("-{}", bytes(a - b))
    }
}

/// `12.345 s`, `3.2 ms`, `850 ns`.
pub fn duration(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} us", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.3} s", ns as f64 / 1e9),
    }
}

/// `42.0%`.
pub fn percent(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// Parses `24GiB`, `512M`, `1.5G`, `4096`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    gpualloc::config::parse_bytes("capacity", s).map_err(|e| e.reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.00 KiB");
        assert_eq!(bytes(1 << 50), "1024.00 TiB", "TiB is the largest unit");
        assert_eq!(bytes(3 << 29), "1.50 GiB");
        assert_eq!(delta(3, 1), "-2 B");
        assert_eq!(precise_bytes(2_447_716_928), "2.2796 GiB");
        assert_eq!(precise_bytes(2_444_500_480), "2.2766 GiB");
        assert_eq!(precise_bytes(1 << 50), "1024.0000 TiB");
        assert_eq!(precise_bytes(700), "700 B");
        assert_eq!(duration(1_500_000_000), "1.500 s");
        assert_eq!(parse_bytes("24GiB").unwrap(), 24 << 30);
        assert!(parse_bytes("lots").is_err());
        // The largest count, as the messages name it, and nothing above.
        assert_eq!(parse_bytes("1PiB").unwrap(), 1 << 50);
        assert!(parse_bytes("1.5PiB").is_err());
    }
}
