//! Faults tests inject into the engine, to check that each reaches the consumer as an error:
//! a gather thread or the prefetch thread panicking, a thread that cannot be started, a read
//! failing with EIO. Armed process-wide (tests that use them run in a process of their own);
//! each armed fault fires once, after a given number of opportunities. When nothing is armed
//! every check is one relaxed atomic load.
//!
//! Compiled in only with the `fault-injection` cargo feature (the tests', through
//! `shardkit::internals::fault`). Without it (the user's build) no fault exists, and each check
//! is an empty function: no atomics, nothing read from the environment.

#[cfg(feature = "fault-injection")]
use std::path::Path;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

#[cfg(feature = "fault-injection")]
use crate::error::{Error, Result};

#[cfg(not(feature = "fault-injection"))]
pub(crate) use off::*;

/// A fault to inject.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

#[cfg(feature = "fault-injection")]
static ARMED: AtomicU8 = AtomicU8::new(0);
#[cfg(feature = "fault-injection")]
static COUNTDOWN: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

/// Arms `fault` to fire at its `after + 1`-th opportunity.
#[cfg(feature = "fault-injection")]
pub fn inject(fault: Fault, after: u64) {
    COUNTDOWN[fault as usize].store(after, Ordering::SeqCst);
    ARMED.fetch_or(1 << fault as u8, Ordering::SeqCst);
}

/// Disarms every fault.
#[cfg(feature = "fault-injection")]
pub fn clear() {
    ARMED.store(0, Ordering::SeqCst);
}

/// Whether `fault` fires at this opportunity (counting it down; disarmed once fired).
#[cfg(feature = "fault-injection")]
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

#[cfg(feature = "fault-injection")]
pub(crate) fn before_fill() -> Result<()> {
    if fires(Fault::PanicInGather) {
        panic!("injected fault: a gather thread panicked");
    }
    Ok(())
}

#[cfg(feature = "fault-injection")]
pub(crate) fn before_prepare() -> Result<()> {
    if fires(Fault::PanicInPrepare) {
        panic!("injected fault: the prefetch thread panicked");
    }
    Ok(())
}

#[cfg(feature = "fault-injection")]
pub(crate) fn spawn_fails() -> bool {
    fires(Fault::SpawnFails)
}

/// An injected EIO on a read of `path`.
#[cfg(feature = "fault-injection")]
pub(crate) fn before_read(path: impl AsRef<Path>) -> Result<()> {
    if fires(Fault::ReadFails) {
        return Err(Error::Io {
            path: path.as_ref().to_path_buf(),
            source: std::io::Error::from_raw_os_error(libc::EIO),
        });
    }
    Ok(())
}

/// The checks of a build without the `fault-injection` feature: nothing fires.
#[cfg(not(feature = "fault-injection"))]
mod off {
    use std::path::Path;

    use crate::error::Result;

    #[inline(always)]
    pub(crate) const fn before_fill() -> Result<()> {
        Ok(())
    }

    #[inline(always)]
    pub(crate) const fn before_prepare() -> Result<()> {
        Ok(())
    }

    #[inline(always)]
    pub(crate) const fn spawn_fails() -> bool {
        false
    }

    #[inline(always)]
    pub(crate) fn before_read(_: impl AsRef<Path>) -> Result<()> {
        Ok(())
    }
}
