//! Owned, page-aligned batch memory. Rows are copied into it once; it is then handed out as is
//! (a `&[f32]` view for activations, and to numpy without a copy), and its alignment also suits
//! O_DIRECT reads.

use std::alloc::{alloc_zeroed, dealloc, Layout};

/// Alignment of every buffer (a page).
pub const ALIGN: usize = 4096;

/// A zero-initialised, `ALIGN`-aligned byte buffer.
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer exclusively owns its allocation.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Buffer {
        if len == 0 {
            return Buffer {
                ptr: std::ptr::null_mut(),
                len: 0,
            };
        }
        let layout = Layout::from_size_align(len, ALIGN).expect("buffer size fits in isize");
        // SAFETY: non-zero size, valid layout.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Buffer { ptr, len }
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
        // SAFETY: ptr is valid for len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// The bytes, mutably.
    pub fn as_mut_bytes(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: ptr is valid for len bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// The bytes as native float32 values (the length rounded down to whole values).
    pub fn as_f32(&self) -> &[f32] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ALIGN-aligned, every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), self.len / 4) }
    }
    /// A raw pointer to the first byte (for zero-copy hand-off to other runtimes).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this exact layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, ALIGN)) };
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.len)
    }
}
