//! Throughput-over-time plots for `shardkit bench ... --plot FILE.png`.

use std::path::Path;

use plotters::prelude::*;
use shardkit::{Error, Result};

/// One measured run: name and (seconds since start, cumulative bytes) samples.
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Samples in time order.
    pub samples: Vec<(f64, u64)>,
}

/// Fonts looked for, in order; text is drawn only if one is found.
const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> bool {
    for f in FONTS {
        if let Ok(bytes) = std::fs::read(f) {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

/// Throughput of each series in 0.25 s buckets (MB/s).
fn rates(samples: &[(f64, u64)]) -> Vec<(f64, f64)> {
    let bucket = 0.25;
    let mut out = Vec::new();
    let (mut t0, mut b0) = (0.0, 0u64);
    for &(t, b) in samples {
        if t - t0 >= bucket {
            out.push(((t0 + t) / 2.0, (b - b0) as f64 / (t - t0) / 1e6));
            t0 = t;
            b0 = b;
        }
    }
    out
}

/// Draws each series' throughput over time against horizontal ceiling lines (bytes/s).
pub fn draw(path: &Path, title: &str, series: &[Series], ceilings: &[(&str, f64)]) -> Result<()> {
    let err = |e: String| Error::Invalid(format!("cannot draw {}: {e}", path.display()));
    let text = register_font();
    let lines: Vec<(String, Vec<(f64, f64)>)> = series
        .iter()
        .map(|s| (s.name.clone(), rates(&s.samples)))
        .collect();
    let t_max = lines
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.0))
        .fold(1.0f64, f64::max);
    let y_max = lines
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.1))
        .chain(ceilings.iter().map(|c| c.1 / 1e6))
        .fold(1.0f64, f64::max)
        * 1.15;
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(title, ("sans-serif", 26))
            .x_label_area_size(45)
            .y_label_area_size(70);
    }
    let mut chart = builder
        .build_cartesian_2d(0f64..t_max * 1.02, 0f64..y_max)
        .map_err(|e| err(e.to_string()))?;
    if text {
        chart
            .configure_mesh()
            .x_desc("seconds since the loader started")
            .y_desc("payload MB/s")
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    let palette = [&BLUE, &RED, &GREEN, &MAGENTA, &CYAN];
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = palette[i % palette.len()];
        let s = chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?;
        if text {
            s.label(name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
    }
    for (name, c) in ceilings {
        let y = c / 1e6;
        let s = chart
            .draw_series(LineSeries::new(
                vec![(0.0, y), (t_max * 1.02, y)],
                BLACK.mix(0.6).stroke_width(1),
            ))
            .map_err(|e| err(e.to_string()))?;
        if text {
            let label = format!("{name} ({y:.0} MB/s)");
            s.label(label)
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.6)));
        }
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}
