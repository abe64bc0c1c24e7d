//! `shardkit cache`: what the local cache of a store's objects (`SHARDKIT_CACHE_DIR`) holds,
//! and emptying it, whole or for one dataset.

use std::path::{Path, PathBuf};

use clap::Subcommand;
use indicatif::BinaryBytes;
use shardkit::json::{self, Escape, Value};
use shardkit::Result;

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
            let dir = shardkit::io::cache_dir_or(dir)?;
            let usage = shardkit::io::cache_usage(&dir)?;
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
                BinaryBytes(usage.bytes),
                usage.objects.len(),
                BinaryBytes(usage.limit)
            );
            for o in &usage.objects {
                let what = match o.pages {
                    0 => "copied whole".to_string(),
                    n => format!("{n} page(s)"),
                };
                println!(
                    "{:>10}  {what:<14}  {}",
                    BinaryBytes(o.bytes).to_string(),
                    o.url
                );
            }
            Ok(true)
        }
        CacheCmd::Clear { url, dir } => {
            let dir = shardkit::io::cache_dir_or(dir)?;
            let (files, bytes) = shardkit::io::clear_cache(&dir, url.as_deref())?;
            println!(
                "removed {files} file(s), {} from {}",
                BinaryBytes(bytes),
                dir.display()
            );
            Ok(true)
        }
    }
}

fn usage_json(dir: &Path, usage: &shardkit::io::CacheUsage) -> Value {
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let objects = usage
        .objects
        .iter()
        .map(|o| {
            Value::Object(vec![
                ("url".into(), Value::String(o.url.clone())),
                ("bytes".into(), Value::int(o.bytes)),
                ("pages".into(), Value::int(o.pages)),
                ("last_used".into(), Value::float(unix(o.last_used), 3)),
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
