//! An object store that cannot be reached (issue 32, class 5): the error names the endpoint in
//! use, how it was chosen, and the variable that points shardkit elsewhere, instead of only the
//! HTTP client's words. Its own test binary: it sets the process's AWS environment.

use shardkit::Error;

/// A loopback port nobody listens on: bound, then released.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn an_unreachable_endpoint_names_it_and_how_to_set_it() {
    let port = closed_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    // SAFETY (set_var): this binary's only test; no other thread reads the environment.
    for (k, v) in [
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
        ("SHARDKIT_S3_RETRIES", "0"),
        ("SHARDKIT_S3_CONNECT_TIMEOUT", "5"),
    ] {
        std::env::set_var(k, v);
    }
    std::env::remove_var("AWS_ENDPOINT_URL_S3");
    let e = shardkit::saev::Dataset::open("s3://bucket/acts").unwrap_err();
    assert!(matches!(e, Error::Remote { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with("s3://bucket/acts")
            && msg.contains(&format!(
                "cannot reach the endpoint {endpoint} (set by AWS_ENDPOINT_URL)"
            ))
            && msg.contains("set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) to its URL"),
        "{msg}"
    );
    // The same from every format's opener.
    for e in [
        shardkit::eagle3::Cache::open("s3://bucket/cache").unwrap_err(),
        shardkit::sdnb::open("s3://bucket/m.sdnb").unwrap_err(),
    ] {
        assert!(matches!(e, Error::Remote { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains(&format!("cannot reach the endpoint {endpoint}")),
            "{e}"
        );
    }
}
