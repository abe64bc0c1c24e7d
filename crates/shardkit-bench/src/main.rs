//! `shardkit-bench`: shardkit's benchmarks, a binary of their own so that the user's `shardkit`
//! does not link what only they need (plotting, corpus writers). `shardkit bench ...` runs it
//! with the same arguments.

use std::process::ExitCode;

use clap::Parser;
// The CLI's commands whose synthetic datasets the benchmarks write (`crate::saev_cmd::synth`...).
use shardkit_cli::{eagle3_cmd, env_logger_lite, npy, saev_cmd};

mod bench;
mod bench_corpus;
mod bench_eagle3;
mod bench_link;
mod bench_parts;
mod bench_precision;
mod bench_remote;
mod bench_sdnb;
mod bench_tokens;
mod plot;

/// Measurements that print JSON with the ceiling measured in the same run.
#[derive(Parser)]
#[command(name = "shardkit-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: bench::BenchCmd,
}

fn main() -> ExitCode {
    // `shardkit-bench ... | head` should end quietly, as other Unix tools do.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    env_logger_lite();
    let cli = Cli::parse();
    let result = bench::run(cli.cmd);
    // Pages fetched through SHARDKIT_CACHE_DIR are written after the reads return: kept now.
    let result = result.and_then(|()| shardkit::io::wait_for_cache());
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
