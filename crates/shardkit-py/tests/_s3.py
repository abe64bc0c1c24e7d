"""A real S3-protocol server on loopback for the s3:// tests: moto's ThreadedMotoServer, and in
front of it a small HTTP proxy that injects the faults object stores produce (503 SlowDown, 500
InternalError, a connection dropped mid-body, a response slower than the client's timeout).

The proxy forwards every request unchanged (moto does not check signatures, so the Host header
the client signed for is harmless) and, while armed, replaces the next ``count`` ranged GETs
with the fault.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce '
    b"your request rate.</Message></Error>"
)
INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Message>We '
    b"encountered an internal error. Please try again.</Message></Error>"
)


def range_bytes(header: str) -> int:
    """The bytes a ``Range: bytes=a-b`` header asks for (0 for any other form)."""
    try:
        first, last = header.split("=", 1)[1].split("-", 1)
        return int(last) - int(first) + 1
    except (IndexError, ValueError):
        return 0


def slot_quarters(request_bytes: int) -> Callable[[int], int]:
    """A GET's weight in request-slot quarters, as shardkit counts them: its size over the full
    request size, rounded up, from one quarter to four."""
    return lambda n: min(4, max(1, -(-n * 4 // request_bytes)))


# How long a held GET waits for `FaultProxy.release`, and `FaultProxy.wait_until` for its
# condition: never reached when the client behaves, so a generous bound that only turns a hang
# into a failure.
HOLD_GUARD_S = 60.0


class FaultProxy:
    """Forwards to ``upstream`` (host, port); ``arm(kind, count)`` faults the next ranged GETs
    (``arm(kind, count, on="PUT")``: the next PUTs, whole objects and multipart parts)."""

    def __init__(self, upstream: tuple[str, int], stall_s: float = 3.0) -> None:
        self.upstream = upstream
        self.stall_s = stall_s
        self.kind: Optional[str] = None
        self.on = "GET"
        self.left = 0
        self.injected = 0
        self.ranged_gets = 0
        # Ranged GETs being answered now, the most at once, and a delay added to each (so
        # that requests overlap when the client lets them).
        self.active_gets = 0
        self.get_delay_s = 0.0
        # The ranged GETs, in the order they arrived: (path, Range header, [arrived, answered]
        # monotonic times). Take `len(get_log)` as a mark and read what follows it.
        self.get_log: List[Tuple[str, str, List[float]]] = []
        # Whether each request (any method) came signed (with an Authorization header).
        self.signed_log: List[bool] = []
        # Every request (any method), in the order it arrived: (method, path).
        self.request_log: List[Tuple[str, str]] = []
        # Counted exactly, at each arrival: the most ranged GETs being answered at once, their
        # bytes, and their weight (``weigh(bytes)``, e.g. `slot_quarters`); `reset_peaks` starts
        # a new count.
        self.weigh: Callable[[int], int] = lambda n: 1
        self.flying: Dict[int, int] = {}
        self.peak_gets = self.peak_bytes = self.peak_weight = 0
        # While `hold_if` is set, a ranged GET for which ``hold_if(path, range)`` is true when it
        # arrives is not answered until `release` (or, so that a broken client fails rather than
        # hangs, HOLD_GUARD_S): the client's requests stay in flight as long as the test needs.
        self.hold_if: Optional[Callable[[str, str], bool]] = None
        self.held: Dict[int, int] = {}
        self.hold_expired = False
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _forward(self) -> None:
                body = self._body()
                with proxy.lock:
                    proxy.signed_log.append("Authorization" in self.headers)
                    proxy.request_log.append((self.command, self.path))
                fault = None
                targeted = (self.command == "GET" and "Range" in self.headers) if proxy.on == "GET" else self.command == proxy.on
                if targeted:
                    with proxy.lock:
                        proxy.ranged_gets += self.command == "GET"
                        if proxy.kind is not None and proxy.left > 0:
                            proxy.left -= 1
                            proxy.injected += 1
                            fault = proxy.kind
                self.counted = self.command == "GET" and "Range" in self.headers
                if self.counted:
                    with proxy.cond:
                        self.times = [time.monotonic(), float("inf")]
                        proxy.get_log.append((self.path, self.headers["Range"], self.times))
                        proxy.active_gets += 1
                        proxy._arrived(id(self), range_bytes(self.headers["Range"]))
                        if proxy.hold_if is not None and proxy.hold_if(self.path, self.headers["Range"]):
                            proxy.held[id(self)] = range_bytes(self.headers["Range"])
                            proxy.cond.notify_all()
                            if not proxy.cond.wait_for(lambda: proxy.hold_if is None, HOLD_GUARD_S):
                                proxy.hold_expired = True
                            del proxy.held[id(self)]
                try:
                    if self.counted and proxy.get_delay_s:
                        time.sleep(proxy.get_delay_s)
                    self._answer(fault, body)
                finally:
                    self._uncount()

            def _uncount(self) -> None:
                # Before the answer's bytes go out: once the client has them it may start its
                # next request, which must not find this one still counted.
                if self.counted:
                    self.counted = False
                    with proxy.cond:
                        proxy.active_gets -= 1
                        self.times[1] = time.monotonic()
                        proxy.flying.pop(id(self), None)
                        proxy.cond.notify_all()

            def _answer(self, fault: Optional[str], body: bytes) -> None:
                if fault == "503":
                    return self._send(503, SLOWDOWN, {"Content-Type": "application/xml"})
                if fault == "500":
                    return self._send(500, INTERNAL, {"Content-Type": "application/xml"})
                if fault == "stall":
                    time.sleep(proxy.stall_s)
                if fault == "drop" and self.command != "GET":
                    # An upload whose connection breaks before any answer: nothing is stored.
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                out_headers = {
                    k: v for k, v in resp.getheaders()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")
                }
                if self.command == "HEAD" and resp.getheader("Content-Length") is not None:
                    # A HEAD answers with the object's length, not its (empty) body's.
                    out_headers["Content-Length"] = resp.getheader("Content-Length")
                conn.close()
                if fault == "drop":
                    # The headers promise the whole body; half of it arrives, then the socket closes.
                    self._uncount()
                    self.send_response(resp.status)
                    for k, v in out_headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._send(resp.status, data, out_headers, head=self.command == "HEAD")

            def _send(self, status: int, data: bytes, headers: Dict[str, str], head: bool = False) -> None:
                self._uncount()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if not head or "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                # A client that gave up on a stalled response (its timeout) closes the socket.
                pass

        self.server = Server(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def arm(self, kind: Optional[str], count: int = 1, on: str = "GET") -> None:
        with self.lock:
            self.kind, self.left, self.injected, self.on = kind, count, 0, on

    def _arrived(self, key: int, n: int) -> None:
        """Counts a ranged GET of ``n`` bytes as being answered (under the lock)."""
        self.flying[key] = n
        self.peak_gets = max(self.peak_gets, len(self.flying))
        self.peak_bytes = max(self.peak_bytes, sum(self.flying.values()))
        self.peak_weight = max(self.peak_weight, sum(map(self.weigh, self.flying.values())))
        self.cond.notify_all()

    def reset_peaks(self, weigh: Optional[Callable[[int], int]] = None) -> None:
        with self.lock:
            if weigh is not None:
                self.weigh = weigh
            self.peak_gets = self.peak_bytes = self.peak_weight = 0

    def hold(self, hold_if: Callable[[str, str], bool] = lambda path, rng: True) -> None:
        """Holds the ranged GETs that arrive from now on and match ``hold_if`` (see `hold_if`)."""
        with self.cond:
            self.hold_if, self.hold_expired = hold_if, False

    def release(self) -> None:
        """Answers the GETs held, and holds no more."""
        with self.cond:
            self.hold_if = None
            self.cond.notify_all()

    def wait_until(self, what: Callable[["FaultProxy"], bool], timeout_s: float = HOLD_GUARD_S) -> bool:
        """Whether ``what(self)`` came true (checked, under the lock, at every arrival and
        answer); the timeout only keeps a broken client from hanging the test."""
        with self.cond:
            return self.cond.wait_for(lambda: what(self), timeout_s)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Waits until no GET is being answered: a stalled answer of an earlier test (its client
        gave up long ago) may still be counted."""
        deadline = time.monotonic() + timeout_s
        while self.active_gets and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.active_gets == 0, f"{self.active_gets} GETs still being answered"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class S3:
    """moto on loopback, with a fault proxy in front; ``env(proxy=...)`` points shardkit at it."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        # One log line per request would drown the test output.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proxy = FaultProxy(("127.0.0.1", self.port))
        self._n = 0

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )

    def bucket(self) -> str:
        """A new, empty bucket."""
        self._n += 1
        name = f"shardkit-test-{self._n}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self, proxy: bool = False, **extra: str) -> Dict[str, str]:
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.proxy.url if proxy else self.endpoint,
            # Backoff is fast in tests; the budgets are the defaults unless a test sets them.
            "SHARDKIT_S3_TIMEOUT": "30",
        }
        env.update(extra)
        return env

    def objects(self, bucket: str, prefix: str = "") -> Dict[str, bytes]:
        c = self.client()
        out: Dict[str, bytes] = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        return out

    def stop(self) -> None:
        self.proxy.close()
        self.server.stop()


@contextmanager
def environment(env: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Sets ``env`` in os.environ for the block (shardkit reads it when a store is first used);
    a None value unsets the variable."""
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
