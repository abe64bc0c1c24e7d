//! `shardkit`: the command-line tool over the shardkit library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod bench_corpus;
mod bench_eagle3;
mod bench_link;
mod bench_remote;
mod bench_sdnb;
mod bench_tokens;
mod cache_cmd;
mod checksum_cmd;
mod eagle3_cmd;
mod inspect_text;
mod npy;
mod plot;
mod progress;
mod saev_cmd;
mod sdnb_cmd;
mod tokens_cmd;

/// Exact, crash-safe, fast access to ML training caches.
#[derive(Parser)]
#[command(name = "shardkit", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once; boxing would only add noise
enum Cmd {
    /// saev Sharded Activation File Protocol directories.
    #[command(subcommand)]
    Saev(saev_cmd::SaevCmd),
    /// flat-tokens (seqax) zarr datasets.
    #[command(subcommand)]
    Tokens(tokens_cmd::TokensCmd),
    /// EAGLE-3 offline caches (NeMo Automodel): manifest + safetensors shards.
    #[command(subcommand)]
    Eagle3(eagle3_cmd::Eagle3Cmd),
    /// SameDiff containers (Deeplearning4j): SDNB files, shard sets and SDZ archives.
    #[command(subcommand)]
    Sdnb(sdnb_cmd::SdnbCmd),
    /// Copies a local dataset (any format; a directory or a container file) to an object store
    /// (`s3://bucket/prefix`): data objects first, the commit record last, objects already
    /// there skipped, so a rerun after a kill finishes the upload.
    Upload {
        /// The local dataset directory or container file.
        src: std::path::PathBuf,
        /// The destination, `s3://bucket/prefix`.
        dst: std::path::PathBuf,
    },
    /// Copies a dataset from an object store into a local directory (or file): each file
    /// written atomically, the commit record last, complete files skipped on a rerun.
    Download {
        /// The source, `s3://bucket/prefix`.
        src: std::path::PathBuf,
        /// The local destination.
        dst: std::path::PathBuf,
    },
    /// The local cache of a store's objects (`SHARDKIT_CACHE_DIR`): what it holds, and
    /// emptying it.
    #[command(subcommand)]
    Cache(cache_cmd::CacheCmd),
    /// Measurements that print JSON with the ceiling measured in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

/// `shardkit upload` / `shardkit download`: a byte bar, then a one-line summary.
fn transfer(src: &std::path::Path, dst: &std::path::Path, up: bool) -> shardkit::Result<bool> {
    use progress::{bar, set_total, Unit};
    let pb = bar(
        None,
        if up { "uploading" } else { "downloading" },
        Unit::Bytes,
    );
    let mut sized = false;
    let mut report = |done: u64, total: u64| {
        if !sized {
            set_total(&pb, total, Unit::Bytes);
            sized = true;
        }
        pb.set_position(done);
    };
    let t = if up {
        shardkit::storage::upload(src, dst, &mut report)?
    } else {
        shardkit::storage::download(src, dst, &mut report)?
    };
    pb.finish_and_clear();
    println!(
        "{} {} object(s), {} bytes; {} already there",
        if up { "uploaded" } else { "downloaded" },
        t.copied,
        t.bytes,
        t.skipped
    );
    Ok(true)
}

fn main() -> ExitCode {
    // `shardkit ... | head` should end quietly, as other Unix tools do, not panic in println!.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    env_logger_lite();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Saev(c) => saev_cmd::run(c),
        Cmd::Tokens(c) => tokens_cmd::run(c),
        Cmd::Eagle3(c) => eagle3_cmd::run(c),
        Cmd::Sdnb(c) => sdnb_cmd::run(c),
        Cmd::Upload { src, dst } => transfer(&src, &dst, true),
        Cmd::Download { src, dst } => transfer(&src, &dst, false),
        Cmd::Cache(c) => cache_cmd::run(c),
        Cmd::Bench(c) => bench::run(c).map(|_| true),
    };
    // Pages fetched through SHARDKIT_CACHE_DIR are written after the reads return: kept now.
    let result = result.and_then(|ok| shardkit::storage::wait_for_cache().map(|()| ok));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Library warnings (unknown protocol minor, foreign key names) go to stderr.
fn env_logger_lite() {
    struct Stderr;
    impl log::Log for Stderr {
        fn enabled(&self, m: &log::Metadata) -> bool {
            m.level() <= log::Level::Warn
        }
        fn log(&self, r: &log::Record) {
            if self.enabled(r.metadata()) {
                eprintln!("warning: {}", r.args());
            }
        }
        fn flush(&self) {}
    }
    static LOGGER: Stderr = Stderr;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Warn);
}
