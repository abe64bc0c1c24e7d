//! `shardkit saev convert`, and what the other saev commands show or write of a dataset's
//! stored type: `inspect`'s precision line, `export --dtype stored`.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use crate::npy;
use crate::progress::{self, Unit};
use shardkit::json::Value;
use shardkit::precision::Dtype;
use shardkit::saev::{self, ConvertOptions, ConvertProgress, WriteStart};
use shardkit::{Error, Result};

/// `saev convert SRC --dtype NAME --out ROOT`: converts with a byte bar (of the source's
/// bytes), says on stderr when it resumes or finds the destination complete, and prints the
/// new dataset's directory.
pub fn convert(src: &Path, dtype: &str, out: &Path, max_rel_error: Option<f64>) -> Result<PathBuf> {
    let dtype = Dtype::from_name(dtype)?;
    let pb = progress::bar(None, &format!("converting to {dtype}"), Unit::Bytes);
    let bar = pb.clone();
    let mut first = true;
    let report = move |p: &ConvertProgress| {
        if first {
            first = false;
            progress::set_total(&bar, p.examples * p.source_example_bytes, Unit::Bytes);
            match p.start {
                WriteStart::Resumed { from } => {
                    bar.suspend(|| eprintln!("resuming at example {from} of {}", p.examples))
                }
                WriteStart::AlreadyComplete => bar.suspend(|| {
                    eprintln!(
                        "already complete: the destination holds this dataset; nothing written"
                    )
                }),
                WriteStart::Fresh => {}
            }
        }
        bar.set_position(p.examples_done * p.source_example_bytes);
        ControlFlow::Continue(())
    };
    let opts = ConvertOptions {
        max_rel_error,
        progress: Some(Box::new(report)),
        ..Default::default()
    };
    let dir = saev::convert(src, out, dtype, opts)?;
    pb.finish_and_clear();
    println!("{}", dir.display());
    Ok(dir)
}

/// Whether `saev export --dtype NAME` asks for the values as stored (`stored`) rather than as
/// float32 (`float32` or one of its names, the default).
pub fn export_stored(name: &str) -> Result<bool> {
    if name == "stored" {
        return Ok(true);
    }
    match Dtype::parse(name) {
        Some(Dtype::F32) => Ok(false),
        _ => Err(Error::Invalid(format!(
            "export --dtype {name:?}: expected float32 (the default: values widened exactly) or \
             stored (float16 as '<f2'; bfloat16, which numpy has no type for, as its bits \
             '<u2' named act_bf16_bits)"
        ))),
    }
}

/// The `.npz` array of a layer exported as stored: its name, numpy type and bytes per value.
/// numpy has no bfloat16, so its bits go out as uint16 under a name that says so (an `act`
/// of integers would be read as activations).
pub fn stored_array(dtype: Dtype) -> (&'static str, npy::Dtype, usize) {
    match dtype {
        Dtype::BF16 => ("act_bf16_bits", npy::Dtype::U16, 2),
        Dtype::F16 => ("act", npy::Dtype::F16, 2),
        _ => ("act", npy::Dtype::F32, 4),
    }
}

/// `inspect`'s summary for text: `precision` as one line, and `saev_loads` saying why saev
/// refuses a reduced dataset and what converts it.
pub fn precision_text(v: Value, dir: &Path) -> Value {
    let Value::Object(mut members) = v else {
        return v;
    };
    let dtype = members
        .iter()
        .find(|(k, _)| k == "dtype")
        .and_then(|(_, v)| v.as_str())
        .and_then(Dtype::parse)
        .unwrap_or_default();
    for (k, v) in members.iter_mut() {
        match k.as_str() {
            "precision" => *v = Value::String(precision_line(dtype, v)),
            "saev_loads" if dtype.is_reduced() => {
                *v = Value::String(format!(
                    "no: saev's own loaders read float32 only (this dataset stores {dtype}); \
                     `shardkit saev convert {} --dtype float32 --out ROOT` writes a copy they load",
                    dir.display()
                ))
            }
            _ => {}
        }
    }
    Value::Object(members)
}

/// One line of what the error sidecars record (`v`: inspect's `precision` object).
fn precision_line(dtype: Dtype, v: &Value) -> String {
    if !dtype.is_reduced() {
        return "exact (float32: nothing rounded)".into();
    }
    let int = |k: &str| v.get(k).and_then(Value::as_i64).unwrap_or(0);
    let real = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let list = |k: &str| match v.get(k) {
        Some(Value::Array(items)) => items.len(),
        _ => 0,
    };
    let mut line = format!(
        "{dtype}, {} shard(s) measured: max abs error {}, relative L2 error per row max {} / \
         mean {}, {} overflowed to inf, {} flushed to zero",
        int("shards_measured"),
        short(real("max_abs_error")),
        short(real("max_rel_l2_error")),
        short(real("mean_rel_l2_error")),
        int("overflow"),
        int("flushed_to_zero"),
    );
    if list("shards_without_sidecar") > 0 {
        line += &format!(
            "; {} shard(s) without an error sidecar",
            list("shards_without_sidecar")
        );
    }
    if list("bad_sidecars") > 0 {
        line += &format!("; {} bad sidecar(s) (see validate)", list("bad_sidecars"));
    }
    line
}

/// `x` to 4 significant digits: plain between 0.001 and 10000, else in e-notation.
fn short(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if (1e-3..1e4).contains(&x.abs()) {
        let digits = (3 - x.abs().log10().floor() as i32).max(0) as usize;
        let s = format!("{x:.digits$}");
        match s.contains('.') {
            true => s.trim_end_matches('0').trim_end_matches('.').into(),
            false => s,
        }
    } else {
        format!("{x:.3e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_short() {
        assert_eq!(short(8.4375), "8.438");
        assert_eq!(short(0.0036990), "0.003699");
        assert_eq!(short(1260.0), "1260");
        assert_eq!(short(3.699e-5), "3.699e-5");
        assert_eq!(short(0.0), "0");
    }

    #[test]
    fn the_precision_line_and_why_saev_refuses() {
        let v = shardkit::json::parse(
            br#"{"dtype": "bfloat16", "precision": {"dtype": "bfloat16", "shards_measured": 3,
                "rows": 50, "values": 400, "max_abs_error": 8.4375, "max_rel_l2_error": 0.003699,
                "mean_rel_l2_error": 0.00126, "overflow": 1, "flushed_to_zero": 2,
                "shards_without_sidecar": [4], "bad_sidecars": []}, "saev_loads": false}"#,
        )
        .unwrap();
        let text = crate::inspect_text::render(&precision_text(v, Path::new("/d/x")));
        assert_eq!(
            text,
            format!(
                "{:<28} bfloat16\n{:<28} bfloat16, 3 shard(s) measured: max abs error 8.438, \
                 relative L2 error per row max 0.003699 / mean 0.00126, 1 overflowed to inf, 2 \
                 flushed to zero; 1 shard(s) without an error sidecar\n{:<28} no: saev's own \
                 loaders read float32 only (this dataset stores bfloat16); `shardkit saev \
                 convert /d/x --dtype float32 --out ROOT` writes a copy they load\n",
                "dtype", "precision", "saev_loads"
            )
        );
        let f32 = shardkit::json::parse(
            br#"{"dtype": "float32", "precision": null, "saev_loads": true}"#,
        )
        .unwrap();
        let text = crate::inspect_text::render(&precision_text(f32, Path::new("/d/x")));
        assert!(
            text.contains("exact (float32: nothing rounded)\nsaev_loads"),
            "{text}"
        );
        assert!(text.ends_with("true\n"), "{text}");
    }

    #[test]
    fn export_takes_float32_or_stored() {
        assert!(!export_stored("float32").unwrap());
        assert!(!export_stored("fp32").unwrap());
        assert!(export_stored("stored").unwrap());
        let e = export_stored("bf16").unwrap_err().to_string();
        assert!(
            e.starts_with("export --dtype \"bf16\": expected float32"),
            "{e}"
        );
    }
}
