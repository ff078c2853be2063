"""A small HTTP/1.1 server for the metrics endpoint that an abusive client cannot exhaust.

prometheus_client's ``start_http_server`` runs one thread per connection and reads headers
without a bound: idle clients put a thread each, and huge headers their size, into the watched
process. This server keeps the watched process safe:

- one event-loop thread does all socket work (plain or TLS: asyncio runs TLS handshakes without
  a thread each, with a timeout, on a connection already counted below), and one worker thread
  renders the metrics: two threads, however many clients connect;
- at most ``max_connections`` connections are kept open; one more closes the connection that has
  been idle the longest (never one whose request is being answered), so a scrape gets in while
  idle sockets pile up;
- a connection that has not sent a whole request ``idle_timeout`` seconds after it opened (or
  after its last answer) is closed, silent or trickling bytes, and so is a TLS handshake that
  does not finish in that time;
- request heads are parsed by h11 with at most ``max_header_bytes`` buffered (431 beyond), and
  a request body (a scrape has none) is read up to 64 KiB, else 413.

The response comes from prometheus_client's own WSGI app (content negotiation, gzip, ``name[]``
filters), called with a minimal WSGI environ.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable

import h11

logger = logging.getLogger("mlx_watchdog")

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_IDLE_TIMEOUT = 10.0  # seconds; Prometheus reconnects when a kept-alive socket was closed
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
_READ_CHUNK = 16 * 1024
# An accepted connection is upgraded to TLS (StreamWriter.start_tls, Python 3.11+): the handshake
# is then one of the counted, evictable connections, bounded by idle_timeout. Python 3.10 has no
# StreamWriter.start_tls: there the listener does the handshake (bounded by idle_timeout too), and
# a connection is counted once its handshake is done.


class _Connection:
    __slots__ = ("writer", "busy", "idle_since")

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.busy = False
        self.idle_since = time.monotonic()


class BoundedHTTPServer:
    """Serves a WSGI ``app`` on an already bound, listening socket from a daemon thread.

    ``start()`` returns once the server accepts connections; ``close()`` stops it, closes every
    connection and the socket, and joins the threads."""

    def __init__(
        self,
        app: Callable,
        sock: socket.socket,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        name: str = "mlx-watchdog-metrics",
    ):
        self.app = app
        self.socket = sock
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.max_header_bytes = max_header_bytes
        self.evicted = 0  # connections closed to make room for a newer one
        self._connections: dict[_Connection, None] = {}  # insertion-ordered
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-render")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def server_address(self) -> tuple:
        return self.socket.getsockname()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def start(self) -> BoundedHTTPServer:
        self.thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop ended meanwhile
                pass
        self.thread.join(timeout=5)
        self._executor.shutdown(wait=False)  # a render stuck in a user's collector is not waited
        for worker in list(getattr(self._executor, "_threads", ())):
            worker.join(timeout=2)
        try:
            self.socket.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # never into the watched program; start() reports it
            self._error = exc
            self._ready.set()
            logger.warning("mlx-watchdog metrics server stopped: %r", exc)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        tls: dict = {}
        if self.ssl_context is not None and sys.version_info < (3, 11):
            tls = {"ssl": self.ssl_context, "ssl_handshake_timeout": self.idle_timeout}
        server = await asyncio.start_server(self._serve, sock=self.socket, **tls)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for conn in list(self._connections):
                conn.writer.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _admit(self, conn: _Connection) -> None:
        self._connections[conn] = None
        while len(self._connections) > self.max_connections:
            idle = [c for c in self._connections if not c.busy and c is not conn]
            if not idle:
                break
            oldest = min(idle, key=lambda c: c.idle_since)
            del self._connections[oldest]
            oldest.writer.close()
            self.evicted += 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(writer)
        self._admit(conn)
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_header_bytes)
        try:
            if self.ssl_context is not None and sys.version_info >= (3, 11):
                raw = writer.transport
                try:
                    await writer.start_tls(self.ssl_context, ssl_handshake_timeout=self.idle_timeout)
                finally:
                    # Closed (evicted) during the handshake, CPython's start_tls leaves the writer
                    # without a transport (and raises); give it back the closed one, so that
                    # closing and collecting the writer stay no-ops.
                    if writer.transport is None:
                        writer._transport = raw  # noqa: SLF001 (asyncio's StreamWriter: no public setter)
                if writer.transport is raw:
                    return
            await self._converse(conn, reader, http)
        except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError):
            pass  # idle, gone or broken: just close
        except asyncio.CancelledError:  # the server closes: end quietly
            pass
        except Exception as exc:  # a bug here must not take the server down
            logger.debug("mlx-watchdog metrics server: connection error: %r", exc)
        finally:
            self._connections.pop(conn, None)
            writer.close()

    async def _next_event(self, reader: asyncio.StreamReader, http: h11.Connection, deadline: float):
        while True:
            event = http.next_event()
            if event is not h11.NEED_DATA:
                return event
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise asyncio.TimeoutError
            data = await asyncio.wait_for(reader.read(_READ_CHUNK), left)
            http.receive_data(data)  # b"" is the end of the stream

    async def _converse(self, conn: _Connection, reader: asyncio.StreamReader, http: h11.Connection) -> None:
        while True:
            # The whole request (head and body) within idle_timeout of the connection or of the
            # last answer: a client that trickles bytes is closed like a silent one.
            deadline = asyncio.get_running_loop().time() + self.idle_timeout
            try:
                request = await self._next_event(reader, http, deadline)
                if not isinstance(request, h11.Request):
                    return  # ConnectionClosed
                conn.busy = True
                event, body = request, 0
                while not isinstance(event, h11.EndOfMessage):
                    event = await self._next_event(reader, http, deadline)
                    if isinstance(event, h11.Data):
                        body += len(event.data)
                        if body > MAX_BODY_BYTES:
                            raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
                    elif isinstance(event, h11.ConnectionClosed):
                        return
            except h11.RemoteProtocolError as exc:
                await self._reply_error(conn.writer, http, exc.error_status_hint)
                return
            status, headers, payload = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._call_app, request
            )
            if request.method == b"HEAD":
                payload = b""
            await self._send(conn.writer, http, status, headers, payload)
            if http.our_state is h11.MUST_CLOSE or http.their_state is h11.MUST_CLOSE:
                return
            http.start_next_cycle()
            conn.busy = False
            conn.idle_since = time.monotonic()

    async def _send(self, writer, http: h11.Connection, status: int, headers: list, payload: bytes) -> None:
        writer.write(http.send(h11.Response(status_code=status, headers=headers)))
        if payload:
            writer.write(http.send(h11.Data(data=payload)))
        writer.write(http.send(h11.EndOfMessage()))
        await asyncio.wait_for(writer.drain(), self.idle_timeout)

    async def _reply_error(self, writer, http: h11.Connection, status: int) -> None:
        if http.our_state is not h11.SEND_RESPONSE and http.our_state is not h11.IDLE:
            return
        reason = {413: "Content Too Large", 431: "Request Header Fields Too Large"}.get(status, "Bad Request")
        text = f"{status} {reason}\n".encode()
        headers = [
            ("Content-Type", "text/plain"),
            ("Content-Length", str(len(text))),
            ("Connection", "close"),
        ]
        try:
            await self._send(writer, http, status, headers, text)
        except (h11.LocalProtocolError, asyncio.TimeoutError, ConnectionError, OSError):
            pass

    def _call_app(self, request: h11.Request) -> tuple[int, list, bytes]:
        """Run the WSGI app on the render thread; its status, headers and body."""
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        environ = {
            "REQUEST_METHOD": "GET" if request.method == b"HEAD" else request.method.decode("latin-1"),
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "SCRIPT_NAME": "",
            "SERVER_NAME": str(self.server_address[0]),
            "SERVER_PORT": str(self.server_address[1]),
            "SERVER_PROTOCOL": "HTTP/" + request.http_version.decode("latin-1"),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "https" if self.ssl_context else "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": io.StringIO(),
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in request.headers:
            key = "HTTP_" + name.decode("latin-1").upper().replace("-", "_")
            if key not in ("HTTP_CONTENT_TYPE", "HTTP_CONTENT_LENGTH"):
                environ[key] = value.decode("latin-1")
        started = []
        try:
            chunks = self.app(
                environ, lambda status, headers, exc_info=None: started.append((status, headers))
            )
            payload = b"".join(chunks)
            status, headers = started[0]
            code = int(status.split(" ", 1)[0])
        except Exception as exc:  # a failing collector of the user's: answer 500, keep serving
            logger.warning("mlx-watchdog metrics server: rendering the metrics failed: %r", exc)
            text = b"500 Internal Server Error\n"
            return 500, [("Content-Type", "text/plain"), ("Content-Length", str(len(text)))], text
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(payload))))
        return code, headers, payload
