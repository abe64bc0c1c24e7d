//! The 32-byte SDNB header (samediff.md §1.2): magic `SDNB`, version 1, and the manifest's
//! offset and length, all big-endian; the FlatBuffer always starts at 32.

use std::path::Path;

use crate::error::{Error, Result};

/// `SDNB`.
pub(crate) const MAGIC: [u8; 4] = *b"SDNB";
/// The only version written or read.
pub(crate) const VERSION: i32 = 1;
/// Bytes before the FlatBuffer.
pub(crate) const HEADER_LEN: u64 = 32;

/// A parsed, bounds-checked header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// Absolute offset of the manifest (M).
    pub manifest_offset: u64,
    /// Manifest length in bytes.
    pub manifest_len: u64,
}

impl Header {
    /// Checks the header of a `file_len`-byte file: magic, version 1, metadata offset 32, and
    /// 32 ≤ M ≤ M + manifest length ≤ file length.
    pub(crate) fn parse(bytes: &[u8], file_len: u64, path: &Path) -> Result<Header> {
        let bad = |rule: String| Error::format(path, rule);
        let cut = "the file was cut short (an interrupted copy or write): copy or write it again";
        if bytes.len() >= 4 && bytes[..4] != MAGIC {
            return Err(bad(format!(
                "not an SDNB file: starts {:02x?}, not \"SDNB\"",
                &bytes[..4]
            )));
        }
        if bytes.len() < HEADER_LEN as usize || file_len < HEADER_LEN {
            return Err(bad(format!(
                "truncated: {file_len} of at least 32 bytes (an SDNB file starts with a 32-byte \
                 header); {cut}"
            )));
        }
        if bytes[..4] != MAGIC {
            return Err(bad(format!(
                "not an SDNB file: starts {:02x?}, not \"SDNB\"",
                &bytes[..4]
            )));
        }
        let i32_at = |o: usize| i32::from_be_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let i64_at = |o: usize| i64::from_be_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let version = i32_at(4);
        if version != VERSION {
            return Err(bad(format!(
                "SDNB version {version}; only version 1 exists"
            )));
        }
        let (m, len, meta) = (i64_at(8), i64_at(16), i64_at(24));
        if meta != HEADER_LEN as i64 {
            return Err(bad(format!("metadata offset {meta}; it must be 32")));
        }
        let (Ok(m), Ok(len)) = (u64::try_from(m), u64::try_from(len)) else {
            return Err(bad(format!("negative manifest offset {m} or length {len}")));
        };
        if m < HEADER_LEN {
            return Err(bad(format!(
                "the manifest at byte {m} lies outside the file's contents, inside its 32-byte \
                 header: the header is damaged"
            )));
        }
        match m.checked_add(len) {
            None => {
                return Err(bad(format!(
                    "the manifest at byte {m}, {len} bytes long, lies outside the file (its end \
                     overflows): the header is damaged"
                )))
            }
            Some(end) if end > file_len => {
                return Err(bad(format!(
                    "truncated: {file_len} of {end} bytes: the header puts the {len}-byte \
                     manifest at byte {m}, which lies outside the file; {cut}, or its header is \
                     damaged"
                )))
            }
            Some(_) => {}
        }
        Ok(Header {
            manifest_offset: m,
            manifest_len: len,
        })
    }

    /// The 32 bytes.
    pub(crate) fn to_bytes(self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&VERSION.to_be_bytes());
        b[8..16].copy_from_slice(&(self.manifest_offset as i64).to_be_bytes());
        b[16..24].copy_from_slice(&(self.manifest_len as i64).to_be_bytes());
        b[24..32].copy_from_slice(&(HEADER_LEN as i64).to_be_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worked_layout_header() {
        // samediff.md §10.12: M = 5,309,508, manifest 359 bytes.
        let h = Header {
            manifest_offset: 5_309_508,
            manifest_len: 359,
        };
        let b = h.to_bytes();
        assert_eq!(
            b,
            [
                0x53, 0x44, 0x4e, 0x42, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0x51, 0x04, 0x44, 0, 0, 0, 0, 0,
                0, 0x01, 0x67, 0, 0, 0, 0, 0, 0, 0, 0x20
            ]
        );
        assert_eq!(Header::parse(&b, 5_309_867, Path::new("f")).unwrap(), h);
        for (file_len, words) in [(5_309_866, "outside"), (20, "32-byte")] {
            let e = Header::parse(&b, file_len, Path::new("f")).unwrap_err();
            assert!(e.to_string().contains(words), "{e}");
        }
        let mut v2 = b;
        v2[7] = 2;
        assert!(Header::parse(&v2, 5_309_867, Path::new("f"))
            .unwrap_err()
            .to_string()
            .contains("version 2"));
        let mut neg = b;
        neg[8] = 0x80;
        let err = Header::parse(&neg, 5_309_867, Path::new("f")).unwrap_err();
        assert!(
            matches!(&err, Error::Format { path, .. } if path == Path::new("f")),
            "{err:?}"
        );
    }
}
