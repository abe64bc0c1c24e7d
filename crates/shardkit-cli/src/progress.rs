//! Progress bars on stderr: drawn on a terminal, hidden otherwise (pipes, logs, tests).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// What a bar counts.
#[derive(Clone, Copy)]
pub enum Unit {
    /// Bytes, shown as sizes and a byte rate.
    Bytes,
    /// Items of the named kind ("samples", "tokens").
    Items(&'static str),
}

/// A bar labelled `what` for `total` units (a spinner until [`set_total`] where the total is
/// not known yet), or a hidden one when stderr is not a terminal.
pub fn bar(total: Option<u64>, what: &str, unit: Unit) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new_spinner();
    pb.set_message(what.to_string());
    if let Some(total) = total {
        set_total(&pb, total, unit);
    }
    pb
}

/// Turns `pb` (a spinner or a bar) into a bar of `total` units.
pub fn set_total(pb: &ProgressBar, total: u64, unit: Unit) {
    let counts = match unit {
        Unit::Bytes => "{bytes}/{total_bytes} {bytes_per_sec}".to_string(),
        Unit::Items(what) => format!("{{pos}}/{{len}} {what} {{per_sec}}"),
    };
    pb.set_length(total);
    pb.set_style(
        ProgressStyle::with_template(&format!("{{msg}} [{{bar:30}}] {counts} eta {{eta}}"))
            .expect("valid template")
            .progress_chars("=> "),
    );
}
