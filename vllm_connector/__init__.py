"""halfmoon's store as vLLM's KV cache tier: a vLLM v1 KV connector (`pip install
halfmoon[vllm]`, then `kv_connector_module_path="vllm_connector.connector"`,
`kv_connector="HalfmoonConnector"`; see docs/operations.md).

The parts that need no vLLM are imported here: the block layout conversion (`layout`), the
scheduler side's matching and planning (`plan`), the worker side's loads and saves (`worker`)
and the blocks' identity (`identity`). `vllm_connector.connector` (the class vLLM loads) and
`vllm_connector.stats` import vLLM."""

from vllm_connector.identity import fingerprint, layout_id, weights_id
from vllm_connector.layout import (
    LAYOUTS,
    CacheLayout,
    detect_layout,
    gather_blocks,
    scatter_blocks,
)
from vllm_connector.plan import LoadItem, Planner, SaveItem, StepPlan, Stores
from vllm_connector.worker import COUNTERS, LayerIO

__all__ = [
    "COUNTERS",
    "LAYOUTS",
    "CacheLayout",
    "LayerIO",
    "LoadItem",
    "Planner",
    "SaveItem",
    "StepPlan",
    "Stores",
    "detect_layout",
    "fingerprint",
    "gather_blocks",
    "layout_id",
    "scatter_blocks",
    "weights_id",
]
