//! `shardkit <format> checksum` and the checksum part of `validate --deep`, shared by every
//! format (the sidecar is the same for all; see shardkit::checksum).

use std::path::Path;

use shardkit::checksum;
use shardkit::report::{Severity, Validation};
use shardkit::Result;

/// Writes the sidecar of the dataset at `path` (every file hashed).
pub fn checksum(path: &Path) -> Result<bool> {
    let rec = checksum::record(path)?;
    println!(
        "{}: {} file(s), {} bytes hashed (xxh3-64 per block)",
        rec.sidecar.display(),
        rec.files.len(),
        rec.bytes
    );
    Ok(true)
}

/// Prints what every `validate` command prints: with `json`, the report as one object;
/// otherwise an `error: FILE: MESSAGE` or `note: ...` line per finding and a verdict line.
/// True when the report has no error.
pub fn print_report(report: &Validation, json: bool, deep: bool) -> bool {
    if json {
        println!(
            "{}",
            shardkit::json::to_pretty(&report.to_json(), 2, shardkit::json::Escape::Utf8)
        );
    } else {
        for f in &report.findings {
            let what = match f.severity {
                Severity::Error => "error",
                Severity::Note => "note",
            };
            println!("{what}: {f}");
        }
        let n = report.errors().count();
        println!(
            "{}: {}{}",
            report.path.display(),
            if n == 0 {
                "valid".to_string()
            } else {
                format!("INVALID ({n} error(s))")
            },
            if deep { " (deep)" } else { "" }
        );
    }
    report.is_valid()
}
