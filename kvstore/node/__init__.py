"""The store node: one host's blocks in a dram slab and an ssd tier, leaf-first LRU eviction,
leases, and the gRPC / bulk servers in front of them. Imported by deploy (and tests and
benchmarks) only: workers reach a node through `kvstore.client`, the conductor through
`kvstore.StoreControl`. Torch-free: a node stores bytes."""

from kvstore.node.config import StoreConfig
from kvstore.node.server import StoreNode
from kvstore.node.store import BlockStore

__all__ = ["BlockStore", "StoreConfig", "StoreNode"]
