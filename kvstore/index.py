"""Index: the global map, in Redis, of which store nodes hold which blocks in which tier, and the
registry of live nodes (heartbeat TTLs). longest_prefix answers for every node in one round trip.

The index is advisory: every caller treats a failure as "nothing known" and goes on. So a client
fails fast (short socket timeouts, one immediate retry to ride over a reconnect) instead of
redis-py's default of retries with back-off, which holds a caller for seconds while Redis is
down."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.redis_embed import EmbeddedRedis
from kvstore.types import LookupResult, NodeInfo


def _text(v: bytes | str) -> str:
    # the client answers bytes (no decode_responses); typed bytes | str by redis-py
    return v.decode() if isinstance(v, bytes) else v


def _raw(v: bytes | str) -> bytes:
    return v if isinstance(v, bytes) else v.encode()


_BLOCK = b"hm:b:"  # + block key -> hash {node_id: tier}
_NODE = "hm:n:"  # + node id -> NodeInfo JSON, expires unless heartbeats renew it
_NODES = "hm:nodes"  # set of node ids ever registered (for sweeping dead ones)
_NODE_KEYS = "hm:nk:"  # + node id -> set of block keys the node published

# For each node, how many leading KEYS it holds (contiguously from KEYS[1]) and the tier of each;
# nodes whose registry entry lapsed are left out.
_LONGEST_PREFIX = """
local counts, tiers = {}, {}
for i = 1, #KEYS do
  local h = redis.call('HGETALL', KEYS[i])
  local advanced = false
  for j = 1, #h, 2 do
    local node = h[j]
    if (i == 1 and counts[node] == nil) or counts[node] == i - 1 then
      counts[node] = i
      if tiers[node] == nil then tiers[node] = {} end
      table.insert(tiers[node], h[j + 1])
      advanced = true
    end
  end
  if not advanced then break end
end
local out = {}
for node, n in pairs(counts) do
  if redis.call('EXISTS', ARGV[1] .. node) == 1 then
    table.insert(out, node)
    table.insert(out, n)
    table.insert(out, table.concat(tiers[node], ','))
  end
end
return out
"""


class Index:
    """A client of the global index at `redis_url`; each call gives up after `timeout_s` (connect,
    and each reply), retried once at once (a connection Redis dropped is remade)."""

    def __init__(
        self, redis_url: str, embedded: EmbeddedRedis | None = None, timeout_s: float = 1.0
    ):
        if timeout_s <= 0:
            raise ValueError(f"index timeout_s must be positive, got {timeout_s}")
        self.url = redis_url
        self._embedded = embedded
        self.r = redis.Redis.from_url(
            redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._script = self.r.register_script(_LONGEST_PREFIX)

    @classmethod
    def from_env(cls) -> Index:
        """The index at $REDIS_URL, or on a new EmbeddedRedis when it is unset."""
        url = os.environ.get("REDIS_URL", "")
        return cls(url) if url else cls.embedded()

    @classmethod
    def embedded(cls) -> Index:
        """An index on a new EmbeddedRedis, stopped by close()."""
        server = EmbeddedRedis()
        return cls(server.url, embedded=server)

    def close(self) -> None:
        self.r.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    # ------------------------------------------------------------------ queries

    def longest_prefix(self, keys: list[bytes]) -> dict[str, LookupResult]:
        """For every live node holding keys[0]: how many leading keys it holds, and their tiers."""
        if not keys:
            return {}
        flat = self._script(keys=[_BLOCK + k for k in keys], args=[_NODE])
        out = {}
        for i in range(0, len(flat), 3):
            node = _text(flat[i])
            out[node] = LookupResult(int(flat[i + 1]), _text(flat[i + 2]).split(","))
        return out

    def nodes(self) -> dict[str, NodeInfo]:
        """Live nodes (heartbeat not lapsed)."""
        ids = sorted(_text(m) for m in self.r.smembers(_NODES))
        if not ids:
            return {}
        raw = self.r.mget([_NODE + i for i in ids])
        return {i: NodeInfo(**json.loads(v)) for i, v in zip(ids, raw) if v is not None}

    def server_run(self) -> str:
        """The Redis server's run id: it changes when the server restarts (and may have lost or
        rolled back what nodes published)."""
        return str(self.r.info("server").get("run_id", ""))

    def holders(self, key: bytes) -> dict[str, str]:
        """node id -> tier for one block key (live and dead nodes alike)."""
        return {_text(k): _text(v) for k, v in self.r.hgetall(_BLOCK + key).items()}

    # ------------------------------------------------------------------ updates (by store nodes)

    def register(self, info: NodeInfo, ttl_s: float) -> None:
        """Announce (or renew) a node; it counts as live for ttl_s."""
        pipe = self.r.pipeline()
        pipe.set(_NODE + info.node_id, json.dumps(info._asdict()), px=max(1, int(ttl_s * 1000)))
        pipe.sadd(_NODES, info.node_id)
        pipe.execute()

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        """Extend a node's registry entry; False if it had lapsed (the caller re-registers)."""
        return bool(self.r.pexpire(_NODE + node_id, max(1, int(ttl_s * 1000))))

    def publish(self, node_id: str, events: Sequence[tuple[bytes, str | None]]) -> None:
        """Apply a node's block changes: (key, tier) held there now, (key, None) gone."""
        if not events:
            return
        pipe = self.r.pipeline(transaction=False)
        held, gone = [], []
        for key, tier in events:
            if tier is None:
                pipe.hdel(_BLOCK + key, node_id)
                gone.append(key)
            else:
                pipe.hset(_BLOCK + key, node_id, tier)
                held.append(key)
        if held:
            pipe.sadd(_NODE_KEYS + node_id, *held)
        if gone:
            pipe.srem(_NODE_KEYS + node_id, *gone)
        pipe.execute()

    def republish(
        self, info: NodeInfo, ttl_s: float, held: dict[bytes, str], batch: int = 4096
    ) -> None:
        """Replace everything the index holds of a node by `held` (key -> tier, its whole
        listing) and register it: how the index is rebuilt after it lost or missed updates."""
        self.purge_node(info.node_id)
        items = list(held.items())
        for i in range(0, len(items), batch):  # pipelines of bounded size
            self.publish(info.node_id, items[i : i + batch])
        self.register(info, ttl_s)

    def purge_node(self, node_id: str) -> int:
        """Forget every block entry of a node; how many."""
        keys = [_raw(k) for k in self.r.smembers(_NODE_KEYS + node_id)]
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.hdel(_BLOCK + key, node_id)
        pipe.delete(_NODE_KEYS + node_id)
        pipe.execute()
        return len(keys)

    def unregister(self, node_id: str) -> None:
        self.purge_node(node_id)
        pipe = self.r.pipeline()
        pipe.delete(_NODE + node_id)
        pipe.srem(_NODES, node_id)
        pipe.execute()

    def sweep(self) -> list[str]:
        """Purge the entries of nodes whose heartbeat lapsed; their ids."""
        dead = []
        for m in self.r.smembers(_NODES):
            node = _text(m)
            if not self.r.exists(_NODE + node):
                self.purge_node(node)
                self.r.srem(_NODES, node)
                dead.append(node)
        return dead
