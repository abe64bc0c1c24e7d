//! `shardkit <format> checksum` and the checksum part of `validate --deep`, shared by every
//! format (the sidecar is the same for all; see shardkit::checksum).

use std::path::Path;

use shardkit::checksum;
use shardkit::error::Result;

/// Writes the sidecar of the dataset at `path` (every file hashed).
pub fn checksum(path: &Path) -> Result<bool> {
    let sidecar = checksum::record(path)?;
    let sums = checksum::Checksums::read(&sidecar)?.unwrap_or_default();
    let bytes: u64 = sums.files.values().map(|s| s.bytes).sum();
    println!(
        "{}: {} file(s), {bytes} bytes hashed (xxh3-64 per block)",
        sidecar.display(),
        sums.files.len()
    );
    Ok(true)
}

/// Prints the checksum verdict as `validate --deep` lines; true when nothing is damaged.
pub fn print_deep(path: &Path) -> bool {
    let (errors, notes) = checksum::verify_messages(path);
    for e in &errors {
        println!("error: {e}");
    }
    for n in &notes {
        println!("note: {n}");
    }
    errors.is_empty()
}
