//! Settings read from environment variables, parsed in one place: a value that is set but does
//! not parse is an error naming the variable, never a silent fall back to the default (a typo
//! such as `SHARDKIT_CACHE_GIB=50GB` must not quietly become 32 GiB).

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
