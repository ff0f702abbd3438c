//! Figures for the benchmarks, drawn with plotters into SVG files.

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
    let root = SVGBackend::new(&path, (800, 500)).into_drawing_area();
    let draw = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), (0.5f64..y1 * 1.5).log_scale())
        .map_err(|e| draw(&e))?;
    chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw().map_err(|e| draw(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut p: Vec<(f64, f64)> =
            s.points.iter().copied().filter(|(_, y)| y.is_finite()).collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(p.clone(), color.stroke_width(2)))
            .map_err(|e| draw(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(p.iter().map(|&(x, y)| Circle::new((x, y), 4, color.filled())))
            .map_err(|e| draw(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    drop(chart);
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
    let root = SVGBackend::new(&path, (900, 500)).into_drawing_area();
    let draw = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let mut chart = ChartBuilder::on(&root)
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
        chart
            .draw_series(LineSeries::new(p, color.stroke_width(2)))
            .map_err(|e| draw(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    drop(chart);
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
}
