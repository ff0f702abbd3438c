//! Bar charts for the report (plotters, SVG), following the conventions of
//! [`crate::figures`]: the legend beside the plot, never over the bars; an
//! error bar (95% interval or min–max) on every bar; an optional dashed
//! reference line (y = 1 for ratios); campaign outcomes as stacked bars,
//! each part with its interval.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// A value with its interval (low, high; NaN: none).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Val {
    pub value: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Val {
    pub fn new(value: f64, lo: f64, hi: f64) -> Val {
        Val { value, lo, hi }
    }
    pub fn point(value: f64) -> Val {
        Val { value, lo: f64::NAN, hi: f64::NAN }
    }
}

/// One series of a grouped bar chart: its label and a value per category
/// (NaN: no bar).
pub struct BarSeries {
    pub label: String,
    pub values: Vec<Val>,
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x7f, 0x7f, 0x7f),
];
const WIDTH: u32 = 980;
const PLOT_WIDTH: u32 = 760;

/// Grouped bars: per category one bar per series, each with its error
/// bar, into `dir/name.svg`; `y_ref` draws a dashed line (e.g. y = 1).
#[allow(clippy::too_many_arguments)]
pub fn grouped(
    dir: &Path,
    name: &str,
    title: &str,
    caption: &str,
    y_label: &str,
    categories: &[String],
    series: &[BarSeries],
    y_ref: Option<(f64, &str)>,
) -> Result<PathBuf> {
    draw(dir, name, title, caption, y_label, categories, series, y_ref, false)
}

/// Stacked bars: per category the series' values on top of each other
/// (shares of outcomes), each part with its own interval drawn at its top.
pub fn stacked(
    dir: &Path,
    name: &str,
    title: &str,
    caption: &str,
    y_label: &str,
    categories: &[String],
    series: &[BarSeries],
) -> Result<PathBuf> {
    draw(dir, name, title, caption, y_label, categories, series, None, true)
}

#[allow(clippy::too_many_arguments)]
fn draw(
    dir: &Path,
    name: &str,
    title: &str,
    caption: &str,
    y_label: &str,
    categories: &[String],
    series: &[BarSeries],
    y_ref: Option<(f64, &str)>,
    stack: bool,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{name}.svg"));
    let n = categories.len().max(1);
    let fin = |v: f64| if v.is_finite() { v } else { 0.0 };
    let mut y1: f64 = y_ref.map_or(0.0, |r| r.0);
    for i in 0..n {
        let mut top = 0.0;
        for s in series {
            let v = s.values.get(i).copied().unwrap_or(Val::point(f64::NAN));
            if stack {
                top += fin(v.value);
                y1 = y1.max(top);
            } else {
                y1 = y1.max(fin(v.value)).max(fin(v.hi));
            }
        }
    }
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let root = SVGBackend::new(&path, (WIDTH, 560)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (main, foot) = root.split_vertically(520);
    foot.draw(&Text::new(caption.to_string(), (15, 8), ("sans-serif", 14))).map_err(|e| err(&e))?;
    let (plot, legend) = main.split_horizontally(PLOT_WIDTH);
    let mut chart = ChartBuilder::on(&plot)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..y1)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    // Category names under the axis, centred on their group of bars.
    let style = TextStyle::from(("sans-serif", 12)).pos(Pos::new(HPos::Center, VPos::Top));
    for (i, c) in categories.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        root.draw(&Text::new(c.clone(), (x, y + 8), style.clone())).map_err(|e| err(&e))?;
    }
    if let Some((y, _)) = y_ref {
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, y), (n as f64, y)],
                6,
                4,
                BLACK.stroke_width(1),
            ))
            .map_err(|e| err(&e))?;
    }
    let k = series.len().max(1) as f64;
    let w = if stack { 0.6 } else { 0.8 / k };
    let mut bottoms = vec![0.0; n];
    // A stacked part's interval is drawn at its top, clipped to the stack
    // (shares cannot pass the whole), each part's bar a little to the right
    // of the one below it so they do not overlap.
    let totals: Vec<f64> = (0..n)
        .map(|i| series.iter().filter_map(|s| s.values.get(i)).map(|v| fin(v.value)).sum())
        .collect();
    for (j, s) in series.iter().enumerate() {
        let color = PALETTE[j % PALETTE.len()];
        for (i, v) in s.values.iter().enumerate().take(n) {
            if !v.value.is_finite() {
                continue;
            }
            let x0 = if stack { i as f64 + 0.2 } else { i as f64 + 0.1 + j as f64 * w };
            let base = if stack { bottoms[i] } else { 0.0 };
            let top = base + v.value;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x0, base), (x0 + w, top)],
                    color.mix(0.8).filled(),
                )))
                .map_err(|e| err(&e))?;
            if v.lo.is_finite() && v.hi.is_finite() {
                let (xc, ceiling) = if stack {
                    (x0 + w * (0.2 + 0.6 * j as f64 / (k - 1.0).max(1.0)), totals[i])
                } else {
                    (x0 + w / 2.0, f64::INFINITY)
                };
                let (lo, hi) = (top - (v.value - v.lo), (top + (v.hi - v.value)).min(ceiling));
                chart
                    .draw_series(std::iter::once(ErrorBar::new_vertical(
                        xc,
                        lo.max(0.0),
                        top,
                        hi,
                        BLACK.stroke_width(1),
                        6,
                    )))
                    .map_err(|e| err(&e))?;
            }
            if stack {
                bottoms[i] = top;
            }
        }
    }
    let mut entries: Vec<(String, ShapeStyle)> = series
        .iter()
        .enumerate()
        .map(|(j, s)| (s.label.clone(), PALETTE[j % PALETTE.len()].mix(0.8).filled()))
        .collect();
    if let Some((_, label)) = y_ref {
        entries.push((label.to_string(), BLACK.stroke_width(1)));
    }
    entries.push(("error bars: 95% interval or min–max".into(), BLACK.stroke_width(1)));
    for (i, (label, style)) in entries.iter().enumerate() {
        let y = 60 + 24 * i as i32;
        legend.draw(&Rectangle::new([(8, y - 6), (28, y + 6)], *style)).map_err(|e| err(&e))?;
        legend
            .draw(&Text::new(label.clone(), (36, y - 7), ("sans-serif", 13)))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    drop(chart);
    drop((plot, legend, main, foot));
    drop(root);
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_have_their_labels_legend_beside_and_error_bars() {
        let dir = tempfile::tempdir().unwrap();
        let cats = vec!["microreset".to_string(), "microreboot".to_string()];
        let s = vec![BarSeries {
            label: "recovered".into(),
            values: vec![Val::new(0.9, 0.7, 0.97), Val::new(0.8, 0.6, 0.9)],
        }];
        let p = grouped(
            dir.path(),
            "g",
            "t",
            "Paper Fig. 2 analogue",
            "share",
            &cats,
            &s,
            Some((1.0, "y = 1")),
        )
        .unwrap();
        let svg = std::fs::read_to_string(p).unwrap();
        assert!(svg.contains("microreset") && svg.contains("microreboot"));
        assert!(svg.contains("recovered") && svg.contains("Paper Fig. 2 analogue"));
        let p = stacked(dir.path(), "s", "t", "c", "share", &cats, &s).unwrap();
        assert!(std::fs::read_to_string(p).unwrap().contains("recovered"));
    }
}
