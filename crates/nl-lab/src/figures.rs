//! Figures for the benchmarks, drawn with plotters into SVG files.
//!
//! Conventions every figure follows: a log axis has a labelled tick at
//! every decade ([`decades`]); the legend is drawn beside the plot, never
//! over the data; a ratio plot ([`ratio_chart`]) has a dashed y = 1 line and
//! an error bar (the 95% interval, or min–max) on every median.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;

/// One line of a figure: a label and (x, y) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// Width of every figure, and of its plot area (the legend goes right of it).
const WIDTH: u32 = 980;
const PLOT_WIDTH: u32 = 780;

/// The powers of ten from the one at or below `lo` to the one at or above
/// `hi`: the ticks of a log axis over lo..hi (one per decade).
pub fn decades(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo > 0.0 && hi >= lo && hi.is_finite()) {
        return vec![1.0];
    }
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a..=b).map(|e| 10f64.powi(e)).filter(|v| *v >= lo * 0.999 && *v <= hi * 1.001).collect()
}

/// The legend, one colored line and label per series, in its own area
/// beside the plot.
fn draw_legend<'a, DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    labels: impl Iterator<Item = &'a str>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    for (i, label) in labels.enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = 60 + 24 * i as i32;
        area.draw(&PathElement::new(vec![(8, y), (32, y)], color.stroke_width(3)))?;
        area.draw(&Text::new(label.to_string(), (40, y - 7), ("sans-serif", 15)))?;
    }
    Ok(())
}

/// One series of a ratio chart: per x, the median and its interval.
pub struct SpreadSeries {
    pub label: String,
    /// (x, median, low, high).
    pub points: Vec<(f64, f64, f64, f64)>,
}

/// A ratio chart (values against a baseline measured in the same run):
/// medians with error bars from `low` to `high`, a dashed y = 1 line, the
/// x axis log-scaled with a tick per decade when `log_x`, into
/// `dir/name.svg`. `caption` names the paper figure it corresponds to.
#[allow(clippy::too_many_arguments)]
pub fn ratio_chart(
    dir: &Path,
    name: &str,
    title: &str,
    caption: &str,
    (x_label, y_label): (&str, &str),
    series: &[SpreadSeries],
    log_x: bool,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{name}.svg"));
    let pts = || series.iter().flat_map(|s| s.points.iter()).filter(|p| p.1.is_finite());
    let x0 = pts().map(|p| p.0).fold(f64::MAX, f64::min);
    let x1 = pts().map(|p| p.0).fold(f64::MIN, f64::max);
    let (x0, x1) = if x0 > x1 { (1.0, 10.0) } else { (x0, x1) };
    let finite = |v: f64, d: f64| if v.is_finite() { v } else { d };
    let y0 = pts().map(|p| finite(p.2, p.1)).fold(1.0, f64::min).min(1.0) * 0.9;
    let y1 = pts().map(|p| finite(p.3, p.1)).fold(1.0, f64::max).max(1.0) * 1.1;
    let root = SVGBackend::new(&path, (WIDTH, 540)).into_drawing_area();
    let draw = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let (main, foot) = root.split_vertically(500);
    foot.draw(&Text::new(caption.to_string(), (15, 8), ("sans-serif", 14)))
        .map_err(|e| draw(&e))?;
    let (plot, legend) = main.split_horizontally(PLOT_WIDTH);
    let mut cb = ChartBuilder::on(&plot);
    cb.caption(title, ("sans-serif", 20)).margin(15).x_label_area_size(40).y_label_area_size(60);
    // The x axis: log with decade ticks, or linear with 5% padding.
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .x_label_formatter(&|v| format!("{v}"))
                .draw()
                .map_err(|e| draw(&e))?;
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x0, 1.0), (x1, 1.0)],
                    6,
                    4,
                    BLACK.stroke_width(1),
                ))
                .map_err(|e| draw(&e))?;
            for (i, s) in series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let mut p: Vec<_> = s.points.iter().copied().filter(|p| p.1.is_finite()).collect();
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                chart
                    .draw_series(LineSeries::new(
                        p.iter().map(|q| (q.0, q.1)),
                        color.stroke_width(2),
                    ))
                    .map_err(|e| draw(&e))?;
                chart
                    .draw_series(p.iter().map(|&(x, m, lo, hi)| {
                        ErrorBar::new_vertical(
                            x,
                            finite(lo, m),
                            m,
                            finite(hi, m),
                            color.stroke_width(2),
                            8,
                        )
                    }))
                    .map_err(|e| draw(&e))?;
            }
        }};
    }
    if log_x {
        let (a, b) = (x0 * 0.8, x1 * 1.25);
        body!(cb
            .build_cartesian_2d((a..b).log_scale().with_key_points(decades(a, b)), y0..y1)
            .map_err(|e| draw(&e))?);
    } else {
        let pad = (x1 - x0).max(1.0) * 0.05;
        body!(cb.build_cartesian_2d((x0 - pad)..(x1 + pad), y0..y1).map_err(|e| draw(&e))?);
    }
    let labels: Vec<&str> =
        series.iter().map(|s| s.label.as_str()).chain(["y = 1 (baseline)"]).collect();
    draw_legend(&legend, labels.into_iter()).map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    drop((plot, legend, main, foot));
    drop(root);
    Ok(path)
}

/// Draws `series` as lines with markers on a log-scaled y axis (values
/// spanning 1 to thousands stay readable) into `dir/name.svg`.
pub fn line_chart(
    dir: &Path,
    name: &str,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{name}.svg"));
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 1.0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        if y.is_finite() {
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    let pad = (x1 - x0).max(1.0) * 0.05;
    let root = SVGBackend::new(&path, (WIDTH, 500)).into_drawing_area();
    let draw = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let (plot, legend) = root.split_horizontally(PLOT_WIDTH);
    let (ylo, yhi) = (0.5f64, y1 * 1.5);
    let mut chart = ChartBuilder::on(&plot)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (x0 - pad)..(x1 + pad),
            (ylo..yhi).log_scale().with_key_points(decades(ylo, yhi)),
        )
        .map_err(|e| draw(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .y_label_formatter(&|v| format!("{v}"))
        .draw()
        .map_err(|e| draw(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut p: Vec<(f64, f64)> =
            s.points.iter().copied().filter(|(_, y)| y.is_finite()).collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(p.clone(), color.stroke_width(2)))
            .map_err(|e| draw(&e))?;
        chart
            .draw_series(p.iter().map(|&(x, y)| Circle::new((x, y), 4, color.filled())))
            .map_err(|e| draw(&e))?;
    }
    draw_legend(&legend, series.iter().map(|s| s.label.as_str())).map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    drop(chart);
    drop((plot, legend));
    drop(root);
    Ok(path)
}

/// Draws `series` as lines on linear axes, y from 0 (a time series), with
/// a dashed horizontal line at `y_ref` if given, into `dir/name.svg`.
pub fn time_chart(
    dir: &Path,
    name: &str,
    title: &str,
    (x_label, y_label): (&str, &str),
    series: &[Series],
    y_ref: Option<f64>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{name}.svg"));
    let pts = || series.iter().flat_map(|s| s.points.iter()).filter(|p| p.1.is_finite());
    let x0 = pts().map(|p| p.0).fold(f64::MAX, f64::min);
    let x1 = pts().map(|p| p.0).fold(f64::MIN, f64::max);
    let (x0, x1) = if x0 > x1 { (0.0, 1.0) } else { (x0, x1) };
    let y1 = pts().map(|p| p.1).fold(y_ref.unwrap_or(1.0), f64::max) * 1.1;
    let root = SVGBackend::new(&path, (WIDTH, 500)).into_drawing_area();
    let draw = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let (plot, legend) = root.split_horizontally(PLOT_WIDTH);
    let mut chart = ChartBuilder::on(&plot)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1.max(x0 + 1e-9), 0.0..y1)
        .map_err(|e| draw(&e))?;
    chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw().map_err(|e| draw(&e))?;
    if let Some(y) = y_ref {
        chart
            .draw_series(DashedLineSeries::new(vec![(x0, y), (x1, y)], 6, 4, BLACK.stroke_width(1)))
            .map_err(|e| draw(&e))?;
    }
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut p: Vec<(f64, f64)> =
            s.points.iter().copied().filter(|(_, y)| y.is_finite()).collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart.draw_series(LineSeries::new(p, color.stroke_width(2))).map_err(|e| draw(&e))?;
    }
    draw_legend(&legend, series.iter().map(|s| s.label.as_str())).map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    drop(chart);
    drop((plot, legend));
    drop(root);
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_with_every_series() {
        let dir = tempfile::tempdir().unwrap();
        let s = vec![
            Series { label: "cow-b".into(), points: vec![(50.0, 2.2), (1000.0, 1.1)] },
            Series { label: "cow-p".into(), points: vec![(50.0, 1.0), (1000.0, f64::INFINITY)] },
        ];
        let p = line_chart(dir.path(), "fig", "t", "interval (ms)", "normalized time", &s).unwrap();
        let svg = std::fs::read_to_string(p).unwrap();
        assert!(svg.starts_with("<svg") || svg.contains("<svg"));
        assert!(svg.contains("cow-b") && svg.contains("cow-p"));
        let s = vec![
            Series { label: "warm".into(), points: vec![(-1.0, 1.0), (0.0, 0.0), (2.0, 1.1)] },
            Series { label: "cold".into(), points: vec![(-1.0, 1.0), (1.0, f64::NAN)] },
        ];
        let p = time_chart(dir.path(), "ts", "t", ("s", "rel"), &s, Some(1.0)).unwrap();
        let svg = std::fs::read_to_string(p).unwrap();
        assert!(svg.contains("warm") && svg.contains("cold"));
    }

    /// The x coordinate of the `<text>` element whose content is `label`.
    fn text_x(svg: &str, label: &str) -> Option<f64> {
        svg.split("<text").skip(1).find_map(|t| {
            let (tag, rest) = t.split_once('>')?;
            let content = rest.split("</text>").next()?.trim();
            (content == label)
                .then(|| tag.split(" x=\"").nth(1)?.split('"').next()?.parse().ok())?
        })
    }

    #[test]
    fn log_axes_have_a_tick_per_decade() {
        assert_eq!(decades(0.5, 1500.0), vec![1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(decades(1.0, 10.0), vec![1.0, 10.0]);
        let dir = tempfile::tempdir().unwrap();
        let s = vec![Series { label: "a".into(), points: vec![(1.0, 2.0), (2.0, 1400.0)] }];
        let p = line_chart(dir.path(), "decades", "t", "x", "y", &s).unwrap();
        let svg = std::fs::read_to_string(p).unwrap();
        for tick in ["1", "10", "100", "1000"] {
            assert!(text_x(&svg, tick).is_some(), "no tick label {tick}");
        }
    }

    #[test]
    fn legends_are_beside_the_plot_and_ratio_charts_have_y1_and_error_bars() {
        let dir = tempfile::tempdir().unwrap();
        let s = vec![SpreadSeries {
            label: "cow-p".into(),
            points: vec![(50.0, 1.4, 1.2, 1.7), (200.0, 1.1, 1.0, 1.3), (1000.0, 1.0, 0.9, 1.2)],
        }];
        let p = ratio_chart(
            dir.path(),
            "ratio",
            "t",
            "Paper Fig. 3 analogue",
            ("interval (ms)", "normalized time"),
            &s,
            true,
        )
        .unwrap();
        let svg = std::fs::read_to_string(p).unwrap();
        // The legend entries start right of the plot area.
        for label in ["cow-p", "y = 1 (baseline)"] {
            let x = text_x(&svg, label).unwrap_or_else(|| panic!("no legend entry {label}"));
            assert!(x > f64::from(PLOT_WIDTH), "legend {label} at x={x} is over the plot");
        }
        assert!(svg.contains("Paper Fig. 3 analogue"));
        for tick in ["100", "1000"] {
            assert!(text_x(&svg, tick).is_some(), "no decade tick {tick} on the log x axis");
        }
        // Three error bars in the series' color, each a vertical line and two caps.
        let bars = svg.split("<line").skip(1).filter(|l| l.contains("stroke=\"#1F77B4\"")).count();
        assert!(bars >= 3 * 3, "error-bar lines: {bars}");
        let plain = time_chart(
            dir.path(),
            "ts",
            "t",
            ("s", "rel"),
            &[Series { label: "warm".into(), points: vec![(0.0, 1.0), (1.0, 2.0)] }],
            None,
        )
        .unwrap();
        let svg = std::fs::read_to_string(plain).unwrap();
        assert!(text_x(&svg, "warm").unwrap() > f64::from(PLOT_WIDTH));
    }
}
