//! Configuration in one place: every `SHARDKIT_*` environment variable is read here, and the
//! process-wide tunables (request size, request slots, retries, timeouts, the cache's size and
//! page) live here with their defaults; other modules call these accessors.
//!
//! A value that is set but does not parse is an error naming the variable, never a silent fall
//! back to the default (a typo such as `SHARDKIT_CACHE_GIB=50GB` must not quietly become 32 GiB).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// The variable's value, `None` when unset or empty.
fn raw(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::Invalid(format!(
            "environment variable {name}={v:?} is not valid UTF-8"
        ))),
    }
}

fn invalid(name: &str, value: &str, what: &str) -> Error {
    Error::Invalid(format!(
        "environment variable {name}={value:?} is not {what}"
    ))
}

/// A non-negative integer setting.
pub(crate) fn whole(name: &str) -> Result<Option<u64>> {
    raw(name)?
        .map(|v| {
            v.trim()
                .parse()
                .map_err(|_| invalid(name, &v, "a non-negative integer"))
        })
        .transpose()
}

/// A finite, non-negative number (seconds, GiB).
pub(crate) fn number(name: &str) -> Result<Option<f64>> {
    raw(name)?
        .map(|v| {
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| invalid(name, &v, "a non-negative number"))
        })
        .transpose()
}

/// A switch: `0` or `1` (`false`/`true`, `no`/`yes`, `off`/`on` too).
pub(crate) fn switch(name: &str) -> Result<Option<bool>> {
    raw(name)?
        .map(|v| match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(invalid(name, &v, "0 or 1")),
        })
        .transpose()
}

/// Largest ranged GET issued (`SHARDKIT_S3_REQUEST_MIB`, default 8 MiB): large enough that
/// per-request latency is amortised, small enough that many run in parallel.
pub fn max_request() -> u64 {
    let set = MAX_REQUEST.load(Ordering::Relaxed);
    if set > 0 {
        return set;
    }
    env_u64("SHARDKIT_S3_REQUEST_MIB")
        .unwrap_or(8)
        .clamp(1, 1024)
        << 20
}

static MAX_REQUEST: AtomicU64 = AtomicU64::new(0);

/// Sets the largest ranged GET for this process, in MiB (1 to 1024; 0: back to the default),
/// e.g. for a benchmark's sweep; `SHARDKIT_S3_REQUEST_MIB` sets it from outside.
pub fn set_max_request_mib(mib: u64) {
    let bytes = if mib == 0 {
        0
    } else {
        mib.clamp(1, 1024) << 20
    };
    MAX_REQUEST.store(bytes, Ordering::Relaxed);
}

/// Request slots of this process (`SHARDKIT_S3_INFLIGHT`, default 4 per core, at least 16 and
/// at most 128), shared by every read running at once: a GET of the full [`max_request`] size
/// takes a slot, a smaller one a share in proportion to its size, down to a quarter (the
/// slots are counted in quarters). Memory held by responses is at most `inflight · max_request`.
pub fn inflight() -> usize {
    let set = INFLIGHT.load(Ordering::Relaxed);
    if set > 0 {
        return set as usize;
    }
    env_u64("SHARDKIT_S3_INFLIGHT")
        .map(|n| n as usize)
        .unwrap_or_else(|| (available_cores() * 4).clamp(16, 128))
        .clamp(1, 1024)
}

static INFLIGHT: AtomicU64 = AtomicU64::new(0);

/// Sets the request slots of this process ([`inflight`]; 0: back to the default), e.g. for a
/// benchmark's sweep; `SHARDKIT_S3_INFLIGHT` sets it from outside.
pub fn set_inflight(n: usize) {
    INFLIGHT.store(n as u64, Ordering::Relaxed);
}

/// A whole-number setting; one that does not parse was refused when the store was first used
/// ([`check_settings`]).
pub(crate) fn env_u64(key: &str) -> Option<u64> {
    whole(key).ok().flatten()
}

/// Checks every numeric `SHARDKIT_S3_*` and `SHARDKIT_CACHE_*` setting, when a store is used:
/// one that is set but does not parse is an error naming it (the getters, which cannot fail,
/// would otherwise fall back to their defaults without a word).
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub(crate) fn check_settings() -> Result<()> {
    for name in [
        "SHARDKIT_S3_INFLIGHT",
        "SHARDKIT_S3_REQUEST_MIB",
        "SHARDKIT_S3_RETRIES",
        "SHARDKIT_S3_LOCK_LEASE_S",
        "SHARDKIT_CACHE_PAGE_MIB",
    ] {
        whole(name)?;
    }
    for name in [
        "SHARDKIT_S3_TIMEOUT",
        "SHARDKIT_S3_CONNECT_TIMEOUT",
        "SHARDKIT_S3_RETRY_TIMEOUT",
        "SHARDKIT_CACHE_GIB",
    ] {
        number(name)?;
    }
    switch("SHARDKIT_S3_LOCK")?;
    Ok(())
}

/// The number of cores this process may use.
pub(crate) fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The local cache directory, `$SHARDKIT_CACHE_DIR`, when it is set (see the `io` module's
/// cache).
pub(crate) fn cache_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("SHARDKIT_CACHE_DIR")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
}

/// The cache's size limit in bytes, `$SHARDKIT_CACHE_GIB` GiB (default 32).
pub(crate) fn cache_limit() -> u64 {
    // A value that does not parse was refused when the store was first used.
    let gib = number("SHARDKIT_CACHE_GIB").ok().flatten().unwrap_or(32.0);
    (gib * (1u64 << 30) as f64) as u64
}

/// Bytes per cached page of a data object (`SHARDKIT_CACHE_PAGE_MIB`, 1 to 64, default 4).
pub(crate) fn cache_page_size() -> u64 {
    env_u64("SHARDKIT_CACHE_PAGE_MIB").unwrap_or(4).clamp(1, 64) << 20
}

/// Where writes to a store are staged, `$SHARDKIT_STAGING_DIR`, when it is set (the commit
/// layer's staging directories lie below it).
pub(crate) fn staging_base() -> Option<std::path::PathBuf> {
    std::env::var_os("SHARDKIT_STAGING_DIR").map(std::path::PathBuf::from)
}

/// Whether a writer to a store takes the store's lock (`SHARDKIT_S3_LOCK`, default on; `0`
/// turns it off for stores without conditional writes).
pub(crate) fn s3_lock() -> Result<bool> {
    Ok(switch("SHARDKIT_S3_LOCK")?.unwrap_or(true))
}

/// Seconds a store lock stays valid after its last renewal (`SHARDKIT_S3_LOCK_LEASE_S`, at
/// least 1, default 120).
pub(crate) fn s3_lock_lease_s() -> u64 {
    // A value that does not parse was refused when the store was first used.
    whole("SHARDKIT_S3_LOCK_LEASE_S")
        .ok()
        .flatten()
        .unwrap_or(120)
        .max(1)
}

/// The S3 client's settings: retries of a request (`SHARDKIT_S3_RETRIES`, default 10) and for
/// at most `SHARDKIT_S3_RETRY_TIMEOUT` seconds (default 180), the request timeout
/// (`SHARDKIT_S3_TIMEOUT`, 60 s) and the connect timeout (`SHARDKIT_S3_CONNECT_TIMEOUT`, 10 s).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub(crate) struct S3Settings {
    pub retries: usize,
    pub retry_timeout: std::time::Duration,
    pub timeout: std::time::Duration,
    pub connect_timeout: std::time::Duration,
}

/// The S3 client's settings from the environment (an error names one that does not parse).
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub(crate) fn s3_settings() -> Result<S3Settings> {
    let secs = |key: &str, default: u64| -> Result<std::time::Duration> {
        let s = number(key)?.unwrap_or(default as f64);
        Ok(std::time::Duration::from_secs_f64(s.clamp(0.001, 1e9)))
    };
    Ok(S3Settings {
        retries: env_u64("SHARDKIT_S3_RETRIES").unwrap_or(10) as usize,
        retry_timeout: secs("SHARDKIT_S3_RETRY_TIMEOUT", 180)?,
        timeout: secs("SHARDKIT_S3_TIMEOUT", 60)?,
        connect_timeout: secs("SHARDKIT_S3_CONNECT_TIMEOUT", 10)?,
    })
}

/// Whether the environment variable `key` is one of the S3 client's settings (a client is made
/// again when one changes).
#[cfg_attr(not(feature = "s3"), allow(dead_code))]
pub(crate) fn is_s3_setting(key: &str) -> bool {
    key.starts_with("SHARDKIT_S3_")
}

/// `SHARDKIT_TEST_TOKEN_GROUP`: tokens per fetched group of a flat-tokens buffer (tests only:
/// small datasets in many groups); `None` when unset or zero.
pub(crate) fn test_token_group() -> Option<u64> {
    whole("SHARDKIT_TEST_TOKEN_GROUP")
        .ok()
        .flatten()
        .filter(|&n| n > 0)
}

/// `SHARDKIT_TOKEN_BUFFER_GIB`: the flat-tokens loader's buffer cap in GiB, when set.
pub(crate) fn token_buffer_gib() -> Result<Option<u64>> {
    whole("SHARDKIT_TOKEN_BUFFER_GIB")
}

/// The kill tests' hooks: `SHARDKIT_TEST_ABORT_AFTER_RENAMES` and
/// `SHARDKIT_TEST_ABORT_AFTER_PUTS` (the count after which the process aborts). Compiled only
/// with the `fault-injection` feature: a user's build never reads them.
#[cfg(feature = "fault-injection")]
pub(crate) fn test_abort_after(what: AbortAfter) -> Option<u64> {
    let var = match what {
        AbortAfter::Renames => "SHARDKIT_TEST_ABORT_AFTER_RENAMES",
        AbortAfter::Puts => "SHARDKIT_TEST_ABORT_AFTER_PUTS",
    };
    std::env::var(var).ok().and_then(|v| v.parse().ok())
}

/// What a kill test counts before aborting (`test_abort_after`).
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy)]
pub(crate) enum AbortAfter {
    Renames,
    Puts,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each test uses its own variable: tests run in parallel within the process.
    fn with<T>(name: &str, value: Option<&str>, f: impl FnOnce() -> T) -> T {
        match value {
            Some(v) => std::env::set_var(name, v),
            None => std::env::remove_var(name),
        }
        let out = f();
        std::env::remove_var(name);
        out
    }

    #[test]
    fn unset_and_empty_are_none_and_bad_values_name_the_variable() {
        let n = "SHARDKIT_TEST_ENV_WHOLE";
        assert_eq!(with(n, None, || whole(n).unwrap()), None);
        assert_eq!(with(n, Some(" "), || whole(n).unwrap()), None);
        assert_eq!(with(n, Some(" 12 "), || whole(n).unwrap()), Some(12));
        for bad in ["-1", "1.5", "12MiB"] {
            let e = with(n, Some(bad), || whole(n)).unwrap_err().to_string();
            assert!(e.contains(n) && e.contains(bad), "{e}");
        }
        let n = "SHARDKIT_TEST_ENV_NUMBER";
        assert_eq!(with(n, Some("0.5"), || number(n).unwrap()), Some(0.5));
        for bad in ["-1", "inf", "NaN", "50GB"] {
            let e = with(n, Some(bad), || number(n)).unwrap_err().to_string();
            assert!(e.contains(n) && e.contains("non-negative number"), "{e}");
        }
        let n = "SHARDKIT_TEST_ENV_SWITCH";
        assert_eq!(with(n, Some("Off"), || switch(n).unwrap()), Some(false));
        assert_eq!(with(n, Some("1"), || switch(n).unwrap()), Some(true));
        let e = with(n, Some("maybe"), || switch(n))
            .unwrap_err()
            .to_string();
        assert!(e.contains("0 or 1"), "{e}");
    }
}
