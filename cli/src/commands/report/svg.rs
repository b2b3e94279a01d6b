//! Hand-written SVG bar charts for the report's static parts: no fonts to
//! load, no network.

use std::fmt::Write;

/// Escapes text for HTML and SVG.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A palette colour for any key.
pub fn color(i: u64) -> &'static str {
    const P: [&str; 10] = [
        "#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7",
        "#9c755f", "#bab0ab",
    ];
    P[(i % P.len() as u64) as usize]
}

const W: f64 = 900.0;

/// Horizontal bars: (label, value, colour key).
pub fn bars(title: &str, items: &[(String, f64, u64)], fv: &dyn Fn(f64) -> String) -> String {
    let row = 20.0;
    let h = 10.0 + row * items.len().max(1) as f64;
    let vmax = items.iter().map(|i| i.1).fold(0.0, f64::max).max(1e-9);
    let left = 220.0;
    let mut s = format!(
        "<svg viewBox=\"0 0 {W} {h}\" class=\"chart\" role=\"img\"><title>{}</title>",
        esc(title)
    );
    for (k, (label, v, key)) in items.iter().enumerate() {
        let y = 5.0 + row * k as f64;
        let w = v / vmax * (W - left - 120.0);
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" class=\"tick\">{}</text><rect x=\"{left}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{}\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\" class=\"tick\">{}</text>",
            left - 6.0,
            y + 13.0,
            esc(label),
            row - 4.0,
            color(*key),
            left + w + 4.0,
            y + 13.0,
            esc(&fv(*v))
        );
    }
    s.push_str("</svg>");
    s
}
