"""The direct data path's HTTP client to the engines' own servers.

One ``EngineClient`` per ingress process holds pooled keep-alive connections to every
engine (aiohttp's ``ClientSession`` over a ``TCPConnector``: no limit on connections, idle
ones kept ``KEEPALIVE_S``). It sends the client's body byte for byte and relays the
engine's body as it arrives, undecoded (``auto_decompress=False``: the engine's
``content-encoding`` header goes to the client with the bytes it describes).

Why aiohttp rather than httpx: the dispatch and relay of every request run here, on the
ingress's event loop, and their CPU is the router's. A streamed POST of an 8 KB body with a
one-token answer from a zero-time engine cost 1.5-1.7 ms of the calling process's CPU with
httpx 0.28 (pure-Python h11 parsing over anyio) against 0.12-0.14 ms through this client on
aiohttp 3 (its C HTTP parser), on the 2-core VM (``python -m loadtest.engine_client_bench``;
docs/benchmarks.md, "The engine client: httpx against aiohttp"). The engine's failures
surface as ``ENGINE_ERRORS``. It is also the engine replicas' client on Serve's path
(``replicas.deployment``), where the replica relays the engine's answer the same way.

A response that is closed before its end (``EngineResponse.close``) closes its connection,
which makes vLLM abort the request (its server watches for the client's disconnect); one
read to its end goes back to the pool.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp

from router.serve.protocol import HOP_HEADERS

# Idle connections to an engine are kept this long (s): under the 5 s after which vLLM's
# server (uvicorn, VLLM_HTTP_TIMEOUT_KEEP_ALIVE) closes them, so a request is not sent on a
# connection the engine is closing (aiohttp does not resend a POST; the attempt would fail
# and go to another replica).
KEEPALIVE_S = 4.0
CONNECT_TIMEOUT_S = 5.0

# what a failed engine call raises: refused or reset connections, a broken body, a timeout
ENGINE_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def _headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """The engine's response headers without the hop-by-hop ones (RFC 9110 7.6.1): names
    lower-cased, a name sent several times joined into one comma-separated value (RFC 9110
    5.3; ``set-cookie``, the exception, is not an engine's)."""
    out: dict[str, str] = {}
    for k, v in resp.headers.items():
        k = k.lower()
        if k not in HOP_HEADERS:
            out[k] = f"{out[k]}, {v}" if k in out else v
    return out


class EngineResponse:
    """An engine's answer whose head has arrived: ``status``, ``headers`` (hop-by-hop ones
    dropped), then ``chunks()`` as they come; ``close()`` ends it (idempotent)."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status: int = resp.status
        self.headers = _headers(resp)
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (raw: not decoded).

        Raises:
            aiohttp.ClientError: the body broke (the engine reset or closed the
                connection before its end).
        """
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except BaseException:  # a broken or timed-out body: close its connection now, so
            self._resp.close()  # the engine sees the disconnect and aborts the request
            raise
        self._done = True

    async def close(self) -> None:
        """Give the connection back to the pool after a whole body, else close it (the
        engine then aborts the request)."""
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


class EngineClient:
    """Pooled keep-alive HTTP/1.1 connections from one ingress process to the engines.

    The session is made on first use, on the event loop that uses it (aiohttp binds its
    connections to one loop).

    Args:
        timeout_s: longest wait for the next byte of an answer, and for sending a request
            and getting its head (s): longer raises ``asyncio.TimeoutError`` (as httpx's
            read and write timeouts did); there is no bound on a whole answer, which
            streams for as long as the engine generates.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S,
                                             sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no Accept-Encoding of aiohttp's own (the body is relayed undecoded, so the
            # engine must not compress what the client did not ask compressed), no cookies
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=self.timeout, auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
                cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def open(self, method: str, url: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> EngineResponse:
        """Send a request and return once the engine's head has arrived.

        Args:
            body: the request's body, sent as is.
            timeout_s: a bound on the whole call (s), or None for the client's read
                timeout only.
        A redirect is not followed: its 3xx is the answer (as the engine gave it).

        Raises:
            ENGINE_ERRORS: the engine is unreachable, or did not answer in time.
        """
        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(
            total=timeout_s, connect=CONNECT_TIMEOUT_S)
        # the read timeout starts once the body is written: this bounds the write too
        async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
            resp = await self.session.request(method, url, data=body, headers=headers,
                                              timeout=timeout, allow_redirects=False)
        return EngineResponse(resp)

    async def call(self, method: str, url: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> tuple[int, dict[str, str], bytes]:
        """A whole answer: ``(status, headers without hop-by-hop ones, body)``.

        Raises:
            ENGINE_ERRORS: as ``open``, or the body broke.
        """
        resp = await self.open(method, url, body, headers, timeout_s)
        try:
            data = b"".join([c async for c in resp.chunks()])
        finally:
            await resp.close()
        return resp.status, resp.headers, data

    async def close(self) -> None:
        """Close every pooled connection (the client may be used again: a new pool)."""
        session, self._session = self._session, None  # a call meanwhile gets a new pool
        if session is not None:
            await session.close()
