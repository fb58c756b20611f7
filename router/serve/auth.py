"""API keys and tenants: who may call the router, and whose cache a request may share.

Clients authenticate as with OpenAI's API: ``Authorization: Bearer <key>``. Keys are stored
hashed (SHA-256 of the key's UTF-8 bytes, hex), in a JSON document read from
``Settings.api_keys_file`` (re-read when the file changes, without a restart) and/or given
whole in ``Settings.api_keys`` (``PREFIX_ROUTER_API_KEYS``, for secrets injected as
environment variables)::

    {"keys": [{"sha256": "<64 hex digits>", "tenant": "acme"},
              {"sha256": "...", "tenant": "ops", "admin": true},
              {"sha256": "...", "tenant": "acme-eu", "cache_group": "acme"}]}

A plain SHA-256 suffices at rest because keys are random 256-bit tokens, not passwords: no
dictionary reaches them, so a slow password hash would add per-request cost and no safety
(vLLM's own ``--api-key`` check hashes with SHA-256 the same way). ``python -m
router.serve.auth new-key --tenant acme --file keys.json`` makes a key, prints it once, and
stores only its hash.

Each key maps to a tenant. Tenants are kept apart in the engines' prefix caches by vLLM's own
``cache_salt`` request field (``tenant_cache_salt``): the engine mixes it into the hash of a
prompt's first block, so every block hash of one tenant's prompt differs from another's, the
engine shares no block between them, and the router's block hashes (computed with the same
salt, ``router.hashing``) match only the tenant's own entries. Tenants that declare the same
``cache_group`` share their cache on purpose. docs/security.md has the threat model.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.logs import get_logger
from router.serve.errors import OpenAIError

logger = get_logger(__name__)

KEY_PREFIX = "sk-pr-"  # marks the router's keys (as OpenAI's "sk-"), so leaks are searchable


class KeyEntry(BaseModel):
    """One key of the keys document: its hash and what it may do."""

    model_config = ConfigDict(extra="forbid")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="SHA-256 of the key's UTF-8 bytes, lowercase hex.")
    tenant: str = Field(min_length=1, max_length=128, description="The tenant the key is.")
    admin: bool = Field(False, description="May call the operator endpoints (/replicas, "
                                           "/metrics, /admin/...).")
    cache_group: Optional[str] = Field(
        None, min_length=1, max_length=128,
        description="Tenants of one group share their prefix cache on purpose; default: the "
                    "tenant alone.")
    priority: int = Field(0, ge=-2**31 + 1, le=2**31 - 1,
                          description="The tenant's priority (lower first): its requests' "
                                      "default, and the most urgent they may ask for.")
    requests_per_minute: Optional[int] = Field(
        None, ge=1, description="Most requests per sliding minute (429 beyond); none: no "
                                "limit.")
    tokens_per_minute: Optional[int] = Field(
        None, ge=1, description="Most tokens per sliding minute, prompt plus the most each "
                                "request may generate (429 beyond); none: no limit.")


class KeysDocument(BaseModel):
    """The keys file / ``PREFIX_ROUTER_API_KEYS`` document."""

    model_config = ConfigDict(extra="forbid")
    keys: list[KeyEntry]


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller.

    Attributes:
        name: the tenant of its key.
        admin: whether it may call the operator endpoints.
        cache_group: whose prefix cache its requests share (the tenant's own by default).
        priority: its requests' default priority, and the most urgent they may ask for.
        requests_per_minute / tokens_per_minute: its rate limits, or None
            (``router.serve.ratelimit``).
    """

    name: str
    admin: bool = False
    cache_group: str = ""
    priority: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def group(self) -> str:
        return self.cache_group or self.name


def hash_key(key: str) -> str:
    """SHA-256 of ``key``'s UTF-8 bytes, lowercase hex (64 characters)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    """A new random API key: ``sk-pr-`` and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenant_cache_salt(tenant: Tenant, client_salt: str | None, secret: str | None) -> str:
    """The ``cache_salt`` the router sends for ``tenant``'s request.

    HMAC-SHA256 (RFC 2104) of the tenant's cache group under ``secret`` (the setting
    ``cache_salt_secret``; a fixed key when unset), hex, so a salt does not name its tenant
    and, with a secret, cannot be derived by whoever reaches an engine directly. A salt the
    client sent itself (vLLM's per-user isolation) is kept inside the tenant's: it splits the
    tenant's cache further but can never reach another tenant's.

    Returns:
        ``"t-<64 hex>"``, or ``"t-<64 hex>:<client salt>"``.
    """
    key = (secret or "prefix-router cache salt").encode()
    mac = hmac.new(key, tenant.group.encode("utf-8", "surrogatepass"), hashlib.sha256)
    salt = "t-" + mac.hexdigest()
    return f"{salt}:{client_salt}" if client_salt else salt


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, "AuthenticationError",
                       headers={"www-authenticate": 'Bearer realm="prefix-router"'})


class ApiKeys:
    """The keys the ingress accepts, reloaded when their file changes.

    Args:
        path: the keys file (JSON, ``KeysDocument``), or None.
        inline: the same document as a JSON string (``PREFIX_ROUTER_API_KEYS``), or None.
        check_every_s: how often the file's modification time is looked at (s).
    Raises:
        ValueError: at construction, when the file is missing or a document is invalid
            (a service meant to check keys must not start open). A later reload that
            fails keeps the keys already loaded and logs the error.
    """

    def __init__(self, path: str | None, inline: str | None = None,
                 check_every_s: float = 1.0):
        self.path = Path(path) if path else None
        self.check_every_s = check_every_s
        self._inline = self._parse(inline, "PREFIX_ROUTER_API_KEYS") if inline else {}
        self._file: dict[str, Tenant] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if self.path is not None:
            if not self.path.is_file():
                raise ValueError(f"api_keys_file {self.path} does not exist; make one with "
                                 "python -m router.serve.auth new-key --tenant NAME --file "
                                 f"{self.path}")
            self._reload(strict=True)

    @property
    def enabled(self) -> bool:
        """Whether keys are checked at all (a keys file or document is configured)."""
        return self.path is not None or bool(self._inline)

    @staticmethod
    def _parse(text: str, where: str) -> dict[str, Tenant]:
        try:
            doc = KeysDocument.model_validate_json(text)
        except ValidationError as exc:
            raise ValueError(f"invalid API keys document in {where}: {exc}") from None
        return {e.sha256: Tenant(e.tenant, e.admin, e.cache_group or "", e.priority,
                                 e.requests_per_minute, e.tokens_per_minute)
                for e in doc.keys}

    def _reload(self, strict: bool = False) -> None:
        assert self.path is not None
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # a rewrite is a new inode
            if stamp == self._stamp:
                return
            self._file = self._parse(self.path.read_text(), str(self.path))
            self._stamp = stamp
            logger.info("API keys loaded from %s: %d keys", self.path, len(self._file))
        except (OSError, ValueError) as exc:
            if strict:
                raise ValueError(str(exc)) from None
            logger.error("API keys file %s not reloaded (the %d keys loaded before stay in "
                         "force): %s", self.path, len(self._file), exc)

    def _maybe_reload(self) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        with self._lock:
            if now - self._checked >= self.check_every_s:
                self._checked = now
                self._reload()

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of a request's ``Authorization`` header; None when keys are off.

        Raises:
            OpenAIError: 401 (OpenAI's ``AuthenticationError``) when the header is missing,
                not ``Bearer``, or names no known key.
        """
        if not self.enabled:
            return None
        if not authorization:
            raise _unauthorized("You didn't provide an API key. Send it in the Authorization "
                                "header: 'Authorization: Bearer YOUR_KEY'.")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.")
        self._maybe_reload()
        digest = hash_key(key.strip())
        tenant = self._inline.get(digest) or self._file.get(digest)
        if tenant is None:
            raise _unauthorized("Incorrect API key provided.")
        return tenant

    def authorize_admin(self, authorization: str | None) -> Tenant | None:
        """``authenticate``, then require an admin key; None when keys are off.

        Raises:
            OpenAIError: 401 as ``authenticate``; 403 (``PermissionDeniedError``) for a
                valid key that is not an admin's.
        """
        tenant = self.authenticate(authorization)
        if tenant is not None and not tenant.admin:
            raise OpenAIError(403, "This endpoint needs an admin API key.",
                              "PermissionDeniedError")
        return tenant


def _write_keys(path: Path, doc: dict) -> None:
    """Write a keys document atomically with mode 0600 (a router reloading meanwhile reads
    the old or the new file). Raises pydantic.ValidationError for an invalid document."""
    KeysDocument.model_validate(doc)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def _add_key(args: argparse.Namespace) -> int:
    key = new_key()
    path = Path(args.file)
    doc = json.loads(path.read_text()) if path.exists() else {"keys": []}
    entry = {"sha256": hash_key(key), "tenant": args.tenant}
    if args.admin:
        entry["admin"] = True
    if args.cache_group:
        entry["cache_group"] = args.cache_group
    doc["keys"].append(entry)
    _write_keys(path, doc)
    print(key)
    print(f"stored its SHA-256 for tenant {args.tenant!r} in {path}; the key is not stored "
          "and is shown only now", file=sys.stderr)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    """Drop the entries of a key (``--key``, or its ``--sha256``) or of every key of a
    ``--tenant`` from the file; 1 (and the file unchanged) when none matches."""
    path = Path(args.file)
    doc = json.loads(path.read_text())
    digest = hash_key(args.key) if args.key else (args.sha256 or "").lower()
    keep = [e for e in doc.get("keys", [])
            if not ((digest and str(e.get("sha256", "")).lower() == digest)
                    or (args.tenant is not None and e.get("tenant") == args.tenant))]
    gone = len(doc.get("keys", [])) - len(keep)
    if not gone:
        print(f"no key in {path} matches: nothing revoked", file=sys.stderr)
        return 1
    doc["keys"] = keep
    _write_keys(path, doc)
    print(f"revoked {gone} key(s) in {path}; each ingress process reloads the file within "
          "a second", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m router.serve.auth new-key --tenant NAME --file FILE [--admin]
    [--cache-group GROUP]``: print a new key and add its hash to FILE;
    ``python -m router.serve.auth revoke --file FILE (--key KEY | --sha256 HASH |
    --tenant NAME)``: drop that key (or the tenant's keys) from FILE;
    ``python -m router.serve.auth hash KEY``: print a key's hash."""
    p = argparse.ArgumentParser(prog="python -m router.serve.auth", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    nk = sub.add_parser("new-key", help="make a key, print it once, store its hash")
    nk.add_argument("--tenant", required=True)
    nk.add_argument("--file", required=True)
    nk.add_argument("--admin", action="store_true")
    nk.add_argument("--cache-group")
    rk = sub.add_parser("revoke", help="drop a key, or every key of a tenant, from FILE")
    rk.add_argument("--file", required=True)
    which = rk.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", help="the key itself (seen by ps and kept in shell "
                                     "history: --sha256 is safer)")
    which.add_argument("--sha256", help="the key's SHA-256 (as stored in FILE)")
    which.add_argument("--tenant", help="every key of this tenant")
    hk = sub.add_parser("hash", help="print the SHA-256 of a key (for a keys document)")
    hk.add_argument("key")
    args = p.parse_args(argv)
    if args.cmd == "new-key":
        return _add_key(args)
    if args.cmd == "revoke":
        return _revoke(args)
    print(hash_key(args.key))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
