//! `shardkit`: the command-line tool over the shardkit library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use shardkit_cli::{
    cache_cmd, dspark_cmd, eagle3_cmd, env_logger_lite, progress, saev_cmd, sdnb_cmd, tokens_cmd,
};

mod bench_forward;

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
    #[command(subcommand, visible_alias = "flat-tokens")]
    Tokens(tokens_cmd::TokensCmd),
    /// EAGLE-3 offline caches (NeMo Automodel): manifest + safetensors shards.
    #[command(subcommand)]
    Eagle3(eagle3_cmd::Eagle3Cmd),
    /// DSpark offline caches (NeMo Automodel): manifest + safetensors shards + target weights.
    #[command(subcommand)]
    Dspark(dspark_cmd::DsparkCmd),
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
    ///
    /// Run by the `shardkit-bench` binary (its own crate, crates/shardkit-bench), found next to
    /// this executable or on PATH; every argument goes to it unchanged.
    #[command(disable_help_flag = true)]
    Bench {
        /// The benchmark and its options, as `shardkit-bench` takes them.
        #[arg(num_args = 0.., trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
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
        shardkit::upload(src, dst, &mut report)?
    } else {
        shardkit::download(src, dst, &mut report)?
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
        Cmd::Dspark(c) => dspark_cmd::run(c),
        Cmd::Sdnb(c) => sdnb_cmd::run(c),
        Cmd::Upload { src, dst } => transfer(&src, &dst, true),
        Cmd::Download { src, dst } => transfer(&src, &dst, false),
        Cmd::Cache(c) => cache_cmd::run(c),
        // The benchmarks' process ends here: its own exit status, its output passed through.
        Cmd::Bench { args } => return bench_forward::run(args),
    };
    // Pages fetched through SHARDKIT_CACHE_DIR are written after the reads return: kept now.
    let result = result.and_then(|ok| shardkit::io::wait_for_cache().map(|()| ok));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
