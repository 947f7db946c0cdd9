"""The scheduler side of the connector, without vLLM: which of a prompt's blocks the store
already holds (anywhere: every configured node, or the cluster's index), the loads a step must
do, and the prompt blocks a step completes that the store should keep.

vLLM calls it in order: match() for a waiting request (maybe again, side-effect free), allocated()
once its blocks are allocated, step() as the step's metadata is built, finished() at the end."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvstore import Index, LookupResult, StoreUnavailable, block_keys
from kvstore.client import StoreClient

log = logging.getLogger(__name__)


@dataclass
class LoadItem:
    """Blocks a step loads from the store into vLLM's pool before its forward."""

    req_id: str
    address: str  # the store node that holds them
    keys: list[bytes]
    block_ids: list[int]  # vLLM block ids they land in, key for key


@dataclass
class SaveItem:
    """Prompt blocks a step computes (or holds) that the store does not: saved after it."""

    req_id: str
    address: str  # the store node they go to
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes | None  # the key before keys[0] (None: keys[0] is the prompt's first block)


@dataclass
class StepPlan:
    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)


@dataclass
class _Request:
    keys: list[bytes]  # the prompt's full blocks' keys
    held: int = 0  # leading blocks the store held at the last match
    address: str = ""  # the node that held them
    tiers: list[str] = field(default_factory=list)  # their tiers
    local: int = 0  # block-aligned tokens vLLM's own cache had at the last match
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading blocks the store holds or a save was planned for
    load: LoadItem | None = None  # planned by allocated(), sent with the next step


class StoreClients:
    """One StoreClient per node address, opened on first use, all over one transport."""

    def __init__(self, transport: str, timeout_s: float):
        self._transport, self._timeout = transport, timeout_s
        self._clients: dict[str, StoreClient] = {}

    def get(self, address: str) -> StoreClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = StoreClient(address, self._transport, self._timeout)
        return c

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


class Stores:
    """The store nodes a connector uses: clients by address, and who holds a prompt's blocks
    (every node asked, or the index's one round trip when a Redis URL is given)."""

    RETRY_S = 5.0  # a node that did not answer is not asked again for this long

    def __init__(self, addresses: list[str], index_url: str = "", timeout_s: float = 1.0):
        if not addresses and not index_url:
            raise ValueError("the halfmoon connector needs store addresses or an index URL")
        self.addresses = list(addresses)
        # lookups only (gRPC, no slab mapped); a short timeout: vLLM's scheduler waits on a
        # lookup, and a store that is gone costs every waiting request this much once per RETRY_S
        self._clients = StoreClients("grpc", timeout_s)
        self._down_until: dict[str, float] = {}
        self.failed_lookups = 0  # lookups a node did not answer (each one logged)
        self._index = Index(index_url) if index_url else None

    def home(self) -> str:
        """Where blocks no node holds yet go."""
        if self.addresses:
            return self.addresses[0]
        assert self._index is not None
        nodes = sorted(self._index.nodes().values(), key=lambda n: n.node_id)
        if not nodes:
            raise StoreUnavailable("the index lists no live store node")
        return nodes[0].address

    def longest(self, keys: list[bytes]) -> tuple[str, LookupResult]:
        """The node holding the longest prefix of keys and what it holds; ("", empty) if none.
        A node that does not answer holds nothing (logged): a miss, never a failed request."""
        best = ("", LookupResult(0, []))
        if self._index is not None:
            try:
                nodes = self._index.nodes()
                for node_id, res in self._index.longest_prefix(keys).items():
                    if node_id in nodes and res.num_blocks > best[1].num_blocks:
                        best = (nodes[node_id].address, res)
            except Exception as e:  # the index is advisory: nothing known
                log.warning("halfmoon connector: index lookup failed: %s", e)
            return best
        now = time.monotonic()
        for address in self.addresses:
            if self._down_until.get(address, 0.0) > now:
                continue
            try:
                res = self._clients.get(address).lookup(keys)
            except (StoreUnavailable, ConnectionError) as e:
                self.failed_lookups += 1
                self._down_until[address] = now + self.RETRY_S
                log.warning(
                    "halfmoon connector: store %s did not answer a lookup (%s); not "
                    "asked again for %.0f s",
                    address,
                    e,
                    self.RETRY_S,
                )
                continue
            if res.num_blocks > best[1].num_blocks:
                best = (address, res)
        return best

    def close(self) -> None:
        self._clients.close()
        if self._index is not None:
            self._index.close()


class Planner:
    """Per-request state between vLLM's scheduler calls (see the module's docstring)."""

    def __init__(self, stores: Stores, block_size: int, fingerprint: str):
        self.stores, self.block_size, self.fingerprint = stores, block_size, fingerprint
        self._requests: dict[str, _Request] = {}

    def match(self, req_id: str, prompt: list[int], num_computed: int) -> int:
        """Prompt tokens past `num_computed` (block-aligned, vLLM's own cache) the store can
        give; never the prompt's last token, which the forward must compute."""
        r = self._requests.get(req_id)
        if r is None:
            usable = (len(prompt) - 1) // self.block_size * self.block_size
            r = self._requests[req_id] = _Request(
                block_keys(prompt[:usable], self.block_size, self.fingerprint)
            )
        r.address, res = self.stores.longest(r.keys)
        r.held, r.tiers, r.local = res.num_blocks, list(res.tiers), num_computed
        return max(0, r.held * self.block_size - num_computed)

    def tiers(self, req_id: str, tokens: int) -> dict[str, int]:
        """The tokens of the planned load by the tier that held their blocks."""
        r = self._requests.get(req_id)
        out: dict[str, int] = {}
        if r is None or tokens <= 0:
            return out
        first = r.local // self.block_size
        for tier in r.tiers[first : first + tokens // self.block_size]:
            out[tier] = out.get(tier, 0) + self.block_size
        return out

    def allocated(self, req_id: str, block_ids: list[int], num_external: int) -> None:
        """vLLM allocated the request's blocks; `num_external` tokens after its own cached ones
        are to be loaded (0: none)."""
        r = self._requests.get(req_id)
        if r is None:
            return
        r.block_ids = list(block_ids)
        if num_external <= 0:
            return
        first = r.local // self.block_size
        n = num_external // self.block_size
        r.load = LoadItem(
            req_id, r.address, r.keys[first : first + n], r.block_ids[first : first + n]
        )

    def step(
        self,
        new: list[tuple[str, list[int], int]],
        grown: list[tuple[str, list[int], int]],
        scheduled: dict[str, int],
    ) -> StepPlan:
        """The step's loads and saves. `new`: (request id, its block ids, computed tokens) of
        requests scheduled for the first time (or resumed with their blocks anew); `grown`:
        (request id, block ids added, computed tokens) of running ones; `scheduled`: tokens each
        computes in this step."""
        plan = StepPlan()
        for req_id, block_ids, computed in new:
            r = self._requests.get(req_id)
            if r is None:
                continue
            r.block_ids = list(block_ids)
            r.saved = max(r.saved, r.held)  # the store holds those already
            self._plan(plan, req_id, r, computed + scheduled.get(req_id, 0))
        for req_id, added, computed in grown:
            r = self._requests.get(req_id)
            if r is None:
                continue
            r.block_ids.extend(added)
            self._plan(plan, req_id, r, computed + scheduled.get(req_id, 0))
        return plan

    def _plan(self, plan: StepPlan, req_id: str, r: _Request, done_tokens: int) -> None:
        if r.load is not None:
            plan.loads.append(r.load)
            r.load = None
        full = min(done_tokens // self.block_size, len(r.keys), len(r.block_ids))
        if full > r.saved:
            parent = r.keys[r.saved - 1] if r.saved else None
            address = r.address if r.held and r.address else self.stores.home()
            plan.saves.append(
                SaveItem(
                    req_id, address, r.keys[r.saved : full], r.block_ids[r.saved : full], parent
                )
            )
            r.saved = full

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._requests)
