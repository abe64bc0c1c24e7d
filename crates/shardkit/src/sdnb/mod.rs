//! SameDiff unified containers (Deeplearning4j ADR 0035, samediff.md): single SDNB files,
//! shard sets and SDZ archives.
//!
//! An SDNB file is a 32-byte big-endian header (`SDNB`, version 1, manifest offset M and
//! length), a FlatBuffers `FlatGraph` at byte 32 (variables, small arrays inline, ops,
//! metadata), raw little-endian blobs for arrays of 1 MiB and more, and at M a Java-serialized
//! `LinkedHashMap<String, Pair<Long, Long>>` locating each blob. A shard set splits one model
//! into `<base>.shard<i>-of-<N>.sdnb` (shard 0: graph and stubs; the rest: weights); an SDZ is
//! a ZIP holding either.
//!
//! [`open`] recognises all three, checks every offset once, and serves tensors from a memory
//! map; [`save`] and [`convert`] write them with 64-byte-aligned blobs and slack for in-place
//! [`set_metadata`] edits, still loadable by DL4J.
//!
//! # Example
//!
//! ```
//! use shardkit::sdnb::{self, DType, Order, SaveOptions, TensorIn, VarType};
//!
//! # fn main() -> shardkit::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("model.sdnb");
//! let bytes: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! let weight = TensorIn {
//!     name: "w".into(),
//!     var_type: VarType::Variable,
//!     dtype: DType::Float,
//!     shape: vec![2, 2],
//!     order: Order::C,
//!     bytes: &bytes,
//! };
//! sdnb::save(&path, &[weight], &SaveOptions::default())?;
//!
//! let model = sdnb::open(&path)?;
//! let w = model.tensor("w")?;
//! assert_eq!((w.dtype, w.shape), (DType::Float, &[2i64, 2][..]));
//! assert_eq!(w.bytes, &bytes[..]);
//! # Ok(())
//! # }
//! ```

mod edit;
// The container's parts, public for the robustness tests and the CLI only: what a user needs
// is re-exported below.
#[doc(hidden)]
pub mod graph;
#[doc(hidden)]
pub mod header;
#[doc(hidden)]
pub mod manifest;
pub(crate) mod read;
#[doc(hidden)]
pub mod sdz;
pub(crate) mod sidecar;
mod types;
mod write;

pub use edit::{set_metadata, EditOutcome};
pub use read::{open, Container, Kind, Limits, PartLayout, Storage, Tensor, Variable};
pub use sdz::ZipLimits;
pub use types::{DType, Order, VarType};
pub use write::{convert, save, Format, Progress, SaveOptions, TensorIn, DEFAULT_ALIGN};

// Shard-set naming, for the CLI.
#[doc(hidden)]
pub use read::open_source;
#[doc(hidden)]
pub use read::{base_name, shard_files};

/// Checks the container at `path` (a file, an archive, or a shard set's base name): that it
/// opens, which checks every structure, offset and manifest entry once; with `deep`, also every
/// byte against its checksums sidecar (`NAME.checksums.json`; a shard set's
/// `BASE.shard-set.checksums.json`).
pub fn validate(path: impl AsRef<std::path::Path>, deep: bool) -> crate::report::Validation {
    let path = &crate::io::local_path(path.as_ref());
    let mut v = crate::report::Validation::new(path);
    match open(path) {
        Err(e) => v.error_from(&e),
        Ok(c) => {
            let files = c.files();
            v.note(
                path,
                format!(
                    "opens: {} variable(s) in {} file(s)",
                    c.variables().len(),
                    files.len()
                ),
            );
            if deep {
                crate::checksum::verify_into(path, &mut v);
            }
        }
    }
    v
}

#[cfg(test)]
mod tests;
