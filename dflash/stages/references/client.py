"""One JSON call to a reference server over HTTP, under a deadline (standard library only).

`Client` makes one JSON call under the `references.*` call policy (`connect_timeout_s`, `read_timeout_s`,
`deadline_s`, `retries`, `backoff_s`: declared in dflash.config.schema.ReferencesConfig):
- a connect timeout, a read timeout (the longest the server may stay silent) and a total deadline
  per call, retries and back-off included. Every socket read waits at most what is left of the
  deadline, so a server that trickles a byte at a time cannot hold a call past it;
- connection errors, resets and 5xx answers (and 429) are retried with exponential back-off
  (`backoff_s * 2**attempt`) up to `retries` times; a read timeout, other 4xx, 501 or the deadline are not;
- an error answer's body (truncated) is in the message; an answer that is not JSON (an HTML page
  from a proxy, say) is a ReferenceError showing its start.
`Client.close()` aborts every call in flight (an interrupt ends the run without waiting for them).
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
import urllib.parse
from typing import Any

from dflash.config.schema import ReferencesConfig
from dflash.util.errors import ReferenceError
from dflash.util.progress import log

SNIPPET = 300  # characters of an answer shown in a message
RETRY_STATUS = (429, 500, 502, 503, 504)  # worth another attempt (501, 505: the server never will)


def snippet(body: bytes | str, n: int = SNIPPET) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    return repr(text[:n] + (" ..." if len(text) > n else ""))


class HTTPError(ReferenceError):
    """The server answered with an error status (kept in `status`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Retry(Exception):
    """A failure worth another attempt: no connection, a reset, a 5xx."""


class _Fatal(Exception):
    """A failure that another attempt would not fix in time: deadline, read timeout, aborted."""


class Client:
    def __init__(self, url: str, policy: ReferencesConfig):
        u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ReferenceError(
                f"references.url={url!r} is not an http(s) URL; e.g. references.url=http://127.0.0.1:30000"
            )
        self.url, self.policy = url.rstrip("/"), policy
        self._conn = (
            http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection,
            u.hostname,
            u.port,
        )
        self._prefix = u.path.rstrip("/")
        self._live: dict[http.client.HTTPConnection, socket.socket | None] = {}  # calls in flight and their sockets
        self._lock = threading.Lock()
        self._closed = False

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        return self.call("POST", path, payload)

    def close(self) -> None:
        """Abort every call in flight; later calls fail at once."""
        with self._lock:
            self._closed = True
            live = list(self._live.items())
        for conn, sock in live:
            _shutdown(sock or conn.sock)

    def call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        p, where = self.policy, f"{method} {self.url}{path}"
        end = time.monotonic() + p.deadline_s
        for attempt in range(p.retries + 1):
            try:
                status, body = self._once(method, path, payload, end)
                if status not in RETRY_STATUS:
                    break
                why = f"HTTP {status}: {snippet(body)}"
            except _Retry as e:
                why = str(e)
            except _Fatal as e:
                raise ReferenceError(f"{where}: {e}") from None
            wait = p.backoff_s * 2**attempt
            if attempt == p.retries or time.monotonic() + wait >= end:
                raise ReferenceError(
                    f"{where} did not answer after {attempt + 1} attempt(s) ({why}); start the server, check "
                    f"references.url, "
                    "raise references.retries / references.deadline_s, or use references=local"
                ) from None
            log.warning("%s: %s; retrying in %.1f s (%d of %d)", where, why, wait, attempt + 1, p.retries)
            time.sleep(wait)
        if status >= 400:
            raise HTTPError(f"{where} answered HTTP {status}: {snippet(body)}", status)
        try:
            return json.loads(body)
        except ValueError:
            raise ReferenceError(
                f"{where} answered HTTP {status} with something that is not JSON: {snippet(body)}; "
                "is references.url the server itself (not a proxy or a web page)?"
            ) from None

    def _once(self, method: str, path: str, payload: dict[str, Any] | None, end: float) -> tuple[int, bytes]:
        p = self.policy
        left = end - time.monotonic()
        if left <= 0:
            raise _Fatal(f"no answer within references.deadline_s={p.deadline_s:g} s")
        cls, host, port = self._conn
        conn = cls(host, port, timeout=min(p.connect_timeout_s, left))
        conn.response_class = lambda sock, *a, **kw: http.client.HTTPResponse(_Answer(sock, self, end), *a, **kw)
        with self._lock:
            if self._closed:
                raise _Fatal("aborted")
            self._live[conn] = None
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise _Retry(f"no connection within references.connect_timeout_s={p.connect_timeout_s:g} s") from None
            with self._lock:
                self._live[conn] = (
                    conn.sock
                )  # kept: http.client lets go of conn.sock once an answer will close the connection
            conn.sock.settimeout(max(1e-3, min(p.read_timeout_s, end - time.monotonic())))
            body = json.dumps(payload).encode() if payload is not None else None
            conn.request(
                method,
                self._prefix + path,
                body=body,
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            if self._closed:
                raise _Fatal("aborted") from None
            if isinstance(e, TimeoutError):
                raise _Fatal(f"the server sent nothing for references.read_timeout_s={p.read_timeout_s:g} s") from None
            raise _Retry(f"{type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                self._live.pop(conn, None)
            conn.close()


class _Answer:
    """The socket as http.client reads an answer from it: every read waits at most the read timeout
    and what is left of the deadline, so a trickle of bytes cannot outlast the deadline."""

    def __init__(self, sock: socket.socket, client: Client, end: float):
        self.sock, self.client, self.end = sock, client, end

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_Reads(self))


class _Reads(io.RawIOBase):
    def __init__(self, answer: _Answer):
        self.a = answer
        self.raw = answer.sock.makefile("rb", buffering=0)  # holds the socket open after the connection lets go of it

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()
        super().close()

    def readinto(self, buf) -> int:
        a, p = self.a, self.a.client.policy
        left = a.end - time.monotonic()
        if left <= 0:
            raise _Fatal(f"the answer did not complete within references.deadline_s={p.deadline_s:g} s")
        if a.client._closed:
            raise _Fatal("aborted")
        a.sock.settimeout(min(p.read_timeout_s, left))
        try:
            return self.raw.readinto(buf)
        except TimeoutError:
            if time.monotonic() >= a.end:
                raise _Fatal(f"the answer did not complete within references.deadline_s={p.deadline_s:g} s") from None
            raise


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read in another thread
        except OSError:
            pass
