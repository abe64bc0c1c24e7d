//! Converting a saev dataset between float32 and reduced precision (bfloat16, float16).
//!
//! [`convert`] reads every example (and labels.bin) of a complete dataset, local or in a
//! store, and writes them through [`Writer`] as the same dataset in another dtype: the same
//! metadata but `dtype`, so a new content hash and a new directory `dst_root/<name>`. What it
//! writes is, byte for byte, what a [`Writer`] given the same float32 rows writes directly:
//!
//! * float32 → bfloat16 / float16 rounds to nearest, ties to even, and records each shard's
//!   rounding error against the float32 source in its sidecar (`acts{s:06}.error.json`);
//! * bfloat16 / float16 → float32 widens exactly (a dataset saev's own loaders read);
//! * float16 ↔ bfloat16 goes through float32: the sidecar then measures this rounding
//!   against the source's stored values (the earlier rounding's error is not known here).
//!
//! Only protocol 2.1 can hold a reduced dtype (shardkit's dialect of 2.1); a 1.0.0 or 2.0
//! dataset has no 2.1 name to convert to (its metadata keys differ), so converting one to a
//! reduced dtype is refused with what to do instead. Converting to the dtype the dataset
//! already has is refused too: the result would be the source itself (same metadata, same
//! name), so a copy is `shardkit upload` / `download` or `cp -r`, not a conversion.
//!
//! The conversion streams: a reader thread fetches runs of whole examples (large sequential
//! reads split over threads, or concurrent ranged GETs) while the writer rounds and writes
//! the previous run, so memory stays a few [`ConvertOptions::chunk_bytes`], whatever the
//! dataset's size. It inherits the writer's crash safety: a conversion killed at any point is
//! continued by running it again (from the first shard not durable), ending byte-identical to
//! an uninterrupted one, and a complete destination is reported as such and left untouched.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use crate::error::{Error, Result};
use crate::io::{self, Location, ReadRange};
use crate::precision::{self, Dtype};
use crate::saev::{Dataset, Layout, Metadata, WriteStart, Writer, WriterOptions};

/// Where a conversion stands, as its progress callback sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertProgress {
    /// What the writer found at the destination (fresh, resumed at an example, complete).
    pub start: WriteStart,
    /// Examples durably or provisionally written to the destination so far.
    pub examples_done: u64,
    /// The dataset's examples.
    pub examples: u64,
    /// Bytes of one example as the source stores it (for byte counts and rates).
    pub source_example_bytes: u64,
}

/// The progress callback of a conversion: called once the destination is opened, then after
/// each run of examples written. `Break` stops the conversion there, leaving the destination
/// resumable (the call then fails with [`Error::Interrupted`]).
pub type ProgressFn = Box<dyn FnMut(&ConvertProgress) -> ControlFlow<()> + Send>;

/// Options of [`convert`].
pub struct ConvertOptions {
    /// Converting to a reduced dtype: refuse (naming shard, example, layer and token) a row
    /// whose relative L2 rounding error exceeds this, or that overflows; the destination is
    /// left resumable up to the last shard written. See [`WriterOptions::max_rel_error`].
    pub max_rel_error: Option<f64>,
    /// Float32 bytes of each run of examples read and written at once (at least one example).
    /// Memory held is about four times this: the run being read, one queued, the one being
    /// written and its rounded copy.
    pub chunk_bytes: usize,
    /// Called as the conversion goes (see [`ProgressFn`]).
    pub progress: Option<ProgressFn>,
}

/// The default [`ConvertOptions::chunk_bytes`]: 64 MiB of float32 values.
pub const DEFAULT_CHUNK_BYTES: usize = 64 << 20;

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            max_rel_error: None,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            progress: None,
        }
    }
}

impl std::fmt::Debug for ConvertOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvertOptions")
            .field("max_rel_error", &self.max_rel_error)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// The metadata of `md`'s dataset converted to `dtype` (the destination's name is its hash),
/// or why there is none: the same dtype (nothing to convert), or a reduced dtype for a
/// protocol other than 2.1. `src` names the dataset in errors.
pub fn converted_metadata(md: &Metadata, dtype: Dtype, src: &Path) -> Result<Metadata> {
    let have = md.dtype();
    if have == dtype {
        return Err(Error::Invalid(format!(
            "{}: already {dtype}; nothing to convert (the result would be this dataset under \
             its own name; to copy it use `shardkit upload` / `shardkit download` or cp -r)",
            src.display()
        )));
    }
    if dtype.is_reduced() && md.protocol() != "2.1" {
        return Err(Error::Invalid(format!(
            "{}: cannot convert protocol {} to {dtype}: bfloat16 and float16 are shardkit's \
             dialect of protocol 2.1 only, and {}'s metadata keys have no 2.1 form (saev's 2.1 \
             `data` is a pickle of the original dataset); write the float32 rows again as \
             protocol 2.1 with \"dtype\": \"{dtype}\" (saev.Writer, or `shardkit saev write \
             --dtype {dtype}` with 2.1 metadata)",
            src.display(),
            md.protocol(),
            md.protocol()
        )));
    }
    md.with_dtype(dtype)
}

/// Converts the complete saev dataset `src` (a directory or an `s3://` URL) to `dtype`,
/// writing it under `dst_root` (a directory or an `s3://` prefix) as `dst_root/<name>`, and
/// returns that path. Crash-safe and resumable: run again after a kill, it continues from
/// the first shard not yet durable; on a complete destination it writes nothing. A
/// destination holding anything else is refused, never overwritten. See the module
/// documentation for what each direction does and what is refused.
pub fn convert(
    src: impl AsRef<Path>,
    dst_root: impl AsRef<Path>,
    dtype: Dtype,
    mut opts: ConvertOptions,
) -> Result<PathBuf> {
    let src = src.as_ref();
    let ds = Dataset::open(src)?;
    let md = converted_metadata(ds.metadata(), dtype, ds.path())?;
    let layout = *ds.layout();
    let dst_layout = Layout::new(&md, Path::new("metadata.json"))?;
    let mut w = Writer::create(
        dst_root.as_ref(),
        md,
        WriterOptions {
            resume: true,
            max_rel_error: opts.max_rel_error,
        },
    )?;
    let n = layout.n_examples;
    let start = w.start();
    if let WriteStart::Resumed { from } = start {
        check_resumed(&ds, &w.path(), &dst_layout, from)?;
    }
    let mut report = |done: u64| match &mut opts.progress {
        Some(f) => f(&ConvertProgress {
            start,
            examples_done: done,
            examples: n,
            source_example_bytes: layout.example_bytes(),
        }),
        None => ControlFlow::Continue(()),
    };
    let first = w.next_example();
    if report(first).is_break() && first < n {
        return Err(stopped(&w.path(), first, n));
    }
    if start == WriteStart::AlreadyComplete {
        return w.finish();
    }
    let ev = layout.example_values() as usize;
    let per_run = (opts.chunk_bytes / (ev * 4).max(1)).max(1) as u64;
    let p = layout.content_tokens as usize;
    let labels = ds.has_labels();

    std::thread::scope(|scope| -> Result<PathBuf> {
        // Runs of examples read ahead: one being read, one queued. Buffers come back to the
        // reader once written, so no run allocates after the first three (read, queued,
        // being written).
        let (tx, rx) = mpsc::sync_channel::<Result<Run>>(1);
        let (back_tx, back_rx) = mpsc::channel::<Run>();
        let ds = &ds;
        scope.spawn(move || {
            let mut e = first;
            while e < n {
                let k = per_run.min(n - e);
                let mut run = back_rx.try_recv().unwrap_or_default();
                run.acts.resize(k as usize * ev, 0.0);
                run.labels
                    .resize(if labels { k as usize * p } else { 0 }, 0);
                run.first = e;
                let read = ds
                    .read_examples_into(e, &mut run.acts)
                    .and_then(|()| ds.read_labels_run(e, &mut run.labels).map(|_| ()));
                let failed = read.is_err();
                // A closed channel: the writer side stopped (an error, or the caller's Break).
                if tx.send(read.map(|()| run)).is_err() || failed {
                    return;
                }
                e += k;
            }
        });
        let mut done = first;
        for run in rx {
            let run = run?;
            debug_assert_eq!(run.first, done);
            w.write(&run.acts, labels.then_some(&run.labels[..]))?;
            done += (run.acts.len() / ev.max(1)) as u64;
            let _ = back_tx.send(run);
            if report(done).is_break() && done < n {
                return Err(stopped(&w.path(), done, n));
            }
        }
        if done < n {
            return Err(Error::Internal(format!(
                "conversion reader ended at example {done} of {n} without an error"
            )));
        }
        w.finish()
    })
}

/// On a resumed conversion, checks that the destination's last kept example is the source's
/// example converted. The destination's name hashes the metadata only, so an interrupted
/// conversion of other data with the same metadata (activations recorded again with the same
/// configuration) would otherwise be continued into a mix of the two. A kept shard only
/// staged for a store (not uploaded yet) is not checked.
fn check_resumed(ds: &Dataset, dst: &Path, layout: &Layout, from: u64) -> Result<()> {
    let Some(e) = from.checked_sub(1) else {
        return Ok(());
    };
    let mut acts = vec![0f32; layout.example_values() as usize];
    ds.read_examples_into(e, &mut acts)?;
    let want = precision::encoded(layout.dtype, &acts);
    let name = format!("acts{:06}.bin", e / layout.examples_per_shard);
    let range = ReadRange {
        file: 0,
        offset: (e % layout.examples_per_shard) * want.len() as u64,
        len: want.len() as u64,
        dst: 0,
    };
    let source = io::open_uncached(&Location::parse(dst)?)?;
    if !source.is_local() && source.len(&name).is_err() {
        return Ok(()); // staged, not in the store yet
    }
    let mut got = vec![0u8; want.len()];
    source.read_into(&[name], &[range], &mut got, &io::Stop::never())?;
    if got != want {
        return Err(Error::Exists {
            path: dst.to_path_buf(),
            why: format!(
                "holds an interrupted write of a dataset with the same metadata whose example {e} \
                 is not {}'s converted: other data (the name hashes the metadata only); refusing \
                 to continue it. Delete it, or convert into another root",
                ds.path().display()
            ),
        });
    }
    Ok(())
}

/// One run of whole examples read from the source.
#[derive(Default)]
struct Run {
    first: u64,
    acts: Vec<f32>,
    labels: Vec<u8>,
}

/// The error of a conversion its caller stopped at example `done` of `n`.
fn stopped(dst: &Path, done: u64, n: u64) -> Error {
    Error::Interrupted {
        path: dst.to_path_buf(),
        detail: format!(
            "conversion stopped at example {done} of {n}; run the same conversion again to \
             continue from the first shard not yet written"
        ),
    }
}
