//! Faults tests inject into the engine, to check that each reaches the consumer as an error:
//! a gather thread or the prefetch thread panicking, a thread that cannot be started, a read
//! failing with EIO. Armed process-wide (tests that use them run in a process of their own);
//! each armed fault fires once, after a given number of opportunities. When nothing is armed
//! every check is one relaxed atomic load.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::error::{Error, Result};

/// A fault to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[doc(hidden)]
pub enum Fault {
    /// A gather piece panics.
    PanicInGather = 0,
    /// The prefetch thread panics while preparing a batch.
    PanicInPrepare = 1,
    /// Starting a loader thread or pool fails.
    SpawnFails = 2,
    /// A read fails with EIO.
    ReadFails = 3,
}

static ARMED: AtomicU8 = AtomicU8::new(0);
static COUNTDOWN: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

/// Arms `fault` to fire at its `after + 1`-th opportunity.
#[doc(hidden)]
pub fn inject(fault: Fault, after: u64) {
    COUNTDOWN[fault as usize].store(after, Ordering::SeqCst);
    ARMED.fetch_or(1 << fault as u8, Ordering::SeqCst);
}

/// Disarms every fault.
#[doc(hidden)]
pub fn clear() {
    ARMED.store(0, Ordering::SeqCst);
}

/// Whether `fault` fires at this opportunity (counting it down; disarmed once fired).
fn fires(fault: Fault) -> bool {
    let bit = 1u8 << fault as u8;
    if ARMED.load(Ordering::Relaxed) & bit == 0 {
        return false;
    }
    let c = &COUNTDOWN[fault as usize];
    let mut left = c.load(Ordering::SeqCst);
    loop {
        if left == 0 {
            // Exactly one caller wins the disarm.
            return ARMED.fetch_and(!bit, Ordering::SeqCst) & bit != 0;
        }
        match c.compare_exchange(left, left - 1, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return false,
            Err(now) => left = now,
        }
    }
}

pub(crate) fn before_fill() -> Result<()> {
    if fires(Fault::PanicInGather) {
        panic!("injected fault: a gather thread panicked");
    }
    Ok(())
}

pub(crate) fn before_prepare() -> Result<()> {
    if fires(Fault::PanicInPrepare) {
        panic!("injected fault: the prefetch thread panicked");
    }
    Ok(())
}

pub(crate) fn spawn_fails() -> bool {
    fires(Fault::SpawnFails)
}

/// An injected EIO on a read of `path`.
pub(crate) fn before_read(path: impl AsRef<Path>) -> Result<()> {
    if fires(Fault::ReadFails) {
        return Err(Error::Io {
            path: path.as_ref().to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::EIO),
        });
    }
    Ok(())
}
