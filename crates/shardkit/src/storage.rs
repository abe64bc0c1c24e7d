//! Whole-dataset transfers between a local directory and a store, and writes staged locally
//! and uploaded under a journal. Where bytes live, and every read, is [`crate::io`]; its names
//! are re-exported here for the callers that used them from this module.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use object_store::ObjectStoreExt;

use crate::checksum::{FileSums, Journal};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
pub(crate) use crate::io::local::ReadRange;
pub(crate) use crate::io::reads_stopped_by;
pub(crate) use crate::io::runtime::block_on;
pub(crate) use crate::io::store::PART_SIZE;
pub use crate::io::{
    cache_dir, cache_dir_or, cache_usage, clear_cache, counters, inflight, is_remote, local_path,
    max_request, set_inflight, set_max_request_mib, wait_for_cache, CacheUsage, CachedObject,
    Counters, Remote, COALESCE_GAP,
};
use crate::json::Value;
pub(crate) use crate::store_lock::StoreLock;

mod staged;
mod transfer;
pub use staged::*;
pub use transfer::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_windows_split_large_objects_and_share_small_ones() {
        let objects: Vec<(String, u64)> = [("a", 25), ("empty", 0), ("b", 3), ("c", 10)]
            .iter()
            .map(|(n, s)| (n.to_string(), *s))
            .collect();
        let spans = |w: &Vec<ReadRange>| -> Vec<(u32, u64, u64, u64)> {
            w.iter().map(|r| (r.file, r.offset, r.len, r.dst)).collect()
        };
        let windows: Vec<_> = windows_of(&objects, 10).iter().map(spans).collect();
        assert_eq!(
            windows,
            [
                vec![(0, 0, 10, 0)],
                vec![(0, 10, 10, 0)],
                vec![(0, 20, 5, 0), (1, 0, 0, 5), (2, 0, 3, 5), (3, 0, 2, 8)],
                vec![(3, 2, 8, 0)],
            ]
        );
        // Every byte of every object once, in order.
        let total: u64 = windows.iter().flatten().map(|p| p.2).sum();
        assert_eq!(total, 38);
        assert!(windows_of(&[], 10).is_empty());
        assert_eq!(windows_of(&objects[1..2], 10).len(), 1);
    }

    #[test]
    fn commit_records_sort_last_and_private_files_are_skipped() {
        let mut files = vec![
            ("shards.json".to_string(), 1),
            ("acts000000.bin".to_string(), 1),
            ("metadata.json".to_string(), 1),
            ("zarr.json".to_string(), 1),
            ("a/zarr.json".to_string(), 1),
        ];
        sort_commit_last(&mut files);
        let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "metadata.json",
                "acts000000.bin",
                "a/zarr.json",
                "zarr.json",
                "shards.json"
            ]
        );
        assert!(is_private(".shardkit-writing"));
        assert!(is_private("x/.labels.bin.tmp"));
        assert!(!is_private("labels.bin"));
    }

    #[test]
    fn a_staging_directory_is_listed_while_upload_threads_remove_what_they_sent() {
        // A flat-tokens commit lists its staging directory for the metadata documents while
        // the upload threads remove chunks they have sent: a chunk listed by readdir and gone
        // before its stat is left out. A strict walk fails here with NotFound in nearly every
        // run, as a commit once did in CI.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("train/encoded_tokens/c")).unwrap();
        std::fs::write(root.join("zarr.json"), b"{}").unwrap();
        std::fs::write(root.join("train/encoded_tokens/zarr.json"), b"{}").unwrap();
        let chunks: Vec<PathBuf> = (0..1000)
            .map(|i| root.join(format!("train/encoded_tokens/c/{i}")))
            .collect();
        for c in &chunks {
            std::fs::write(c, [7u8; 3]).unwrap();
        }
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for c in &chunks {
                    std::fs::remove_file(c).unwrap();
                }
                done.store(true, Ordering::SeqCst);
            });
            let mut walks = 0;
            while !done.load(Ordering::SeqCst) || walks == 0 {
                let files = staged_files(root).unwrap();
                let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
                assert_eq!(
                    names[names.len() - 2..],
                    ["train/encoded_tokens/zarr.json", "zarr.json"]
                );
                assert!(files
                    .iter()
                    .all(|(n, len)| *len == if n.ends_with(".json") { 2 } else { 3 }));
                walks += 1;
            }
        });
        assert_eq!(staged_files(root).unwrap().len(), 2);
        // The directory itself must be there: a missing one is an error, not an empty listing.
        let missing = staged_files(&root.join("missing")).unwrap_err();
        assert!(matches!(&missing, Error::NotFound { .. }), "{missing:?}");
    }
}
