//! Owned, page-aligned batch memory, recycled through a pool.
//!
//! Rows are copied into a [`Buffer`] once; it is then handed out as is (a `&[f32]` view for
//! activations, and to numpy without a copy). Fresh multi-megabyte allocations cost a page fault
//! and a zeroing per page, which at disk speed is a large share of the CPU on a small machine, so
//! buffers taken from a [`BufferPool`] go back to it when dropped and are reused.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use crate::error::{Error, Result};

/// Alignment of every buffer (a page; also what O_DIRECT needs).
pub(crate) const ALIGN: usize = 4096;

struct Raw {
    ptr: *mut u8,
    cap: usize,
    /// For memory owned by someone else (see [`BufferPool::external`]): what keeps it alive.
    /// Such memory is never freed here.
    keeper: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: a Raw exclusively owns its allocation.
unsafe impl Send for Raw {}

impl Raw {
    fn alloc(cap: usize) -> Raw {
        if cap == 0 {
            return Raw {
                ptr: std::ptr::null_mut(),
                cap: 0,
                keeper: None,
            };
        }
        let layout = Layout::from_size_align(cap, ALIGN).expect("buffer size fits in isize");
        // SAFETY: non-zero size, valid layout.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Raw {
            ptr,
            cap,
            keeper: None,
        }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if self.cap > 0 && self.keeper.is_none() {
            // SAFETY: allocated in `alloc` with this exact layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.cap, ALIGN)) };
        }
    }
}

/// The free buffers of a pool, and (external pools) a signal for waiters.
struct Free {
    list: Mutex<Vec<Raw>>,
    returned: Condvar,
}

/// A page-aligned byte buffer (initialised: zeroed when first allocated).
pub struct Buffer {
    raw: Option<Raw>,
    len: usize,
    pool: Weak<Free>,
    pool_max: usize,
    /// The process whose pool it returns to (see [`BufferPool`] on fork).
    pid: u32,
}

// SAFETY: the buffer exclusively owns its allocation.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A zeroed buffer of `len` bytes, not pooled.
    pub fn zeroed(len: usize) -> Buffer {
        Buffer {
            raw: Some(Raw::alloc(len)),
            len,
            pool: Weak::new(),
            pool_max: 0,
            pid: 0,
        }
    }
    fn raw(&self) -> &Raw {
        self.raw.as_ref().expect("present until drop")
    }
    /// The bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr is valid for cap >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.raw().ptr, self.len) }
    }
    /// The bytes, mutably.
    pub(crate) fn as_mut_bytes(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: ptr is valid for len bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.raw().ptr, self.len) }
    }
    /// The bytes as native float32 values (the length rounded down to whole values).
    pub fn as_f32(&self) -> &[f32] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ALIGN-aligned, every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(self.raw().ptr.cast::<f32>(), self.len / 4) }
    }
}

impl Buffer {
    /// The bytes as native float32 values, mutably (the length rounded down to whole values).
    pub(crate) fn as_mut_f32(&mut self) -> &mut [f32] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: ALIGN-aligned, uniquely borrowed, every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(self.raw().ptr.cast::<f32>(), self.len / 4) }
    }
}

/// The bytes: `&buf[..]`, `buf.len()`, `buf.as_ptr()` (for zero-copy hand-off to other
/// runtimes; the buffer is page-aligned).
impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl std::ops::DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_bytes()
    }
}

/// One array of a batch: where it lies in the batch's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// The array's name.
    pub name: &'static str,
    /// Its element type.
    pub dtype: safetensors::Dtype,
    /// Its shape, `[rows, ...]`.
    pub shape: Vec<usize>,
    /// Byte offset in the buffer (a multiple of 64).
    pub offset: usize,
}

impl Field {
    /// Bytes of the field.
    pub(crate) fn len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
    /// Its byte range in the buffer.
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// Lays `arrays` (name, dtype, shape) out one after another, each at a 64-byte boundary;
/// returns the fields and the bytes they need.
#[cfg_attr(not(feature = "zarr"), allow(dead_code))] // flat-tokens' loader only
pub(crate) fn lay_out(
    arrays: &[(&'static str, safetensors::Dtype, Vec<usize>)],
) -> (Vec<Field>, usize) {
    let mut at = 0usize;
    let fields = arrays
        .iter()
        .map(|(name, dtype, shape)| {
            let f = Field {
                name,
                dtype: *dtype,
                shape: shape.clone(),
                offset: at,
            };
            at = (at + f.len()).next_multiple_of(64);
            f
        })
        .collect();
    (fields, at)
}

impl Buffer {
    /// The bytes of `field` (empty if it lies outside the buffer).
    pub fn field(&self, field: &Field) -> &[u8] {
        self.as_bytes().get(field.range()).unwrap_or(&[])
    }
    /// The 4-byte values of `field` (u32, i32 or f32 bits), native endian.
    pub(crate) fn field_u32(&self, field: &Field) -> &[u32] {
        let bytes = self.field(field);
        // SAFETY: the buffer is page-aligned and fields start at multiples of 64, so `bytes`
        // is 4-byte aligned; any bit pattern is a valid u32; the length is rounded down.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u32>(), bytes.len() / 4) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let Some(raw) = self.raw.take() else { return };
        if self.pid != std::process::id() {
            return; // freed, not pooled: after fork() the pool's lock may be held for ever
        }
        if let Some(pool) = self.pool.upgrade() {
            let mut free = pool.list.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < self.pool_max || raw.keeper.is_some() {
                free.push(raw);
            }
            drop(free);
            pool.returned.notify_all();
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.len)
    }
}

/// Recycles buffers: [`BufferPool::get`] reuses a free allocation that is large enough, and a
/// dropped buffer returns to its pool (which keeps at most `max` free ones). Buffers that
/// outlive the pool are simply freed. In a forked child the pool is bypassed (fresh
/// allocations, freed on drop): its lock may have been held by a parent thread at fork().
///
/// An *external* pool ([`BufferPool::external`]) hands out memory its caller owns (pinned host
/// memory allocated through torch, say): it never allocates, and `BufferPool::get_or_wait`
/// waits for a buffer to come back when all are in use.
#[derive(Clone)]
pub struct BufferPool {
    free: Arc<Free>,
    max: usize,
    pid: u32,
    /// The capacities of an external pool's buffers (empty for an allocating pool).
    external: Arc<Vec<usize>>,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("max", &self.max)
            .field("external", &self.external.len())
            .finish()
    }
}

impl BufferPool {
    /// A pool keeping at most `max` free buffers.
    pub fn new(max: usize) -> BufferPool {
        BufferPool {
            free: Arc::new(Free {
                list: Mutex::new(Vec::new()),
                returned: Condvar::new(),
            }),
            max,
            pid: std::process::id(),
            external: Arc::new(Vec::new()),
        }
    }

    /// A pool over caller-owned memory: `(pointer, bytes)` regions, each page-aligned, kept
    /// alive by `keeper` (which every buffer of the pool holds, so the memory outlives them).
    ///
    /// # Safety
    /// Every region must be valid for reads and writes of its length for as long as `keeper`
    /// lives, not overlap another, and not be used by anything else meanwhile.
    pub unsafe fn external(
        regions: &[(*mut u8, usize)],
        keeper: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<BufferPool> {
        for &(ptr, len) in regions {
            if ptr.is_null() || !(ptr as usize).is_multiple_of(ALIGN) {
                return Err(Error::Invalid(format!(
                    "an external buffer must be {ALIGN}-byte aligned and not null ({ptr:p}, {len} bytes)"
                )));
            }
        }
        let pool = BufferPool::new(regions.len());
        let mut list = pool.free.list.lock().unwrap_or_else(|e| e.into_inner());
        list.extend(regions.iter().map(|&(ptr, cap)| Raw {
            ptr,
            cap,
            keeper: Some(keeper.clone()),
        }));
        drop(list);
        Ok(BufferPool {
            external: Arc::new(regions.iter().map(|r| r.1).collect()),
            ..pool
        })
    }

    /// Whether the pool hands out caller-owned memory.
    pub(crate) fn is_external(&self) -> bool {
        !self.external.is_empty()
    }

    /// A buffer of `len` bytes for a stream: from an allocating pool as [`BufferPool::get`];
    /// from an external pool, the first free buffer large enough, waiting while all are in use
    /// until one comes back or `stop` is set (then an error).
    pub(crate) fn get_or_wait(&self, len: usize, stop: &AtomicBool) -> Result<Buffer> {
        if !self.is_external() {
            return Ok(self.get(len));
        }
        if !self.external.iter().any(|&cap| cap >= len) {
            return Err(Error::Invalid(format!(
                "a batch of {len} bytes does not fit the largest external buffer ({} bytes)",
                self.external.iter().max().copied().unwrap_or(0)
            )));
        }
        let mut list = self.free.list.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(i) = list.iter().position(|r| r.cap >= len) {
                let raw = list.swap_remove(i);
                return Ok(Buffer {
                    raw: Some(raw),
                    len,
                    pool: Arc::downgrade(&self.free),
                    pool_max: self.max,
                    pid: std::process::id(),
                });
            }
            if stop.load(Ordering::Relaxed) {
                return Err(crate::io::stop::stopped_error());
            }
            list = self
                .free
                .returned
                .wait_timeout(list, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
    /// A buffer of `len` bytes; its content is unspecified (zeros or an earlier batch's bytes),
    /// so callers overwrite all of it. (An external pool with no free buffer large enough
    /// allocates a buffer of its own; streams use `BufferPool::get_or_wait`.)
    pub fn get(&self, len: usize) -> Buffer {
        let pid = std::process::id();
        if pid != self.pid {
            // A forked child: a parent thread may have held the lock at fork() time, and no
            // thread of the child will ever release it, so the child never touches it.
            return Buffer {
                raw: Some(Raw::alloc(len)),
                len,
                pool: Weak::new(),
                pool_max: 0,
                pid,
            };
        }
        let raw = {
            let mut free = self.free.list.lock().unwrap_or_else(|e| e.into_inner());
            match free.iter().position(|r| r.cap >= len) {
                Some(i) => free.swap_remove(i),
                None => {
                    if !self.is_external() {
                        free.clear(); // too small for current use: let them go
                    }
                    drop(free);
                    // With room to spare: a loader's windows (and last batches) differ a little
                    // in length, and a buffer a few bytes short would be allocated afresh (and
                    // its pages faulted in and zeroed) for every one.
                    Raw::alloc((len + len / 16).next_multiple_of(ALIGN))
                }
            }
        };
        Buffer {
            raw: Some(raw),
            len,
            pool: Arc::downgrade(&self.free),
            pool_max: self.max,
            pid,
        }
    }
}

/// Copies `src` into `dst` (same length) for a batch gather: with non-temporal stores when
/// both are 16-byte aligned and the length is a multiple of 64 (x86-64), so the destination's
/// old contents are never read in; a plain copy otherwise. Callers finish a run of such copies
/// with [`copy_done`].
#[inline]
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_load_si128, _mm_stream_si128};
        let n = dst.len();
        if n.is_multiple_of(64)
            && (dst.as_ptr() as usize).is_multiple_of(16)
            && (src.as_ptr() as usize).is_multiple_of(16)
        {
            let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
            let mut i = 0;
            while i < n {
                // SAFETY: SSE2 is part of x86-64; `i + 64 <= n` for both slices, whose pointers
                // are 16-byte aligned (checked), so every 16-byte access is aligned and in bounds.
                unsafe {
                    let a = _mm_load_si128(s.add(i).cast::<__m128i>());
                    let b = _mm_load_si128(s.add(i + 16).cast::<__m128i>());
                    let c = _mm_load_si128(s.add(i + 32).cast::<__m128i>());
                    let e = _mm_load_si128(s.add(i + 48).cast::<__m128i>());
                    _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
                    _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
                    _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
                    _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
                }
                i += 64;
            }
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// Orders the non-temporal stores of [`copy_streaming`] before anything that follows (the
/// batch being handed to another thread).
#[inline]
pub fn copy_done() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86-64; a store fence has no memory operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Hints that `bytes` will be read soon (the first lines of a row gathered next, and its page
/// table entry).
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for off in (0..bytes.len().min(256)).step_by(64) {
            // SAFETY: a prefetch never faults and `off` is inside `bytes`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off).cast::<i8>()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_buffers_are_handed_out_and_waited_for() {
        let mut mem = vec![Buffer::zeroed(8192), Buffer::zeroed(8192)];
        let regions: Vec<(*mut u8, usize)> = mem
            .iter_mut()
            .map(|b| (b.as_mut_bytes().as_mut_ptr(), 8192))
            .collect();
        // SAFETY: `mem` outlives the pool and its buffers, and nothing else touches it.
        let pool = unsafe { BufferPool::external(&regions, Arc::new(())) }.unwrap();
        let stop = AtomicBool::new(false);
        let a = pool.get_or_wait(8000, &stop).unwrap();
        let b = pool.get_or_wait(100, &stop).unwrap();
        assert!(regions.iter().any(|r| std::ptr::eq(r.0, a.as_ptr())));
        let err = pool
            .get_or_wait(9000, &stop)
            .expect_err("larger than any buffer");
        assert!(
            matches!(&err, Error::Invalid(m) if m.starts_with("a batch of 9000 bytes does not fit")),
            "{err:?}"
        );
        stop.store(true, Ordering::Relaxed);
        let err = pool
            .get_or_wait(10, &stop)
            .expect_err("all in use and stopped");
        assert!(
            matches!(&err, Error::Invalid(m) if m == "the loader was stopped"),
            "{err:?}"
        );
        stop.store(false, Ordering::Relaxed);
        let p = a.as_ptr();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(a);
        });
        let c = pool.get_or_wait(10, &stop).unwrap();
        assert_eq!(c.as_ptr(), p);
        t.join().unwrap();
        drop((b, c, pool));
        drop(mem);
    }

    #[test]
    fn pooled_buffers_are_reused() {
        let pool = BufferPool::new(2);
        let a = pool.get(8192);
        let p = a.as_ptr();
        drop(a);
        let b = pool.get(4096);
        assert_eq!(b.as_ptr(), p);
        assert_eq!(b.len(), 4096);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        drop(pool);
        drop(b); // freed, pool gone
    }

    #[test]
    fn streaming_copies_equal_plain_ones() {
        let src = Buffer::zeroed(8192);
        let mut src = src;
        for (i, b) in src.as_mut_bytes().iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let mut dst = Buffer::zeroed(8192);
        for (off, len) in [(0, 4096), (64, 128), (3, 61), (16, 1000), (0, 0)] {
            dst.as_mut_bytes().fill(0);
            copy_streaming(
                &mut dst.as_mut_bytes()[off..off + len],
                &src.as_bytes()[off..off + len],
            );
            copy_done();
            assert_eq!(
                dst.as_bytes()[off..off + len],
                src.as_bytes()[off..off + len]
            );
        }
    }
}
