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

/// When each chunk of one connection's responses is due at the client.
struct Pace {
    latency: Duration,
    /// Bytes per second, or no cap.
    rate: Option<f64>,
    /// When the connection has finished sending the previous chunk.
    free_at: Instant,
}

impl Pace {
    fn new(latency: Duration, rate: Option<f64>, start: Instant) -> Pace {
        Pace {
            latency,
            rate,
            free_at: start,
        }
    }

    /// The time a chunk of `len` bytes that came from the server at `came` is due: `latency`
    /// after it came, and no sooner than the pace allows (a chunk of n bytes holds the
    /// connection for n / rate seconds).
    fn due(&mut self, came: Instant, len: usize) -> Instant {
        let due = (came + self.latency).max(self.free_at);
        if let Some(rate) = self.rate {
            self.free_at = due + Duration::from_secs_f64(len as f64 / rate);
        }
        due
    }
}

/// Writes each chunk when [`Pace::due`].
fn deliver(
    rx: Receiver<(Instant, Vec<u8>)>,
    mut client: TcpStream,
    latency: Duration,
    rate: Option<f64>,
) {
    let mut pace = Pace::new(latency, rate, Instant::now());
    for (came, chunk) in rx {
        let due = pace.due(came, chunk.len());
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if client.write_all(&chunk).is_err() {
            break;
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

    /// Sends a request line and reads the `size`-byte response, on one connection.
    fn round_trip(c: &mut TcpStream, size: usize) {
        c.write_all(b"\n").unwrap();
        let mut got = vec![0u8; size];
        c.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&b| b == 7));
    }

    /// The schedule, on made-up instants (what the relay achieves on a real clock is
    /// `shardkit bench remote`'s to measure, not a test's).
    #[test]
    fn every_chunk_is_due_the_latency_after_it_came_and_at_the_pace() {
        let t0 = Instant::now();
        let ms = |n: u64| Duration::from_millis(n);
        // Latency alone: each chunk exactly 80 ms after it came, however close together.
        let mut p = Pace::new(ms(80), None, t0);
        for came in [0, 0, 1, 500] {
            assert_eq!(p.due(t0 + ms(came), CHUNK), t0 + ms(came + 80));
        }
        // The pace alone: 10 MB/s, 10^5-byte chunks hold the connection 10 ms each, so chunks
        // that came together go out 10 ms apart; one that comes after the connection is free
        // goes at once.
        let mut p = Pace::new(Duration::ZERO, Some(10e6), t0);
        let dues: Vec<Instant> = (0..4).map(|_| p.due(t0, 100_000)).collect();
        assert_eq!(dues, [t0, t0 + ms(10), t0 + ms(20), t0 + ms(30)]);
        assert_eq!(p.due(t0 + ms(100), 100_000), t0 + ms(100));
        // Both: the latency first, then the pace from there.
        let mut p = Pace::new(ms(80), Some(10e6), t0);
        assert_eq!(p.due(t0, 100_000), t0 + ms(80));
        assert_eq!(p.due(t0 + ms(1), 100_000), t0 + ms(90));
    }

    #[test]
    fn responses_pass_whole_and_in_order_with_latency_and_pace() {
        let up = echo_server(1 << 20);
        // Responses on a connection kept open, delayed, and paced.
        for (latency_ms, conn_mbps) in [(5.0, 0.0), (0.0, 100.0), (2.0, 200.0)] {
            let mut c = TcpStream::connect(relay_to(up.clone(), latency_ms, conn_mbps)).unwrap();
            for _ in 0..3 {
                round_trip(&mut c, 1 << 20);
            }
        }
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
