//! `shardkit <format> status DIR`: where a dataset written in parts stands, shared by every
//! format that writes in parts (the status is the same for all; see shardkit::PartsStatus).

use std::path::Path;

use shardkit::json::{self, Escape, Value};
use shardkit::{PartsStatus, Result};

/// The options of every `<format> status` command.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Also show what each rank of a restart with this many ranks would write.
    #[arg(long)]
    world_size: Option<u64>,
    /// Commit when every unit is durable (its last rank was killed while committing).
    #[arg(long)]
    commit: bool,
    /// Print the status as JSON.
    #[arg(long)]
    json: bool,
}

impl StatusArgs {
    /// Prints where the dataset shown as `shown` stands (`status`), or commits it first with
    /// `--commit` (`commit`); false when a commit was asked for and could not be made.
    pub fn run(
        &self,
        shown: &Path,
        unit: &str,
        status: impl FnOnce() -> Result<PartsStatus>,
        commit: impl FnOnce() -> Result<PartsStatus>,
    ) -> Result<bool> {
        let st = if self.commit { commit()? } else { status()? };
        print_status(shown, &st, unit, self.json, self.world_size);
        Ok(st.committed || !self.commit)
    }
}

/// `a..b` as the CLI prints unit ranges (`3` for one unit, `3..6` for several).
fn range(r: &std::ops::Range<u64>) -> String {
    if r.end == r.start + 1 {
        r.start.to_string()
    } else {
        format!("{}..{}", r.start, r.end)
    }
}

fn ranges(rs: &[std::ops::Range<u64>]) -> String {
    if rs.is_empty() {
        return "nothing".into();
    }
    rs.iter().map(range).collect::<Vec<_>>().join(", ")
}

/// Prints `status` of the dataset at `dir`, whose units are `unit`s (e.g. "shard"): with `json`
/// one object (with `resume_plan` for `world_size` ranks when given), otherwise lines.
fn print_status(dir: &Path, status: &PartsStatus, unit: &str, json: bool, world_size: Option<u64>) {
    if json {
        let mut v = status.to_json();
        if let (Some(w), Value::Object(members)) = (world_size, &mut v) {
            let plan = status
                .resume_plan(w)
                .iter()
                .map(|rs| {
                    Value::Array(
                        rs.iter()
                            .map(|r| Value::Array(vec![Value::int(r.start), Value::int(r.end)]))
                            .collect(),
                    )
                })
                .collect();
            members.push(("resume_plan".into(), Value::Array(plan)));
        }
        println!("{}", json::to_pretty(&v, 2, Escape::Utf8));
        return;
    }
    let done = status.done.len();
    if status.committed {
        println!(
            "{}: committed ({done} of {} {unit}s)",
            dir.display(),
            status.units
        );
        return;
    }
    println!(
        "{}: not committed: {done} of {} {unit}s durable",
        dir.display(),
        status.units
    );
    let missing = status.missing();
    println!("  missing: {unit}s {}", ranges(&missing));
    for f in &status.missing_files {
        println!("  missing: {f} (any rank writes it; the commit waits for it)");
    }
    for (r, who) in &status.claimed {
        println!("  claimed: {unit}s {} by {who}", range(r));
    }
    if missing.is_empty() && status.missing_files.is_empty() {
        println!("  every {unit} is durable: `status --commit` (or any rank's finish) commits it");
    } else if let Some(w) = world_size {
        println!("  a restart with {w} rank(s) writes:");
        for (r, rs) in status.resume_plan(w).iter().enumerate() {
            println!("    rank {r}: {unit}s {}", ranges(rs));
        }
    }
}
