"""Every Redis key name and every Lua script of the router, in one place.

Key layout (``<ns>`` is ``Settings.index_namespace``; only hashes and counters, never text).
On one Redis the keys of the index and of the load are as listed below. With shard groups
(``Settings.index_shard_groups``, the Redis Cluster mode; ``ShardGroups``), each of them
that the route script touches carries its group's hash tag instead: ``<ns>:{<tag>}:x:<replica>``,
``<ns>:{<tag>}:p:<replica>``, ``<ns>:{<tag>}:gone:<replica>``, ``<ns>:{<tag>}:replicas``,
``<ns>:{<tag>}:roots``,
``<ns>:{<tag>}:load``, ``<ns>:{<tag>}:leases``, ``<ns>:{<tag>}:router:<id>``, so that a
group's keys hash to one slot, hence one shard (Redis Cluster hashes only the part in
braces: redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/, "Hash tags").
The other keys (sessions, drained set, leases of the warm-up and of the feeders) are read
and written one key per command, so they need no tag; a tenant's rate counters, read
together by one script, share the tag of the tenant's digest.

Block hashes are field names of 8 bytes (the 64-bit hash, big-endian: ``block_fields``).
Each hash of the index (``<ns>:x:<replica>``, ``<ns>:p:<replica>``, ``<ns>:roots``) is made
with one more field, ``TABLE_FIELD``, that keeps Redis's encoding a hash table
(``lua/sweep.lua`` ``as_table``): its entries are its length less one.

* ``<ns>:x:<replica>``: hash ``block hash -> "<physical copies>,<held children>,<parent>"``
  of the blocks the engine holds (exact entries, from KV events; ``lua/apply_events.lua``);
  its ``TABLE_FIELD``'s value begins with the count of held blocks whose parent is not held
  (no digits at 0; ``lua/exact.lua``: while it is 0 the route script finds a prompt's held
  run by a search of a few reads);
* ``<ns>:p:<replica>``: hash ``block hash -> expiry (ms)`` of predicted entries; the hash
  expires with its latest entry and expired fields are swept a few at a time on each write
  (Redis 7.0 has no per-field TTL; ``lua/record_predicted.lua``); no live entry expires
  later than its parent, unless the hash is marked out of order: its ``TABLE_FIELD``'s
  value then begins with the time (ms) until which it may be (``lua/sweep.lua``: while it
  is in order the route script finds a prompt's predicted run by a search);
* ``<ns>:gone:<replica>``: tombstone of a replica that left (the routers or the replica
  itself purged it), expiring after ``GONE_TTL_S``: while it lives, ``lua/apply_events.lua``
  refuses the replica's writes, so a feed that still runs during its replica's shutdown, or
  that takes the purge for a lost index and rebuilds, cannot bring its entries back (Serve
  never reuses a replica id);
* ``<ns>:roots``: hash ``root block hash -> its holders`` (a zero byte, then each replica
  id followed by a zero byte): the replicas that may hold a prompt's first block, exactly
  or predicted; every replica that holds it is listed, some listed may not hold it any more
  (``lua/roots.lua``; the route script walks only the listed candidates; a sweep beside it,
  ``<ns>:roots:cursor`` and ``<ns>:roots:swept``, drops those that hold it no more);
* ``<ns>:replicas``: set of the replicas with entries (for ``stats``);
* ``<ns>:load``: hash with ``<replica>:n`` (requests in flight), ``<replica>:p`` (queued
  prefill tokens), ``<replica>:t`` (time of its last assignment, ms) (``LoadField``);
* ``<ns>:leases``: hash ``request id -> "replica|prefill tokens|prefill done (0/1)|router
  id"`` (``lua/lease.lua``);
* ``<ns>:router:<id>``: a router's heartbeat, expiring after its TTL; the leases of a router
  whose heartbeat is gone are released by any router's sweep;
* ``<ns>:session:<digest>``: a session's replica, expiring after ``Settings.session_ttl_s``
  (``router.routing.sessions``);
* ``<ns>:warmup:<reason>:<replica>``: the lease (``SET NX`` with a TTL) of the one ingress
  process that warms a replica that joined (``scale_out``) or re-homes the prefixes of one
  that left (``rehome``); the prefixes' token ids stay in that process's memory;
* ``<ns>:feeder:<replica>``: the lease (``SET NX`` with a TTL, renewed) of the one ingress
  process that writes the KV events of an engine reached by URL (``replicas.external``);
* ``<ns>:layouts``: hash ``layout version -> expiry (ms)`` of the presence of the routers
  that use the namespace with that layout (``LAYOUT_VERSION``; ``router.index.layout``);
* ``<ns>:rate:{<tenant digest>}:<kind>:<window>``: a tenant's requests or tokens in one
  minute window (``lua/rate_limit.lua``; the tenant's name is not stored, only the first 16
  hex digits of its SHA-256; the braces put a tenant's counters in one cluster slot).

The scripts live beside this module in ``lua/``; ``Scripts`` registers them on a client by
name.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
import re
import struct
from typing import Any, Sequence

from router.index.base import GONE_TTL_S  # noqa: F401 - the tombstone's TTL, named here too

_LUA_DIR = Path(__file__).with_name("lua")

# The version of the layout above: raise it with every change of a key's name, type or
# value format that a router of the previous version would misread. Routers of two layouts
# never use one namespace's keys at the same time (router.index.layout).
LAYOUT_VERSION = 4  # 2: the index's hashes carry TABLE_FIELD; 3: exact entries keep parents;
# 4: predicted hashes kept in order (lua/sweep.lua), or marked out of order


def check_replica_id(replica: str) -> str:
    """``replica`` itself, if the Redis index can store it: the root holders
    (``lua/roots.lua``) list replica ids each after a zero byte, so an id must be non-empty
    and hold no zero byte (Ray Serve's replica ids and ``Settings.external_engines``' names
    never do).

    Raises:
        ValueError: an empty id, or one with a zero byte.
    """
    if not replica or "\0" in replica:
        raise ValueError(f"a replica id must be non-empty, without a zero byte: {replica!r}")
    return replica


class RedisKeys:
    """The key names of one namespace, or of one shard group of it.

    Args:
        namespace: the prefix of every key (``Settings.index_namespace``).
        tag: the hash tag of a shard group (``ShardGroups.tags``), or None (one Redis: the
            keys as they are without groups). With a tag, the keys the route script touches
            (entries, tombstones, replicas set, load, leases, heartbeats) are
            ``<ns>:{<tag>}:...``; the others are the same as without.
    """

    def __init__(self, namespace: str, tag: str | None = None):
        self.namespace = namespace
        self.tag = tag
        base = f"{namespace}:{{{tag}}}" if tag is not None else namespace
        self.base = base
        self.load = f"{base}:load"
        self.leases = f"{base}:leases"
        self.replicas = f"{base}:replicas"
        self.router_prefix = f"{base}:router:"
        self.session_prefix = f"{namespace}:session:"  # + session digest: its replica
        self.drained = f"{namespace}:drained"  # set of the replicas an operator drained
        self.layouts = f"{namespace}:layouts"  # layout version -> expiry of its presence

    def exact(self, replica: str) -> str:
        """The replica's exact entries (block hash -> copies).

        Raises:
            ValueError: an empty replica id, or one with a zero byte (``check_replica_id``).
        """
        return f"{self.base}:x:{check_replica_id(replica)}"

    def predicted(self, replica: str) -> str:
        """The replica's predicted entries (block hash -> expiry ms).

        Raises:
            ValueError: as ``exact``.
        """
        return f"{self.base}:p:{check_replica_id(replica)}"

    @property
    def roots(self) -> str:
        """The root holders: a prompt's first block -> the replicas that may hold it
        (``lua/roots.lua``; the route script walks only those)."""
        return f"{self.base}:roots"

    def replica_entries(self, replica: str) -> list[str]:
        """The replica's exact then predicted hash: the pair ``lua/route.lua`` reads per
        candidate."""
        return [self.exact(replica), self.predicted(replica)]

    def gone(self, replica: str) -> str:
        """The tombstone of a replica that left (``GONE_TTL_S``)."""
        return f"{self.base}:gone:{replica}"

    def feeder(self, replica: str) -> str:
        """The lease of the router process that writes an external engine's KV events
        (``replicas.external``): its process tag, with a TTL."""
        return f"{self.namespace}:feeder:{replica}"

    def warmup_lease(self, key: str) -> str:
        """The lease of the ingress process that warms a replica (``router.routing.warmup``):
        ``key`` is ``<reason>:<replica id>``; the value is ``1``, with a TTL."""
        return f"{self.namespace}:warmup:{key}"

    def heartbeat(self, router_id: str) -> str:
        """A router's heartbeat key."""
        return self.router_prefix + router_id

    def rate(self, tenant: str, kind: str, window: int) -> str:
        """A tenant's counter of ``kind`` (``requests`` or ``tokens``) in window number
        ``window`` (now // window length). The digest is the key's hash tag: a tenant's
        counters, which ``lua/rate_limit.lua`` reads together, lie in one cluster slot."""
        import hashlib

        digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return f"{self.namespace}:rate:{{{digest}}}:{kind}:{window}"

    def pattern(self) -> str:
        """``SCAN`` pattern of every key of the namespace (its glob characters escaped).
        It also matches the keys of a namespace that begins with this one and a colon
        (``<ns>:canary``): ``own_keys`` leaves those out."""
        return re.sub(r"([*?\[\]\\])", r"\\\1", self.namespace) + ":*"

    def kind(self, key: bytes) -> str | None:
        """The kind of ``key`` (the word after ``<ns>:``, one of ``KINDS``; ``"group"`` for
        a shard group's ``<ns>:{<tag>}:...``), or None for a key that is not this
        namespace's: another namespace's, or one that begins with this one and a colon
        (``<ns>:canary:x:...``)."""
        prefix = self.namespace.encode() + b":"
        if not key.startswith(prefix):
            return None
        word = key[len(prefix):].split(b":", 1)[0]
        if word.startswith(b"{"):
            return "group"
        word = word.decode("utf-8", "replace")
        return word if word in KINDS else None

    async def own_keys(self, client, kinds: Sequence[str] = ()):
        """Yield (async) the namespace's keys (bytes) of ``kinds`` (default: every kind
        and the shard groups' keys), found by ``SCAN`` (on a cluster client, on every
        master). The keys of a namespace that begins with this one and a colon are not
        this one's and are never yielded."""
        wanted = set(kinds) if kinds else set(KINDS) | {"group"}
        async for key in client.scan_iter(match=self.pattern(), count=1000):
            if self.kind(key) in wanted:
                yield key


# The kinds of key a namespace holds: the word after ``<ns>:`` in the layout above (a shard
# group's keys have their hash tag there instead: kind "group").
KINDS = ("x", "p", "gone", "roots", "replicas", "load", "leases", "router", "session",
         "warmup", "feeder", "rate", "drained", "layouts")


CLUSTER_SLOTS = 16384  # Redis Cluster's hash slots (the cluster spec's "Keys distribution model")


def group_tag(group: int, groups: int) -> str:
    """The hash tag of shard group ``group`` of ``groups``: ``g<group>``, or the first
    ``g<group>.<j>`` (j = 1, 2, ...) whose slot lies in the group's share of the slot space,
    ``[group * 16384 / groups, (group + 1) * 16384 / groups)``.

    ``redis-cli --cluster create`` gives each master an equal run of slots, so the groups
    then spread evenly over the masters (``{g0}``, ``{g1}``, ``{g2}`` alone hash to slots
    13907, 9842 and 5649, which can land on one master). The slot is Redis's CRC16 of the
    tag (``redis.crc.key_slot``). Every router computes the same tags from ``groups``.

    Raises:
        ValueError: ``group`` outside ``[0, groups)``, or ``groups`` outside
            ``[1, 16384]``.
    """
    from redis.crc import key_slot

    if not 1 <= groups <= CLUSTER_SLOTS or not 0 <= group < groups:
        raise ValueError(f"group {group} of {groups}: need 0 <= group < groups <= "
                         f"{CLUSTER_SLOTS}")
    j = 0
    while True:
        tag = f"g{group}" if j == 0 else f"g{group}.{j}"
        if key_slot(tag.encode()) * groups // CLUSTER_SLOTS == group:
            return tag
        j += 1


class ShardGroups:
    """The fleet's replicas partitioned into shard groups, and each group's key names.

    A group's keys carry its hash tag (``group_tag``), so they lie in one cluster slot: the
    route script over a group's replicas is one round trip to one shard. A replica belongs
    to the group of highest rendezvous weight (highest random weight hashing, Thaler and
    Ravishankar 1998): BLAKE2b-64 of ``"<replica>\0<group>"``, so every router assigns
    alike without talking to the others, and a change in ``groups`` moves only about
    ``1 / groups`` of the replicas per group added.

    Args:
        namespace: ``Settings.index_namespace``.
        groups: the number of shard groups (``Settings.index_shard_groups``), or None:
            one Redis, one group whose keys carry no tag (the layout without groups).
    Raises:
        ValueError: ``groups`` outside ``[1, 16384]``.
    """

    def __init__(self, namespace: str, groups: int | None = None):
        if groups is not None and not 1 <= groups <= CLUSTER_SLOTS:
            raise ValueError(f"index_shard_groups must be in [1, {CLUSTER_SLOTS}], "
                             f"got {groups}")
        if groups is not None and ("{" in namespace or "}" in namespace):
            raise ValueError(f"with shard groups the namespace may hold no brace (its "
                             f"keys' first {{...}} must be the group's tag): {namespace!r}")
        self.namespace = namespace
        self.tagged = groups is not None
        self.count = groups or 1
        self.tags: list[str | None] = [group_tag(k, groups) for k in range(groups)] \
            if groups else [None]
        self.keys = [RedisKeys(namespace, t) for t in self.tags]
        self._of: dict[str, int] = {}

    def group_of(self, replica: str) -> int:
        """The group of ``replica``, in ``[0, count)`` (0 without groups)."""
        g = self._of.get(replica)
        if g is None:
            if self.count == 1:
                g = 0
            else:
                import hashlib

                raw = replica.encode("utf-8", "surrogatepass")
                g = max(range(self.count), key=lambda k: hashlib.blake2b(
                    raw + b"\0" + str(k).encode(), digest_size=8).digest())
            self._of[replica] = g
        return g

    def keys_of(self, replica: str) -> RedisKeys:
        """The key names of ``replica``'s group."""
        return self.keys[self.group_of(replica)]

    def split(self, replicas: Sequence[str]) -> dict[int, list[str]]:
        """``replicas`` by group, each list in the order given; groups in order of their
        first replica."""
        out: dict[int, list[str]] = {}
        for r in replicas:
            out.setdefault(self.group_of(r), []).append(r)
        return out


class LoadField(str, Enum):
    """The suffixes of a replica's fields in the load hash (``<replica>:<suffix>``)."""

    INFLIGHT = "n"
    PREFILL_TOKENS = "p"
    LAST_ASSIGNED_MS = "t"
    PLACEMENTS = "k"       # new prefixes placed there, a decaying count (ReplicaLoad)
    PLACEMENTS_AT_MS = "kt"

    def of(self, replica: str) -> str:
        """The field name for ``replica``."""
        return f"{replica}:{self.value}"


class EventOp(str, Enum):
    """The op letters of ``lua/apply_events.lua``."""

    STORED = "s"            # BlockStored with a parent (its hash first): one more copy of each hash
    STORED_FROM_ROOT = "S"  # BlockStored from block 0: a copy of each hash not yet held
    STORED_UNKNOWN_PARENT = "u"  # blocks stored after parents not known: one more copy of each
    REMOVED = "r"           # BlockRemoved: one copy fewer
    CLEARED = "c"           # AllBlocksCleared: drop the replica's exact and predicted entries
    PURGE = "x"             # the replica left: drop its entries


def load_lua(name: str) -> str:
    """Source of ``router/lua/<name>.lua``, a line ``--! include <file>`` replaced by that
    file of the same folder (Redis runs each script alone: a function two scripts share,
    such as ``sweep.lua``'s, is put into both).

    Raises:
        FileNotFoundError: no such script, or no such included file.
    """
    lines = (_LUA_DIR / f"{name}.lua").read_text().splitlines(keepends=True)
    return "".join((_LUA_DIR / line.split()[2]).read_text()
                   if line.startswith("--! include ") else line for line in lines)


class Scripts:
    """The router's Lua scripts registered on one client (``redis.asyncio.Redis``), by
    name: ``route``, ``lease``, ``record_predicted``, ``forget_predicted``, ``apply_events``,
    ``rate_limit``, ``layout``, ``drained``.
    Registering sends nothing; the first call loads a script (``EVALSHA``, then ``EVAL``
    on a miss)."""

    NAMES = ("route", "lease", "record_predicted", "forget_predicted", "apply_events",
             "rate_limit", "layout", "drained")
    _sources: dict[str, str] = {}
    route: Any  # redis.commands.core.AsyncScript, each
    lease: Any
    record_predicted: Any
    forget_predicted: Any
    apply_events: Any
    rate_limit: Any
    layout: Any
    drained: Any

    def __init__(self, client):
        for name in self.NAMES:
            src = self._sources.get(name)
            if src is None:
                src = self._sources[name] = load_lua(name)
            setattr(self, name, client.register_script(src))


class ScriptCache:
    """``Scripts`` per client: one registration per client (one client per event loop)."""

    def __init__(self):
        self._by_client: dict[int, Scripts] = {}

    def of(self, client) -> Scripts:
        """The scripts registered on ``client``."""
        s = self._by_client.get(id(client))
        if s is None:
            s = self._by_client[id(client)] = Scripts(client)
        return s


# Every command the router sends to Redis, its scripts' own calls included (Redis checks
# those against the caller's ACL too); redis-py's script calls need EVALSHA, and EVAL or
# SCRIPT LOAD / SCRIPT EXISTS when a script is not cached yet (its CLIENT SETINFO on connect,
# Redis 7.2+, may be refused: redis-py ignores the error). tests/test_index.py and
# tests/test_route_lua.py run under exactly this set.
ACL_COMMANDS = (
    "evalsha", "eval", "script|load", "script|exists", "multi", "exec", "discard", "ping",
    "get", "set", "del", "exists", "scan", "pexpire", "pexpireat", "pttl", "incrby",
    "hget", "hmget", "hset", "hsetnx", "hdel", "hincrby", "hgetall", "hscan", "hlen",
    "sadd", "srem", "smembers",
)


# What redis-py's cluster client (``redis.asyncio.cluster.RedisCluster``) sends beside the
# router's own commands: ``CLUSTER SLOTS`` (the slot map, when it connects and after a
# MOVED), ``COMMAND`` (the command table that says where each command's keys are) and
# ``ASKING`` (to follow an ASK redirect while a slot migrates, when shards are added).
# Without the first two it cannot connect (tests/test_redis_cluster.py).
ACL_CLUSTER_COMMANDS = ("cluster|slots", "command", "asking")


def acl_rules(namespace: str = "prefix-router", cluster: bool = False) -> list[str]:
    """The rules of a Redis ACL user (``ACL SETUSER <user> on ><password> <rules...>``)
    that may do what the router does and nothing else: its commands (``ACL_COMMANDS``),
    on the keys of ``namespace`` only, with no pub/sub channel; with ``cluster`` (set the
    user on every node of a Redis Cluster), also what the cluster client needs to learn the
    slot map (``ACL_CLUSTER_COMMANDS``)."""
    commands = ACL_COMMANDS + (ACL_CLUSTER_COMMANDS if cluster else ())
    return ["resetkeys", f"~{namespace}:*", "resetchannels", "-@all",
            *(f"+{c}" for c in commands)]


BLOCK_FIELD_BYTES = 8

# The field every hash of the index is made with (``lua/sweep.lua`` ``as_table``: the name
# of 1 byte, no block's; its value of 128 bytes, longer than Redis's
# hash-max-listpack-value, 64 by default, so Redis keeps the hash a hash table from its
# start: a listpack's HMGET finds each field by a linear scan).
TABLE_FIELD = b"~"
TABLE_VALUE = b"~" * 128  # lua/sweep.lua's TABLE_VALUE


def entries_in(hash_length: int) -> int:
    """The block entries of an index hash of ``hash_length`` fields (``HLEN``): all but
    ``TABLE_FIELD`` (0 for a hash that does not exist). While a replica's exact hash
    counts orphans (``lua/exact.lua``, rare: an eviction that left a hole), the
    placeholders of its evicted parents are counted too."""
    return max(int(hash_length) - 1, 0)


def pack_hashes(block_hashes: Sequence[int]) -> bytes:
    """Block hashes (unsigned 64-bit ints, in prompt order) as the one argument the scripts
    take: each hash's 8 bytes big-endian, concatenated (``len = 8 * n``). The same 8 bytes
    are a block's field name in the index's hashes (``block_fields``).

    A script reads block ``i`` as ``string.sub(s, 8i - 7, 8i)`` and parses only the blocks
    it needs; decimal text had to be parsed whole (``string.gmatch``), which cost more Redis
    time than the lookups at 8k tokens, and its field names took 19-20 bytes instead of 8.
    Raises ``struct.error`` for a hash outside ``[0, 2**64)``."""
    return struct.pack(f">{len(block_hashes)}Q", *block_hashes)


def block_fields(block_hashes: Sequence[int]) -> list[bytes]:
    """The field names of ``block_hashes`` in the index's Redis hashes (8 bytes each,
    big-endian; ``pack_hashes`` cut apart)."""
    return [h.to_bytes(BLOCK_FIELD_BYTES, "big") for h in block_hashes]


def unpack_field(field: bytes) -> int:
    """The block hash of one field name (``block_fields``' inverse)."""
    return int.from_bytes(field, "big")


def main(argv: list[str] | None = None) -> None:
    """``python -m router.redis_keys [namespace] [--cluster]``: print ``acl_rules``. An
    unknown option is refused (``--help`` printed the rules of a namespace called
    ``--help``: an operator's review)."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m router.redis_keys",
        description="Print the rules of a Redis ACL user that may do what the router does "
                    "on the keys of one index namespace, and nothing else.")
    ap.add_argument("namespace", nargs="?", default="prefix-router",
                    help="the routers' index_namespace (default: prefix-router)")
    ap.add_argument("--cluster", action="store_true",
                    help="also what a Redis Cluster client needs to learn the slot map")
    a = ap.parse_args(argv)
    print(" ".join(acl_rules(a.namespace, cluster=a.cluster)))


if __name__ == "__main__":
    main()
