"""API keys, tenants and their cache salts (router/serve/auth.py), without engines."""

from __future__ import annotations

import json
import os

import pytest

from router.config import Settings, redact_url
from router.hashing import BlockHasher
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH
from router.serve.auth import (
    ApiKeys,
    Tenant,
    hash_key,
    main,
    new_key,
    tenant_cache_salt,
)
from router.serve.errors import OpenAIError
from router.serve.ingress import IngressCore


def _doc(*entries) -> str:
    return json.dumps({"keys": list(entries)})


def test_keys_map_to_tenants_and_refusals_are_openai_401_and_403(tmp_path):
    alice, ops = new_key(), new_key()
    path = tmp_path / "keys.json"
    path.write_text(_doc({"sha256": hash_key(alice), "tenant": "alice"},
                         {"sha256": hash_key(ops), "tenant": "ops", "admin": True}))
    keys = ApiKeys(str(path))
    assert keys.enabled and alice.startswith("sk-pr-") and len(alice) > 40
    assert keys.authenticate(f"Bearer {alice}") == Tenant("alice")
    assert keys.authenticate(f"bearer   {alice} ") == Tenant("alice")
    assert keys.authorize_admin(f"Bearer {ops}") == Tenant("ops", admin=True)
    for header in (None, "", "Bearer", "Basic " + alice, alice, "Bearer " + alice + "x",
                   "Bearer " + hash_key(alice)):
        with pytest.raises(OpenAIError) as err:
            keys.authenticate(header)
        body = err.value.body()["error"]
        assert err.value.status == 401 and body["type"] == "AuthenticationError"
        assert body["code"] == 401 and body["message"]
        assert alice not in body["message"]  # a key is never echoed
        assert err.value.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(OpenAIError) as err:
        keys.authorize_admin(f"Bearer {alice}")
    assert err.value.status == 403 and err.value.body()["error"]["type"] == \
        "PermissionDeniedError"
    assert "sha256" in path.read_text() and alice not in path.read_text()


def test_keys_off_lets_everyone_in_and_checks_nothing():
    keys = ApiKeys(None, None)
    assert not keys.enabled
    assert keys.authenticate(None) is None and keys.authorize_admin("Bearer x") is None


def test_the_keys_file_is_reloaded_on_change_and_a_broken_edit_keeps_the_old_keys(tmp_path):
    a, b = new_key(), new_key()
    path = tmp_path / "keys.json"
    path.write_text(_doc({"sha256": hash_key(a), "tenant": "a"}))
    keys = ApiKeys(str(path), check_every_s=0.0)
    assert keys.authenticate(f"Bearer {a}").name == "a"
    path.write_text(_doc({"sha256": hash_key(b), "tenant": "b"}))
    assert keys.authenticate(f"Bearer {b}").name == "b"  # added without a restart
    with pytest.raises(OpenAIError):
        keys.authenticate(f"Bearer {a}")  # revoked without a restart
    path.write_text("{not json")
    assert keys.authenticate(f"Bearer {b}").name == "b"  # a broken edit locks no one out


def test_a_missing_or_invalid_keys_document_stops_the_start(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ApiKeys(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(_doc({"sha256": "plaintext-key", "tenant": "a"}))
    with pytest.raises(ValueError, match="invalid API keys"):
        ApiKeys(str(bad))
    with pytest.raises(ValueError, match="PREFIX_ROUTER_API_KEYS"):
        ApiKeys(None, '{"keys": [{"tenant": "a"}]}')


def test_inline_keys_from_the_environment(monkeypatch):
    k = new_key()
    monkeypatch.setenv("PREFIX_ROUTER_API_KEYS", _doc({"sha256": hash_key(k), "tenant": "t"}))
    s = Settings()
    keys = ApiKeys(s.api_keys_file, s.api_keys)
    assert keys.authenticate(f"Bearer {k}").name == "t"
    assert s.redacted()["api_keys"] == "***" and k not in json.dumps(s.redacted())


def test_the_new_key_command_prints_the_key_once_and_stores_its_hash(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert main(["new-key", "--tenant", "acme", "--file", str(path)]) == 0
    assert main(["new-key", "--tenant", "ops", "--admin", "--file", str(path)]) == 0
    first, second = capsys.readouterr().out.split()
    keys = ApiKeys(str(path))
    assert keys.authenticate(f"Bearer {first}") == Tenant("acme")
    assert keys.authorize_admin(f"Bearer {second}").admin
    assert first not in path.read_text() and oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_the_revoke_command_drops_a_key_and_a_running_router_refuses_it(tmp_path, capsys):
    path = tmp_path / "keys.json"
    for tenant in ("acme", "acme", "ops"):
        assert main(["new-key", "--tenant", tenant, "--file", str(path)]) == 0
    a1, a2, ops = capsys.readouterr().out.split()
    keys = ApiKeys(str(path), check_every_s=0.0)  # a router: reloads a changed file
    assert keys.authenticate(f"Bearer {a1}") == Tenant("acme")
    assert main(["revoke", "--file", str(path), "--key", a1]) == 0
    with pytest.raises(OpenAIError) as exc:
        keys.authenticate(f"Bearer {a1}")
    assert exc.value.status == 401
    assert keys.authenticate(f"Bearer {a2}") == Tenant("acme")
    assert main(["revoke", "--file", str(path), "--sha256", hash_key(ops).upper()]) == 0
    assert main(["revoke", "--file", str(path), "--tenant", "acme"]) == 0
    assert json.loads(path.read_text())["keys"] == []
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    before = path.read_text()
    assert main(["revoke", "--file", str(path), "--tenant", "nobody"]) == 1
    assert path.read_text() == before


def test_cache_salts_part_tenants_and_join_a_cache_group():
    a, b = Tenant("a"), Tenant("b")
    assert tenant_cache_salt(a, None, None) != tenant_cache_salt(b, None, None)
    assert tenant_cache_salt(a, None, None) == tenant_cache_salt(a, None, None)
    assert tenant_cache_salt(Tenant("a-eu", cache_group="a"), None, None) == \
        tenant_cache_salt(a, None, None)
    assert tenant_cache_salt(a, None, None).startswith("t-")
    assert tenant_cache_salt(a, None, "k1") != tenant_cache_salt(a, None, "k2")
    # a client's own salt splits its tenant's cache further, never reaches another's
    assert tenant_cache_salt(a, "u1", None).startswith(tenant_cache_salt(a, None, None) + ":")
    assert tenant_cache_salt(b, "u1", None) != tenant_cache_salt(a, "u1", None)


@pytest.fixture
def ingress(model_dir):
    return IngressCore(Settings(model=str(model_dir), block_size=16), engine_handle=None)


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_a_tenants_request_carries_its_salt_and_hashes_with_it(ingress, path):
    """The forwarded body carries the tenant's ``cache_salt`` (the engine keeps the
    tenant's blocks apart) and the router's block hashes are the salted ones (they match
    only the tenant's own entries). A salt the client sent cannot name another tenant."""
    text = "You are a helpful assistant. " * 20
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]} \
        if path == CHAT_PATH else {"model": "m", "max_tokens": 1, "prompt": text}
    raw = json.dumps(body).encode()
    plain = await ingress.prepare(path, raw)
    a = await ingress.prepare(path, raw, tenant=Tenant("a"))
    a2 = await ingress.prepare(path, raw, tenant=Tenant("a"))
    b = await ingress.prepare(path, raw, tenant=Tenant("b"))
    assert plain.body == raw and "cache_salt" not in json.loads(plain.body)
    sent = json.loads(a.body)
    assert sent["cache_salt"] == tenant_cache_salt(Tenant("a"), None, None)
    assert {k: v for k, v in sent.items() if k != "cache_salt"} == body
    assert len(a.block_hashes) == len(plain.block_hashes) > 2
    assert a.block_hashes == a2.block_hashes
    assert not set(a.block_hashes) & set(plain.block_hashes)
    assert not set(a.block_hashes) & set(b.block_hashes)
    ids = ingress.renderer.render(path, json.loads(a.body)).token_ids
    assert a.block_hashes == BlockHasher(ingress.settings.hash_settings).block_hashes(
        ids, cache_salt=sent["cache_salt"])
    # B names A's salt itself: it lands inside B's own salt
    forged = dict(body, cache_salt=sent["cache_salt"])
    b_forged = await ingress.prepare(path, json.dumps(forged).encode(), tenant=Tenant("b"))
    assert json.loads(b_forged.body)["cache_salt"].startswith(
        tenant_cache_salt(Tenant("b"), None, None) + ":")
    assert not set(b_forged.block_hashes) & set(a.block_hashes)


async def test_isolation_off_forwards_the_body_untouched(model_dir):
    core = IngressCore(Settings(model=str(model_dir), tenant_cache_isolation=False),
                       engine_handle=None)
    raw = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()
    assert (await core.prepare(COMPLETIONS_PATH, raw, tenant=Tenant("a"))).body == raw


def test_secrets_are_masked_in_what_is_logged():
    assert redact_url("redis://u:secret@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url("rediss://:secret@h:6380") == "rediss://:***@h:6380"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    s = Settings(redis_url="redis://router:pw123@127.0.0.1:6379/0", cache_salt_secret="zz")
    shown = json.dumps(s.redacted())
    assert "pw123" not in shown and "zz" not in shown and "127.0.0.1:6379" in shown
