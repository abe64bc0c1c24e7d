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

mod bundle;
mod edit;
pub(crate) mod graph;
pub(crate) mod header;
pub(crate) mod manifest;
mod native;
pub(crate) mod read;
pub(crate) mod sdz;
pub(crate) mod sidecar;
mod types;
mod write;

pub use edit::{set_metadata, EditOutcome};
pub use read::{open, Container, Kind, PartLayout, Storage, Tensor, Variable};
pub use types::{DType, Order, VarType};
pub use write::{convert, save, Format, SaveOptions, TensorIn};

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
            if let Some(m) = c.bundle_manifest() {
                v.note(
                    m,
                    format!("bundle manifest: modelPath is {}", c.path().display()),
                );
            }
            for (file, msg) in native::notes(&c) {
                v.note(file, msg);
            }
            if deep {
                crate::checksum::verify_into(c.path(), &mut v);
            }
        }
    }
    v
}

/// Decodes a manifest (`bytes`: the raw Java serialization, or a whole SDNB file, whose
/// manifest is read) and encodes its entries again, for interop checks: each entry's (name,
/// absolute offset, length), shardkit's encoding of them, and whether that is the manifest's
/// bytes exactly. `path` names the input in errors.
#[allow(clippy::type_complexity)] // three plain values; a named type would exist only for this
pub fn manifest_round_trip(
    bytes: &[u8],
    path: &std::path::Path,
) -> crate::Result<(Vec<(String, u64, u64)>, Vec<u8>, bool)> {
    let raw = if bytes.starts_with(&header::MAGIC) {
        let h = header::Header::parse(bytes, bytes.len() as u64, path)?;
        &bytes[h.manifest_offset as usize..(h.manifest_offset + h.manifest_len) as usize]
    } else {
        bytes
    };
    let entries = manifest::decode(raw, path, usize::MAX)?;
    let again = manifest::encode(&entries);
    let same = again == raw;
    let entries = entries
        .into_iter()
        .map(|e| (e.name, e.offset, e.length))
        .collect();
    Ok((entries, again, same))
}

#[cfg(test)]
mod tests;
