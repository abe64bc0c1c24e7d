//! The zarrs storage adapter: a prefix read by zarrs through coalesced ranged reads.

use std::collections::HashMap;
use std::sync::Arc;

use super::local::ReadRange;
use super::Remote;
use crate::error::Result;

impl Remote {
    /// The prefix as a zarr store for zarrs' readers: every partial read is one coalesced
    /// batch of ranged GETs ([`Remote::read_ranges`]), with object sizes taken from one listing
    /// made here (no HEAD request per read).
    #[cfg(feature = "zarr")]
    pub(crate) fn zarr_store(&self) -> Result<Arc<dyn zarrs::storage::ReadableStorageTraits>> {
        let sizes = self.list()?.into_iter().collect();
        Ok(Arc::new(ZarrRemote {
            remote: self.clone(),
            sizes,
        }))
    }
}

/// A prefix read by zarrs (see [`Remote::zarr_store`]). The dataset is complete when it is
/// opened for reading, so the listing made then is the set of its objects.
#[cfg(feature = "zarr")]
struct ZarrRemote {
    remote: Remote,
    sizes: HashMap<String, u64>,
}

#[cfg(feature = "zarr")]
impl zarrs::storage::ReadableStorageTraits for ZarrRemote {
    fn get_partial_many<'a>(
        &'a self,
        key: &zarrs::storage::StoreKey,
        byte_ranges: zarrs::storage::byte_range::ByteRangeIterator<'a>,
    ) -> std::result::Result<zarrs::storage::MaybeBytesIterator<'a>, zarrs::storage::StorageError>
    {
        use zarrs::storage::StorageError;
        let name = key.as_str();
        let Some(&size) = self.sizes.get(name) else {
            return Ok(None);
        };
        let mut ranges = Vec::new();
        let mut at = 0u64;
        for r in byte_ranges {
            let range = r.to_range(size);
            if range.start > range.end || range.end > size {
                return Err(StorageError::Other(format!(
                    "{}: bytes {} up to {} asked of a {size}-byte object, past its end",
                    self.remote.url_of(name).display(),
                    range.start,
                    range.end
                )));
            }
            let len = range.end - range.start;
            ranges.push(ReadRange {
                file: 0,
                offset: range.start,
                len,
                dst: at,
            });
            at += len;
        }
        let mut buf = vec![0u8; at as usize];
        self.remote
            .read_into(&[name.to_string()], &ranges, &mut buf)
            .map_err(|e| StorageError::Other(e.to_string()))?;
        let buf = bytes::Bytes::from(buf);
        let parts: Vec<_> = ranges
            .iter()
            .map(|r| Ok(buf.slice(r.dst as usize..(r.dst + r.len) as usize)))
            .collect();
        Ok(Some(Box::new(parts.into_iter())))
    }

    fn size_key(
        &self,
        key: &zarrs::storage::StoreKey,
    ) -> std::result::Result<Option<u64>, zarrs::storage::StorageError> {
        Ok(self.sizes.get(key.as_str()).copied())
    }

    fn supports_get_partial(&self) -> bool {
        true
    }
}
