//! The zarrs storage adapter: a prefix read by zarrs through coalesced ranged reads.

use std::collections::HashMap;
use std::sync::Arc;

use super::local::ReadRange;
use super::runtime::thread_stop;
use super::source::Source;
use crate::error::Result;

impl dyn Source {
    /// The source as a zarr store for zarrs' readers: every partial read is one coalesced
    /// batch of ranged reads ([`Source::read_into`], stopped by the stop in force on the
    /// reading thread: zarrs's interface carries none), with object sizes taken from one
    /// listing made here (no HEAD request per read).
    pub(crate) fn zarr_store(
        self: Arc<Self>,
    ) -> Result<Arc<dyn zarrs::storage::ReadableStorageTraits>> {
        let sizes = self.list()?.into_iter().collect();
        Ok(Arc::new(ZarrSource {
            source: self,
            sizes,
        }))
    }

    /// The location as a URL or path, in words.
    pub(crate) fn url(&self) -> String {
        self.location().to_string()
    }
}

/// A source read by zarrs (see `zarr_store`). The dataset is complete when it is opened for
/// reading, so the listing made then is the set of its objects.
struct ZarrSource {
    source: Arc<dyn Source>,
    sizes: HashMap<String, u64>,
}

impl zarrs::storage::ReadableStorageTraits for ZarrSource {
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
                    self.source.path_of(name).display(),
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
        self.source
            .read_into(&[name.to_string()], &ranges, &mut buf, &thread_stop())
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
