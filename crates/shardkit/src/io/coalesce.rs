//! Range coalescing: the ranges a read needs, merged into few large requests.

use super::local::ReadRange;

/// Ranges of one object at most this far apart are fetched by one request (the gap's bytes are
/// read and dropped: cheaper than another round trip).
pub(crate) const COALESCE_GAP: u64 = 1 << 20;

/// One ranged GET: `start..end` of object `file`, and the pieces of the caller's buffer it
/// fills.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    pub file: u32,
    pub start: u64,
    pub end: u64,
    pub pieces: Vec<ReadRange>,
}

/// Sorts `ranges` by object and offset and merges those less than `gap` bytes apart into
/// requests of at most `max` bytes (a single range longer than `max` is split).
pub(crate) fn coalesce(ranges: &[ReadRange], gap: u64, max: u64) -> Vec<Request> {
    let mut sorted: Vec<ReadRange> = Vec::with_capacity(ranges.len());
    for r in ranges.iter().filter(|r| r.len > 0) {
        let mut done = 0;
        while done < r.len {
            let n = (r.len - done).min(max);
            sorted.push(ReadRange {
                file: r.file,
                offset: r.offset + done,
                len: n,
                dst: r.dst + done,
            });
            done += n;
        }
    }
    sorted.sort_unstable_by_key(|r| (r.file, r.offset, r.len));
    let mut out: Vec<Request> = Vec::new();
    for r in sorted {
        let end = r.offset + r.len;
        if let Some(last) = out.last_mut() {
            if last.file == r.file
                && r.offset <= last.end.saturating_add(gap)
                && end.max(last.end) - last.start <= max
            {
                last.end = last.end.max(end);
                last.pieces.push(r);
                continue;
            }
        }
        out.push(Request {
            file: r.file,
            start: r.offset,
            end,
            pieces: vec![r],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: u32, offset: u64, len: u64, dst: u64) -> ReadRange {
        ReadRange {
            file,
            offset,
            len,
            dst,
        }
    }

    #[test]
    fn coalescing_merges_near_ranges_of_one_object_up_to_the_request_size() {
        let ranges = [
            r(0, 100, 10, 0),
            r(0, 0, 10, 10),
            r(1, 0, 10, 20),
            r(0, 5000, 10, 30),
            r(0, 120, 4000, 40),
        ];
        let reqs = coalesce(&ranges, 64, 1 << 20);
        let spans: Vec<(u32, u64, u64)> = reqs.iter().map(|q| (q.file, q.start, q.end)).collect();
        // 0..10 and 100..110 are 90 bytes apart (> 64): separate; 100..110 and 120..4120 merge.
        assert_eq!(
            spans,
            [(0, 0, 10), (0, 100, 4120), (0, 5000, 5010), (1, 0, 10)]
        );
        assert_eq!(reqs[1].pieces.len(), 2);
        // A range longer than the request size is split into pieces that fill the same bytes.
        let reqs = coalesce(&[r(3, 7, 25, 1)], 0, 10);
        let spans: Vec<(u64, u64, u64)> = reqs
            .iter()
            .map(|q| (q.start, q.end, q.pieces[0].dst))
            .collect();
        assert_eq!(spans, [(7, 17, 1), (17, 27, 11), (27, 32, 21)]);
    }
}
