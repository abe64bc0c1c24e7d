//! `shardkit bench link`: a TCP relay that makes a loopback server answer like a far object
//! store, for `bench remote --link-latency-ms/--link-conn-mbps`.
//!
//! A loopback server answers in microseconds with the client's own cores, so a loader is
//! measured there where it competes for CPU with the server. A real store is far: every request
//! waits a round trip before its first byte, and each connection streams at a bounded rate
//! (tens of MB/s per connection on S3), so throughput comes from many requests in flight.
//! The relay models exactly that: every byte of a response reaches the client `latency` after
//! the server sent it, and each connection's responses are paced to `conn_mbps`. Requests pass
//! unchanged and at once (upload rates are not what it models).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver};
use std::time::{Duration, Instant};

use clap::Args;
use shardkit::{Error, Result};

/// `shardkit bench link`.
#[derive(Args, Debug, Clone)]
pub struct LinkArgs {
    /// The server to relay to (`host:port`).
    #[arg(long)]
    pub upstream: String,
    /// Where to listen (`host:port`; port 0 picks a free one). The address is printed on the
    /// first line of standard output once the relay accepts connections.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Delay added to every byte of every response, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub latency_ms: f64,
    /// Each connection's responses paced to this many MB (10^6 bytes) per second (0: no cap).
    #[arg(long, default_value_t = 0.0)]
    pub conn_mbps: f64,
}

/// Bytes read from the server at a time.
const CHUNK: usize = 64 << 10;
/// Chunks a connection holds on their way to the client (4 MiB): a server faster than the
/// pace waits, as it would behind a slow network.
const HELD_CHUNKS: usize = 64;

/// Relays until killed.
pub fn run(a: LinkArgs) -> Result<()> {
    if !(a.latency_ms.is_finite()
        && a.latency_ms >= 0.0
        && a.conn_mbps.is_finite()
        && a.conn_mbps >= 0.0)
    {
        return Err(Error::Invalid(
            "--latency-ms and --conn-mbps must be finite and not negative".into(),
        ));
    }
    let listener = TcpListener::bind(&a.listen)
        .map_err(|e| Error::Invalid(format!("cannot listen on {}: {e}", a.listen)))?;
    let at = listener
        .local_addr()
        .map_err(|e| Error::Invalid(format!("the relay's address: {e}")))?;
    println!("{at}");
    std::io::stdout()
        .flush()
        .map_err(|e| Error::Invalid(format!("standard output: {e}")))?;
    serve(listener, &a.upstream, a.latency_ms, a.conn_mbps);
    Ok(())
}

/// Relays every connection `listener` accepts to `upstream`, each on threads of its own.
fn serve(listener: TcpListener, upstream: &str, latency_ms: f64, conn_mbps: f64) {
    let latency = Duration::from_secs_f64(latency_ms / 1e3);
    let rate = (conn_mbps > 0.0).then_some(conn_mbps * 1e6);
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let upstream = upstream.to_string();
        // A connection that fails (the server gone, the client reset) ends alone.
        let _ = std::thread::Builder::new()
            .name("link".into())
            .spawn(move || relay(client, &upstream, latency, rate));
    }
}

/// One connection: requests straight through, responses delayed and paced.
fn relay(client: TcpStream, upstream: &str, latency: Duration, rate: Option<f64>) {
    let Ok(server) = TcpStream::connect(upstream) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (Ok(mut from_client), Ok(mut to_server), Ok(from_server)) =
        (client.try_clone(), server.try_clone(), server.try_clone())
    else {
        return;
    };
    let requests = std::thread::spawn(move || {
        let _ = std::io::copy(&mut from_client, &mut to_server);
        let _ = to_server.shutdown(Shutdown::Write);
    });
    let (tx, rx) = sync_channel::<(Instant, Vec<u8>)>(HELD_CHUNKS);
    let responses = std::thread::spawn(move || {
        let mut from_server = from_server;
        loop {
            let mut chunk = vec![0u8; CHUNK];
            match from_server.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    chunk.truncate(n);
                    if tx.send((Instant::now(), chunk)).is_err() {
                        return;
                    }
                }
            }
        }
    });
    deliver(rx, client, latency, rate);
    let _ = server.shutdown(Shutdown::Both);
    let _ = (requests.join(), responses.join());
}

/// Writes each chunk `latency` after it came from the server, and no sooner than the pace
/// allows: a chunk of n bytes holds the connection for n / rate seconds.
fn deliver(
    rx: Receiver<(Instant, Vec<u8>)>,
    mut client: TcpStream,
    latency: Duration,
    rate: Option<f64>,
) {
    let mut free_at = Instant::now();
    for (came, chunk) in rx {
        let due = (came + latency).max(free_at);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if client.write_all(&chunk).is_err() {
            break;
        }
        if let Some(rate) = rate {
            free_at = due + Duration::from_secs_f64(chunk.len() as f64 / rate);
        }
    }
    let _ = client.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every line it reads with `size` bytes.
    fn echo_server(size: usize) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                std::thread::spawn(move || {
                    let mut b = [0u8; 1];
                    while c.read(&mut b).is_ok_and(|n| n == 1) {
                        if b[0] == b'\n' && c.write_all(&vec![7u8; size]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        at
    }

    fn relay_to(upstream: String, latency_ms: f64, conn_mbps: f64) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || serve(l, &upstream, latency_ms, conn_mbps));
        at
    }

    /// Seconds from sending a request line to having `size` bytes back, on one connection.
    fn round_trip(c: &mut TcpStream, size: usize) -> f64 {
        let t = Instant::now();
        c.write_all(b"\n").unwrap();
        let mut got = vec![0u8; size];
        c.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 7));
        t.elapsed().as_secs_f64()
    }

    #[test]
    fn every_response_waits_the_latency_and_keeps_the_pace() {
        let up = echo_server(1 << 20);
        // Each response on a connection kept open comes 80 ms late.
        let mut c = TcpStream::connect(relay_to(up.clone(), 80.0, 0.0)).unwrap();
        for _ in 0..3 {
            let s = round_trip(&mut c, 1 << 20);
            assert!((0.08..2.0).contains(&s), "{s}");
        }
        // 1 MiB at 10 MB/s takes about 0.1 s beyond the latency.
        let mut c = TcpStream::connect(relay_to(up, 0.0, 10.0)).unwrap();
        let s = round_trip(&mut c, 1 << 20);
        assert!((0.09..2.0).contains(&s), "{s}");
    }

    #[test]
    fn a_server_that_is_gone_closes_the_connection() {
        let gone = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = gone.local_addr().unwrap().to_string();
        drop(gone);
        let mut c = TcpStream::connect(relay_to(at, 0.0, 0.0)).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(c.read(&mut b).unwrap_or(0), 0);
    }
}
