//! NumPy `.npy` files: reading (memory-mapped, any size) and writing headers; `.npz` output.
//!
//! A `.npy` file is the magic `\x93NUMPY`, a version (1.0, 2.0 or 3.0), a little-endian header
//! length (u16 for 1.0, u32 otherwise), and a Python dict literal
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (n, d), }` padded with spaces to a
//! multiple of 64 bytes and ended by `\n`; the C-order data follows.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use shardkit::{fsutil, Error, Result};

/// The element types the CLI reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// `<f4`
    F32,
    /// `|u1`
    U8,
    /// `<i8`
    I64,
    /// `<i4`
    I32,
    /// `|b1`
    Bool,
    /// `<f2` (IEEE float16: a float16 saev dataset exported as stored)
    F16,
    /// `<u2` (the bits of bfloat16 values, which numpy has no type for)
    U16,
}

impl Dtype {
    fn descr(self) -> &'static str {
        match self {
            Dtype::F32 => "<f4",
            Dtype::U8 => "|u1",
            Dtype::I64 => "<i8",
            Dtype::I32 => "<i4",
            Dtype::Bool => "|b1",
            Dtype::F16 => "<f2",
            Dtype::U16 => "<u2",
        }
    }
}

/// A memory-mapped `.npy` array.
#[derive(Debug)]
pub struct NpyArray {
    map: Mmap,
    offset: usize,
    /// The array's shape.
    pub shape: Vec<u64>,
    /// The element type.
    pub dtype: Dtype,
}

/// A memory-mapped `.npy` file of any fixed-width dtype and either order, not interpreted.
#[derive(Debug)]
pub struct RawNpy {
    map: Mmap,
    offset: usize,
    /// The array's shape.
    pub shape: Vec<u64>,
    /// numpy's dtype string as written ('<f4', '|b1', ...), without quotes.
    pub descr: String,
    /// Whether the data is in column-major order.
    pub fortran: bool,
}

impl RawNpy {
    /// Maps `path`, checking the header and that the file holds exactly the data its shape and
    /// the dtype's width (the digits ending `descr`) call for.
    pub fn open(path: &Path) -> Result<RawNpy> {
        let bad = |rule: String| Error::format(path, rule);
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; a concurrent truncation by another process would be a
        // user error that at worst raises SIGBUS, as with numpy's own memmap.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        if map.len() < 10 || &map[..6] != b"\x93NUMPY" {
            return Err(bad("not a .npy file (missing the \\x93NUMPY magic)".into()));
        }
        let (hlen, start) = match map[6] {
            1 => (u16::from_le_bytes([map[8], map[9]]) as usize, 10),
            2 | 3 if map.len() >= 12 => (
                u32::from_le_bytes([map[8], map[9], map[10], map[11]]) as usize,
                12,
            ),
            v => return Err(bad(format!("unsupported .npy version {v}"))),
        };
        let header = map
            .get(start..start + hlen)
            .ok_or_else(|| bad("header runs past the end of the file".into()))?;
        let header = std::str::from_utf8(header).map_err(|_| bad("header is not text".into()))?;
        let descr = dict_value(header, "descr")
            .ok_or_else(|| bad("header has no 'descr'".into()))?
            .trim()
            .trim_matches(['\'', '"'])
            .to_string();
        let width: u64 = descr
            .trim_start_matches(['<', '>', '|', '='])
            .get(1..)
            .and_then(|w| w.parse().ok())
            .filter(|&w| w > 0)
            .ok_or_else(|| bad(format!("dtype {descr} has no fixed element width")))?;
        if descr.starts_with('>') && width > 1 {
            return Err(bad(format!("big-endian dtype {descr} is not supported")));
        }
        let fortran = match dict_value(header, "fortran_order").map(str::trim) {
            Some("False") => false,
            Some("True") => true,
            _ => return Err(bad("header has no 'fortran_order'".into())),
        };
        let shape_text =
            dict_value(header, "shape").ok_or_else(|| bad("header has no 'shape'".into()))?;
        let inner = shape_text
            .trim()
            .strip_prefix('(')
            .and_then(|s| s.strip_suffix(')'))
            .ok_or_else(|| bad(format!("cannot read shape {shape_text}")))?;
        let shape = inner
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('L').parse::<u64>())
            .collect::<std::result::Result<Vec<u64>, _>>()
            .map_err(|_| bad(format!("cannot read shape {shape_text}")))?;
        let offset = start + hlen;
        let count = shape
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .and_then(|c| c.checked_mul(width))
            .ok_or_else(|| bad("shape overflows".into()))?;
        let data = map.len().saturating_sub(offset) as u64;
        if data < count {
            return Err(bad(format!(
                "truncated: {} of {} bytes (shape {shape:?} of {descr} needs {count} data bytes \
                 after the {offset}-byte header); the file was cut short (an interrupted copy \
                 or write): save it again",
                map.len(),
                (offset as u64).saturating_add(count)
            )));
        }
        if data != count || offset > map.len() {
            return Err(bad(format!(
                "holds {} data bytes, but shape {shape:?} of {descr} needs {count}",
                map.len().saturating_sub(offset),
            )));
        }
        Ok(RawNpy {
            map,
            offset,
            shape,
            descr,
            fortran,
        })
    }

    /// The map and the data's byte range in it.
    pub fn into_parts(self) -> (Mmap, std::ops::Range<usize>) {
        let end = self.map.len();
        (self.map, self.offset..end)
    }
}

impl NpyArray {
    /// Maps `path`, checking the header, C order, and that the file holds all the data.
    pub fn open(path: &Path) -> Result<NpyArray> {
        let bad = |rule: String| Error::format(path, rule);
        let raw = RawNpy::open(path)?;
        let dtype = match raw.descr.as_str() {
            "<f4" | "=f4" => Dtype::F32,
            "|u1" | "<u1" | "=u1" | "u1" => Dtype::U8,
            "<i8" | "=i8" => Dtype::I64,
            other => {
                return Err(bad(format!(
                "dtype {other} is not supported here (float32 '<f4', uint8 '|u1' or int64 '<i8')"
            )))
            }
        };
        if raw.fortran {
            return Err(bad(
                "Fortran-order arrays are not supported; save it in C order".into(),
            ));
        }
        Ok(NpyArray {
            map: raw.map,
            offset: raw.offset,
            shape: raw.shape,
            dtype,
        })
    }

    /// The raw data bytes (little-endian).
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.offset..]
    }
}

/// The text of `key`'s value in a Python dict literal (up to the next top-level comma).
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let mut depth = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' | '}' if depth == 0 => return Some(&rest[..i]),
            _ => {}
        }
    }
    None
}

/// The header of a C-order `.npy` file of `dtype` and `shape` (version 1.0, 64-byte aligned).
pub fn header(dtype: Dtype, shape: &[u64]) -> Vec<u8> {
    header_with(dtype.descr(), false, shape)
}

/// The header of a `.npy` file of numpy dtype `descr`, in either order.
pub fn header_with(descr: &str, fortran: bool, shape: &[u64]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    let shape = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let order = if fortran { "True" } else { "False" };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': {shape}, }}");
    // numpy pads so that magic + version + length + dict + '\n' is a multiple of 64.
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Writes an `.npy` file atomically.
pub fn write_npy(path: &Path, dtype: Dtype, shape: &[u64], data: &[u8]) -> Result<()> {
    let mut bytes = header(dtype, shape);
    bytes.extend_from_slice(data);
    fsutil::atomic_write(path, &bytes)
}

/// Streams arrays into an `.npz` (a STORED zip of `.npy` members) that appears under its final
/// name only when complete.
pub struct NpzWriter {
    zip: Option<zip::ZipWriter<BufWriter<File>>>,
    tmp: PathBuf,
    path: PathBuf,
}

impl NpzWriter {
    /// Starts `path` (written to a temporary sibling until [`NpzWriter::finish`]).
    pub fn create(path: &Path) -> Result<NpzWriter> {
        let tmp = fsutil::temp_sibling(path);
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(NpzWriter {
            zip: Some(zip::ZipWriter::new(BufWriter::with_capacity(1 << 20, f))),
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// Starts member `name.npy`; write its data with [`Write`] on the returned writer.
    pub fn start(&mut self, name: &str, dtype: Dtype, shape: &[u64]) -> Result<&mut impl Write> {
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .large_file(true);
        let zip = self.zip.as_mut().expect("only finish() takes the zip");
        zip.start_file(format!("{name}.npy"), opts)
            .map_err(|e| Error::format(&self.tmp, e.to_string()))?;
        zip.write_all(&header(dtype, shape))
            .map_err(|e| Error::io(&self.tmp, e))?;
        Ok(zip)
    }

    /// The temporary path, for error messages.
    pub fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Completes the archive, fsyncs it and renames it into place.
    pub fn finish(mut self) -> Result<()> {
        let zip = self.zip.take().expect("finish() is called once");
        let w = zip
            .finish()
            .map_err(|e| Error::format(&self.tmp, e.to_string()))?;
        let f = w
            .into_inner()
            .map_err(|e| Error::io(&self.tmp, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        fsutil::publish(&self.tmp, &self.path)
    }
}

impl Drop for NpzWriter {
    fn drop(&mut self) {
        // After a successful finish the temporary no longer exists; otherwise remove it.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_is_aligned() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let data: Vec<u8> = (0..24u8).collect();
        write_npy(&p, Dtype::F32, &[2, 3], &data).unwrap();
        let a = NpyArray::open(&p).unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(a.dtype, Dtype::F32);
        assert_eq!(a.bytes(), &data[..]);
        assert_eq!(header(Dtype::U8, &[5]).len() % 64, 0);
        assert!(String::from_utf8_lossy(&header(Dtype::U8, &[5])).contains("(5,)"));
    }

    #[test]
    fn rejects_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        std::fs::write(&p, b"hello").unwrap();
        let err = NpyArray::open(&p).expect_err("not an .npy file");
        assert!(
            matches!(&err, Error::Format { path, .. } if path == &p),
            "{err:?}"
        );
        let mut bytes = header(Dtype::F32, &[4]);
        bytes.extend_from_slice(&[0; 8]); // 2 floats, 4 promised
        std::fs::write(&p, &bytes).unwrap();
        assert!(NpyArray::open(&p)
            .unwrap_err()
            .to_string()
            .contains("needs 16"));
    }

    #[test]
    fn a_truncated_file_says_truncated_x_of_y_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let mut bytes = header(Dtype::F32, &[4]);
        let h = bytes.len();
        bytes.extend_from_slice(&[0; 8]); // 2 floats of the 4 promised
        std::fs::write(&p, &bytes).unwrap();
        let e = NpyArray::open(&p).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e:?}");
        assert_eq!(e.path(), Some(p.as_path()));
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("truncated: {} of {} bytes", h + 8, h + 16))
                && msg.contains("save it again"),
            "{msg}"
        );
        // More data than the shape needs is no truncation.
        bytes.extend_from_slice(&[0; 12]);
        std::fs::write(&p, &bytes).unwrap();
        let msg = NpyArray::open(&p).unwrap_err().to_string();
        assert!(
            !msg.contains("truncated") && msg.contains("needs 16"),
            "{msg}"
        );
    }
}
