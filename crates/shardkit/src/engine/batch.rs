//! Owned, page-aligned batch memory, recycled through a pool.
//!
//! Rows are copied into a [`Buffer`] once; it is then handed out as is (a `&[f32]` view for
//! activations, and to numpy without a copy). Fresh multi-megabyte allocations cost a page fault
//! and a zeroing per page, which at disk speed is a large share of the CPU on a small machine, so
//! buffers taken from a [`BufferPool`] go back to it when dropped and are reused.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::{Arc, Mutex, Weak};

/// Alignment of every buffer (a page; also what O_DIRECT needs).
pub const ALIGN: usize = 4096;

struct Raw {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: a Raw exclusively owns its allocation.
unsafe impl Send for Raw {}

impl Raw {
    fn alloc(cap: usize) -> Raw {
        if cap == 0 {
            return Raw {
                ptr: std::ptr::null_mut(),
                cap: 0,
            };
        }
        let layout = Layout::from_size_align(cap, ALIGN).expect("buffer size fits in isize");
        // SAFETY: non-zero size, valid layout.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Raw { ptr, cap }
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated in `alloc` with this exact layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.cap, ALIGN)) };
        }
    }
}

type Free = Mutex<Vec<Raw>>;

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
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr is valid for cap >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.raw().ptr, self.len) }
    }
    /// The bytes, mutably.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
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
    /// A raw pointer to the first byte (for zero-copy hand-off to other runtimes).
    pub fn as_ptr(&self) -> *const u8 {
        self.raw().ptr
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let Some(raw) = self.raw.take() else { return };
        if self.pid != std::process::id() {
            return; // freed, not pooled: after fork() the pool's lock may be held for ever
        }
        if let Some(pool) = self.pool.upgrade() {
            let mut free = pool.lock().unwrap_or_else(|e| e.into_inner());
            if free.len() < self.pool_max {
                free.push(raw);
            }
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
#[derive(Clone)]
pub struct BufferPool {
    free: Arc<Free>,
    max: usize,
    pid: u32,
}

impl BufferPool {
    /// A pool keeping at most `max` free buffers.
    pub fn new(max: usize) -> BufferPool {
        BufferPool {
            free: Arc::new(Mutex::new(Vec::new())),
            max,
            pid: std::process::id(),
        }
    }
    /// A buffer of `len` bytes; its content is unspecified (zeros or an earlier batch's bytes),
    /// so callers overwrite all of it.
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
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            match free.iter().position(|r| r.cap >= len) {
                Some(i) => free.swap_remove(i),
                None => {
                    free.clear(); // too small for current use: let them go
                    drop(free);
                    Raw::alloc(len)
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
