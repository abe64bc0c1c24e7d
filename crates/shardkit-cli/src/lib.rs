//! The commands of the `shardkit` binary, as a library: the binary (src/main.rs) parses the
//! command line and runs them, and the benchmarks (`shardkit-bench`, crates/shardkit-bench)
//! reuse the synthetic-data writers (`saev synth`, `eagle3 synth`) and the `.npy` writer. Not a
//! stable API: it changes with the CLI.
#![doc(hidden)]

pub mod cache_cmd;
pub mod checksum_cmd;
pub mod dspark_cmd;
pub mod eagle3_cmd;
pub mod inspect_text;
pub mod npy;
pub mod parts_cmd;
pub mod progress;
pub mod saev_cmd;
pub mod saev_convert_cmd;
pub mod sdnb_cmd;
pub mod tokens_cmd;

/// The executable `name` (the platform's suffix added) next to the running executable, else
/// the first on PATH: how `shardkit bench` finds `shardkit-bench`, and the benchmarks
/// `shardkit`.
pub fn sibling_exe(name: &str) -> Option<std::path::PathBuf> {
    let name = format!("{name}{}", std::env::consts::EXE_SUFFIX);
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(&name)));
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    beside
        .into_iter()
        .chain(on_path.into_iter().map(|dir| dir.join(&name)))
        .find(|p| p.is_file())
}

/// Library warnings (unknown protocol minor, foreign key names) go to stderr.
pub fn env_logger_lite() {
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
