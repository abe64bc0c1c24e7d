//! `shardkit cache`: what the local cache of a store's objects (`SHARDKIT_CACHE_DIR`) holds,
//! and emptying it, whole or for one dataset.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use shardkit::json::{self, Escape, Value};
use shardkit::{Error, Result};

#[derive(Subcommand)]
pub enum CacheCmd {
    /// What the cache holds, by object, the largest first.
    Info {
        /// The cache directory (default: $SHARDKIT_CACHE_DIR).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Removes the cached objects under a URL (`s3://bucket/prefix`, or one object's URL),
    /// or every object. Safe beside processes reading through the cache: they fetch again
    /// what they miss, and writes in progress are left to finish.
    Clear {
        /// Only the objects at or below this URL.
        url: Option<String>,
        /// The cache directory (default: $SHARDKIT_CACHE_DIR).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

pub fn run(cmd: CacheCmd) -> Result<bool> {
    match cmd {
        CacheCmd::Info { dir, json } => {
            let dir = cache_dir(dir)?;
            let usage = shardkit::storage::cache_usage(&dir)?;
            if json {
                println!(
                    "{}",
                    json::to_pretty(&usage_json(&dir, &usage), 2, Escape::Utf8)
                );
                return Ok(true);
            }
            println!(
                "{}: {} in {} object(s), limit {}",
                dir.display(),
                size(usage.bytes),
                usage.objects.len(),
                size(usage.limit)
            );
            for o in &usage.objects {
                let what = match o.pages {
                    0 => "copied whole".to_string(),
                    n => format!("{n} page(s)"),
                };
                println!("{:>10}  {what:<14}  {}", size(o.bytes), o.url);
            }
            Ok(true)
        }
        CacheCmd::Clear { url, dir } => {
            let dir = cache_dir(dir)?;
            let (files, bytes) = shardkit::storage::clear_cache(&dir, url.as_deref())?;
            println!(
                "removed {files} file(s), {} from {}",
                size(bytes),
                dir.display()
            );
            Ok(true)
        }
    }
}

/// `--dir`, else `$SHARDKIT_CACHE_DIR`.
fn cache_dir(dir: Option<PathBuf>) -> Result<PathBuf> {
    dir.or_else(shardkit::storage::cache_dir).ok_or_else(|| {
        Error::Invalid("no cache directory: pass --dir, or set SHARDKIT_CACHE_DIR".into())
    })
}

fn usage_json(dir: &Path, usage: &shardkit::storage::CacheUsage) -> Value {
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    };
    let objects = usage
        .objects
        .iter()
        .map(|o| {
            Value::Object(vec![
                ("url".into(), Value::String(o.url.clone())),
                ("bytes".into(), Value::int(o.bytes)),
                ("pages".into(), Value::int(o.pages)),
                ("last_used_unix_s".into(), Value::int(unix(o.last_used))),
            ])
        })
        .collect();
    Value::Object(vec![
        ("dir".into(), Value::String(dir.display().to_string())),
        ("bytes".into(), Value::int(usage.bytes)),
        ("limit_bytes".into(), Value::int(usage.limit)),
        ("objects".into(), Value::Array(objects)),
    ])
}

/// `n` bytes in binary units, three significant figures.
fn size(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{n} B"),
        _ if x >= 100.0 => format!("{x:.0} {}", UNITS[unit]),
        _ if x >= 10.0 => format!("{x:.1} {}", UNITS[unit]),
        _ => format!("{x:.2} {}", UNITS[unit]),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(super::size(0), "0 B");
        assert_eq!(super::size(1023), "1023 B");
        assert_eq!(super::size(1536), "1.50 KiB");
        assert_eq!(super::size(40 << 20), "40.0 MiB");
        assert_eq!(super::size(32 << 30), "32.0 GiB");
        assert_eq!(super::size(300 << 30), "300 GiB");
    }
}
