//! `shardkit bench ...`: the benchmarks are their own binary, `shardkit-bench`
//! (crates/shardkit-bench), so that `shardkit` links neither the plotting library nor the
//! corpus writers they need. This finds it (next to this executable, then on PATH) and runs it
//! with the arguments unchanged: its output and exit status are the command's.

use std::ffi::OsString;
use std::process::{Command, ExitCode};

/// The benchmarks' binary.
const BENCH: &str = "shardkit-bench";

/// Runs `shardkit-bench ARGS...` in place of this process (on Unix) or as a child whose exit
/// status becomes this one's.
pub fn run(args: Vec<OsString>) -> ExitCode {
    let Some(bin) = shardkit_cli::sibling_exe(BENCH) else {
        eprintln!(
            "error: `shardkit bench` runs the {BENCH} binary, which is neither next to {} nor on \
             PATH: build it with `cargo build --release -p shardkit-bench` (it lands next to \
             `shardkit` in target/release) or install it with `cargo install --path \
             crates/shardkit-bench`",
            std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| "shardkit".into())
        );
        return ExitCode::from(1);
    };
    let mut cmd = Command::new(&bin);
    cmd.args(&args);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // Usage lines and argument errors name the command that was typed.
        let e = cmd.arg0("shardkit bench").exec();
        eprintln!("error: cannot run {}: {e}", bin.display());
        ExitCode::from(1)
    }
    #[cfg(not(unix))]
    match cmd.status() {
        Ok(s) => ExitCode::from(s.code().map_or(1, |c| c as u8)),
        Err(e) => {
            eprintln!("error: cannot run {}: {e}", bin.display());
            ExitCode::from(1)
        }
    }
}
