//! Hand-written SVG charts: no scripts, no fonts to load, no network.

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

/// One line of a [`lines`] chart.
pub struct Series<'a> {
    /// Legend text.
    pub name: &'a str,
    /// Stroke colour.
    pub color: &'a str,
    /// Points (x, y), x increasing.
    pub points: Vec<(f64, f64)>,
}

const W: f64 = 900.0;
const H: f64 = 260.0;
const L: f64 = 80.0;
const B: f64 = 30.0;

/// A line chart; `fy` formats y ticks, `fx` x ticks.
pub fn lines(
    title: &str,
    series: &[Series],
    fx: &dyn Fn(f64) -> String,
    fy: &dyn Fn(f64) -> String,
) -> String {
    let xmax = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(0.0, f64::max)
        .max(1e-9);
    let ymax = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        .max(1e-9);
    let sx = |x: f64| L + x / xmax * (W - L - 10.0);
    let sy = |y: f64| H - B - y / ymax * (H - B - 20.0);
    let mut s = format!(
        "<svg viewBox=\"0 0 {W} {H}\" class=\"chart\" role=\"img\"><title>{}</title>",
        esc(title)
    );
    for i in 0..=4 {
        let y = ymax * f64::from(i) / 4.0;
        let _ = write!(
            s,
            "<line x1=\"{L}\" x2=\"{}\" y1=\"{1:.1}\" y2=\"{1:.1}\" stroke=\"#ddd\"/>",
            W - 10.0,
            sy(y)
        );
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" class=\"tick\">{}</text>",
            L - 4.0,
            sy(y) + 4.0,
            esc(&fy(y))
        );
        let x = xmax * f64::from(i) / 4.0;
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\" class=\"tick\">{}</text>",
            sx(x),
            H - 10.0,
            esc(&fx(x))
        );
    }
    for (k, se) in series.iter().enumerate() {
        let pts: Vec<String> = se
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>",
            se.color,
            pts.join(" ")
        );
        let lx = L + 10.0 + 170.0 * k as f64;
        let _ = write!(
            s,
            "<rect x=\"{lx}\" y=\"4\" width=\"12\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"13\" class=\"tick\">{}</text>",
            se.color,
            lx + 16.0,
            esc(se.name)
        );
    }
    s.push_str("</svg>");
    s
}

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

/// A block of a [`memory_map`] row: (offset, size, colour key, tooltip).
pub type MapBlock = (u64, u64, u64, String);

/// Reserved ranges as rows `(size, blocks)`, blocks coloured by key.
pub fn memory_map(title: &str, regions: &[(u64, Vec<MapBlock>)]) -> String {
    let row = 14.0;
    let h = 10.0 + row * regions.len().max(1) as f64;
    let max = regions.iter().map(|r| r.0).max().unwrap_or(1).max(1) as f64;
    let scale = (W - 20.0) / max;
    let mut s = format!(
        "<svg viewBox=\"0 0 {W} {h}\" class=\"chart\" role=\"img\"><title>{}</title>",
        esc(title)
    );
    for (k, (size, blocks)) in regions.iter().enumerate() {
        let y = 5.0 + row * k as f64;
        let _ = write!(
            s,
            "<rect x=\"10\" y=\"{y:.1}\" width=\"{:.2}\" height=\"{}\" fill=\"#f4f4f4\" stroke=\"#999\" stroke-width=\"0.5\"/>",
            *size as f64 * scale,
            row - 3.0
        );
        for (off, len, key, tip) in blocks {
            let _ = write!(
                s,
                "<rect x=\"{:.2}\" y=\"{y:.1}\" width=\"{:.2}\" height=\"{}\" fill=\"{}\"><title>{}</title></rect>",
                10.0 + *off as f64 * scale,
                (*len as f64 * scale).max(0.3),
                row - 3.0,
                color(*key),
                esc(tip)
            );
        }
    }
    s.push_str("</svg>");
    s
}
