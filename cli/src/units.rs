//! Byte counts and durations, formatted for people and parsed from them.

/// `1.50 GiB`, `512 B`.
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
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
        assert_eq!(bytes(3 << 29), "1.50 GiB");
        assert_eq!(delta(3, 1), "-2 B");
        assert_eq!(duration(1_500_000_000), "1.500 s");
        assert_eq!(parse_bytes("24GiB").unwrap(), 24 << 30);
        assert!(parse_bytes("lots").is_err());
    }
}
