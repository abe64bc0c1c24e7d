//! [`Prefetched`]: the store beneath a bulk read's zarrs array. It holds the byte ranges that
//! [`Column::fetch`](super::Column::fetch) fetched (whole objects, spans, shard-index suffixes)
//! and serves zarrs' decoding from memory; anything else is read from the store beneath. Runs
//! of ranges that follow one another are fetched as one read.

use std::sync::Arc;

use zarrs::storage::{ReadableStorageTraits, StoreKey};

use super::Storage;

/// `ranges` with each run of ranges that follow one another (a shard's inner chunks, written
/// in turn) joined into one, which [`Prefetched::lookup`] slices: a local shard is read in one
/// call instead of one per inner chunk (16 Mi tokens of a shuffle buffer were 8,192 reads and
/// as many allocations). An object store's requests are coalesced the same either way.
pub(super) fn joined(
    ranges: Vec<zarrs::storage::byte_range::ByteRange>,
) -> Vec<zarrs::storage::byte_range::ByteRange> {
    use zarrs::storage::byte_range::ByteRange;
    let mut out: Vec<ByteRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        if let (Some(ByteRange::FromStart(at, Some(len))), ByteRange::FromStart(o, Some(n))) =
            (out.last_mut(), r)
        {
            if at.checked_add(*len) == Some(o) {
                *len += n;
                continue;
            }
        }
        out.push(r);
    }
    out
}

/// Byte ranges of a store's objects fetched ahead and served from memory; anything else is
/// read from the store beneath.
pub(super) struct Prefetched {
    inner: Arc<Storage>,
    /// Once set, fetches from a store give up, their requests cut (a buffer read ahead for an
    /// iterator that was closed).
    stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Fetched bytes by key and first byte; a whole object sits at 0 and is in `whole`.
    spans: std::sync::RwLock<
        std::collections::HashMap<String, std::collections::BTreeMap<u64, bytes::Bytes>>,
    >,
    whole: std::sync::RwLock<std::collections::HashSet<String>>,
    /// Fetched ends of objects (shard indexes), by key.
    suffixes: std::sync::RwLock<std::collections::HashMap<String, bytes::Bytes>>,
}

impl Prefetched {
    pub(super) fn new(
        inner: Arc<Storage>,
        stop: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Prefetched {
        Prefetched {
            inner,
            stop,
            spans: Default::default(),
            whole: Default::default(),
            suffixes: Default::default(),
        }
    }

    /// Fetches `ranges` of `key` in one request list and keeps them; false if there is no
    /// such object (left to the read, which gives the fill value or the error).
    pub(super) fn fetch(
        &self,
        key: &StoreKey,
        ranges: Vec<zarrs::storage::byte_range::ByteRange>,
    ) -> std::result::Result<bool, zarrs::storage::StorageError> {
        use zarrs::storage::byte_range::ByteRange;
        if ranges.is_empty() {
            return Ok(true);
        }
        let ranges = joined(ranges);
        let starts: Vec<(u64, bool)> = ranges
            .iter()
            .map(|r| match *r {
                ByteRange::FromStart(o, len) => (o, len.is_none() && o == 0),
                ByteRange::Suffix(_) => (u64::MAX, false),
            })
            .collect();
        let stop = self
            .stop
            .clone()
            .map_or_else(crate::io::Stop::never, crate::io::Stop::new);
        let parts = crate::io::zarr_reads_stopped_by(&stop, || {
            self.inner
                .get_partial_many(key, Box::new(ranges.into_iter()))
        })?;
        let Some(parts) = parts else {
            return Ok(false);
        };
        let mut got = std::collections::BTreeMap::new();
        let mut whole = false;
        let name = key.as_str().to_string();
        for (part, (at, all)) in parts.zip(starts) {
            let part = part?;
            if at != u64::MAX {
                whole |= all;
                got.insert(at, part);
            } else {
                self.keep_suffix(&name, part);
            }
        }
        if whole {
            self.whole
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.clone());
        }
        self.keep_spans(name, got);
        Ok(true)
    }

    /// Holds `bytes`, range `range` of `key` fetched earlier, as if [`Prefetched::fetch`] had
    /// fetched them (`range` has a known length).
    pub(super) fn keep(
        &self,
        key: &str,
        range: zarrs::storage::byte_range::ByteRange,
        bytes: bytes::Bytes,
    ) {
        use zarrs::storage::byte_range::ByteRange;
        match range {
            ByteRange::Suffix(_) => self.keep_suffix(key, bytes),
            ByteRange::FromStart(at, Some(_)) => {
                self.keep_spans(key.to_string(), std::iter::once((at, bytes)).collect())
            }
            ByteRange::FromStart(_, None) => {}
        }
    }

    fn keep_suffix(&self, key: &str, bytes: bytes::Bytes) {
        self.suffixes
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string(), bytes);
    }

    fn keep_spans(&self, key: String, spans: std::collections::BTreeMap<u64, bytes::Bytes>) {
        self.spans
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_default()
            .extend(spans);
    }

    /// `range` of `key` if it was fetched.
    pub(super) fn lookup(
        &self,
        key: &str,
        range: zarrs::storage::byte_range::ByteRange,
    ) -> Option<bytes::Bytes> {
        use zarrs::storage::byte_range::ByteRange;
        if let ByteRange::Suffix(n) = range {
            let suffixes = self.suffixes.read().unwrap_or_else(|e| e.into_inner());
            if let Some(b) = suffixes.get(key) {
                let n = usize::try_from(n).ok()?;
                if n <= b.len() {
                    return Some(b.slice(b.len() - n..));
                }
            }
        }
        let spans = self.spans.read().unwrap_or_else(|e| e.into_inner());
        let spans = spans.get(key)?;
        let whole = || {
            self.whole
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains(key)
                .then(|| spans.get(&0).cloned())
                .flatten()
        };
        match range {
            ByteRange::FromStart(o, Some(len)) => {
                let (&at, b) = spans.range(..=o).next_back()?;
                let from = usize::try_from(o - at).ok()?;
                let to = from.checked_add(usize::try_from(len).ok()?)?;
                (to <= b.len()).then(|| b.slice(from..to))
            }
            ByteRange::FromStart(o, None) => {
                let b = whole()?;
                let from = usize::try_from(o).ok()?;
                (from <= b.len()).then(|| b.slice(from..))
            }
            ByteRange::Suffix(n) => {
                let b = whole()?;
                let n = usize::try_from(n).ok()?;
                (n <= b.len()).then(|| b.slice(b.len() - n..))
            }
        }
    }
}

impl ReadableStorageTraits for Prefetched {
    fn get_partial_many<'a>(
        &'a self,
        key: &StoreKey,
        byte_ranges: zarrs::storage::byte_range::ByteRangeIterator<'a>,
    ) -> std::result::Result<zarrs::storage::MaybeBytesIterator<'a>, zarrs::storage::StorageError>
    {
        let ranges: Vec<_> = byte_ranges.collect();
        let hits: Option<Vec<bytes::Bytes>> = ranges
            .iter()
            .map(|&r| self.lookup(key.as_str(), r))
            .collect();
        match hits {
            Some(hits) => Ok(Some(Box::new(hits.into_iter().map(Ok)))),
            None => self
                .inner
                .get_partial_many(key, Box::new(ranges.into_iter())),
        }
    }

    fn size_key(
        &self,
        key: &StoreKey,
    ) -> std::result::Result<Option<u64>, zarrs::storage::StorageError> {
        self.inner.size_key(key)
    }

    fn supports_get_partial(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ranges_that_follow_one_another_are_joined() {
        use zarrs::storage::byte_range::ByteRange::{FromStart, Suffix};
        let got = joined(vec![
            FromStart(10, Some(5)),
            FromStart(15, Some(0)),
            FromStart(15, Some(7)),
            FromStart(23, Some(4)), // a byte apart
            FromStart(27, Some(3)),
            Suffix(8),
            FromStart(30, Some(2)), // after the suffix: not joined across it
            FromStart(32, None),    // to the end of the object: left alone
            FromStart(0, Some(10)), // before the previous range
        ]);
        assert_eq!(
            got,
            vec![
                FromStart(10, Some(12)),
                FromStart(23, Some(7)),
                Suffix(8),
                FromStart(30, Some(2)),
                FromStart(32, None),
                FromStart(0, Some(10)),
            ]
        );
    }
}
