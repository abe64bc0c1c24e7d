//! Amazon S3 and S3-compatible servers: the AWS configuration (environment, profile files),
//! the endpoint, and one client per bucket.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{BackoffConfig, ClientOptions, RetryConfig};

use crate::config::{check_settings, is_s3_setting, s3_settings};
use crate::error::{Error, Result};

/// Section `[name]` of an AWS INI file (credentials or config) as key/value pairs.
fn ini_section(path: &Path, names: &[String]) -> HashMap<String, String> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return HashMap::new();
    };
    let mut out = HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(h) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = names.iter().any(|n| n == h.trim());
            continue;
        }
        if let (true, Some((k, v))) = (inside, line.split_once('=')) {
            out.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    out
}

/// The settings of `~/.aws/credentials` and `~/.aws/config` for the active profile, as
/// `AWS_*` keys, for those the environment does not set.
fn aws_files() -> Vec<(AmazonS3ConfigKey, String)> {
    let Some(home) = std::env::var_os("HOME").map(PathBuf::from) else {
        return Vec::new();
    };
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    let creds_path = std::env::var_os("AWS_SHARED_CREDENTIALS_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".aws/credentials"));
    let config_path = std::env::var_os("AWS_CONFIG_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".aws/config"));
    let mut found = ini_section(
        &config_path,
        &[format!("profile {profile}"), profile.clone()],
    );
    found.extend(ini_section(&creds_path, &[profile]));
    let wanted = [
        (
            "aws_access_key_id",
            "AWS_ACCESS_KEY_ID",
            AmazonS3ConfigKey::AccessKeyId,
        ),
        (
            "aws_secret_access_key",
            "AWS_SECRET_ACCESS_KEY",
            AmazonS3ConfigKey::SecretAccessKey,
        ),
        (
            "aws_session_token",
            "AWS_SESSION_TOKEN",
            AmazonS3ConfigKey::Token,
        ),
        ("region", "AWS_REGION", AmazonS3ConfigKey::Region),
        (
            "endpoint_url",
            "AWS_ENDPOINT_URL",
            AmazonS3ConfigKey::Endpoint,
        ),
    ];
    wanted
        .into_iter()
        .filter(|(_, env, _)| std::env::var_os(env).is_none())
        .filter_map(|(file_key, _, key)| Some((key, found.get(file_key)?.clone())))
        .collect()
}

/// Per bucket, the endpoint its client was built with and how that endpoint was chosen, for
/// the message of a request that cannot reach it.
static ENDPOINTS: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();

/// Records (for [`endpoint_words`]) which endpoint `bucket`'s client uses and where it came
/// from: an `AWS_ENDPOINT_URL*` variable, the profile's `endpoint_url`, or AWS's own.
fn remember_endpoint(bucket: &str, endpoint: Option<&str>, b: &AmazonS3Builder) {
    let set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    let words = match endpoint {
        Some(e) => {
            let from = ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"]
                .into_iter()
                .find(|k| set(k))
                .map(|k| format!("set by {k}"))
                .unwrap_or_else(|| {
                    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
                    format!("the endpoint_url of AWS profile {profile:?} in ~/.aws/config")
                });
            format!("the endpoint {e} ({from})")
        }
        None => {
            let region = b
                .get_config_value(&AmazonS3ConfigKey::Region)
                .unwrap_or_else(|| "us-east-1".into());
            format!(
                "AWS's own endpoint for region {region} (no AWS_ENDPOINT_URL is set; the region \
                 comes from AWS_REGION, AWS_DEFAULT_REGION or the profile)"
            )
        }
    };
    ENDPOINTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(bucket.to_string(), words);
}

/// The endpoint `bucket`'s client uses, and how it was chosen, in words.
pub(crate) fn endpoint_words(bucket: &str) -> String {
    ENDPOINTS
        .get()
        .and_then(|m| {
            m.lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(bucket)
                .cloned()
        })
        .unwrap_or_else(|| "the configured endpoint".into())
}

/// One client per bucket, shared by every dataset of the process (its connection pool too).
pub(crate) fn store_for(bucket: &str) -> Result<Arc<AmazonS3>> {
    check_settings()?;
    static STORES: OnceLock<Mutex<HashMap<String, Arc<AmazonS3>>>> = OnceLock::new();
    let mut stores = STORES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    // Keyed by the environment too (a process, a test, may point the same bucket elsewhere),
    // and by the process: a forked child's connections must not be its parent's.
    let mut env: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("AWS_") || is_s3_setting(k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    env.sort();
    let key = format!("{}\n{bucket}\n{}", std::process::id(), env.join("\n"));
    if let Some(s) = stores.get(&key) {
        return Ok(s.clone());
    }
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    for (k, v) in aws_files() {
        b = b.with_config(k, v);
    }
    if std::env::var("AWS_REGION").is_err() {
        if let Ok(r) = std::env::var("AWS_DEFAULT_REGION") {
            b = b.with_config(AmazonS3ConfigKey::Region, r);
        }
    }
    // A plain-HTTP endpoint (a loopback or on-premises server) is allowed when named; the
    // S3-specific one (`AWS_ENDPOINT_URL_S3`) wins over the general one, as in AWS's tools.
    let endpoint = b
        .get_config_value(&AmazonS3ConfigKey::S3Endpoint)
        .or_else(|| b.get_config_value(&AmazonS3ConfigKey::Endpoint));
    remember_endpoint(bucket, endpoint.as_deref(), &b);
    let http = endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"));
    let settings = s3_settings()?;
    let retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 2.0,
        },
        max_retries: settings.retries,
        retry_timeout: settings.retry_timeout,
    };
    let client = ClientOptions::new()
        .with_allow_http(http)
        .with_timeout(settings.timeout)
        .with_connect_timeout(settings.connect_timeout)
        .with_pool_max_idle_per_host(1024);
    let store = b
        .with_retry(retry)
        .with_client_options(client)
        .build()
        .map_err(|e| Error::Invalid(format!("s3://{bucket}: cannot configure the store: {e}")))?;
    let store = Arc::new(store);
    stores.insert(key, store.clone());
    Ok(store)
}
