"""gRPC client library, the halfmoon CLI, trace loaders and replay, reports and plots."""

from client.api import Access, AsyncClient, Chunk, Client, Completion, build_request
from client.plot import plot_cdfs, save_figure
from client.replay import ReplaySettings, replay, replay_async
from client.replay_cmd import ReplayResult, parse_policies, replay_trace
from client.report import (
    Percentiles,
    ReplayRecord,
    Report,
    compute_report,
    format_reports,
    percentiles,
    read_records,
    request_tbt,
    request_tpot,
    write_records,
)
from client.status_cmd import format_status
from client.synth import Prompt, Scaling, block_tokens, make_prompts, prompt_tokens
from client.traces import (
    SHIPPED_TRACE,
    TraceError,
    TraceRequest,
    load_azure,
    load_mooncake,
    load_trace,
)

__all__ = [
    "Access",
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "build_request",
    "plot_cdfs",
    "save_figure",
    "ReplaySettings",
    "replay",
    "replay_async",
    "ReplayResult",
    "parse_policies",
    "replay_trace",
    "Percentiles",
    "ReplayRecord",
    "Report",
    "compute_report",
    "format_reports",
    "percentiles",
    "read_records",
    "request_tbt",
    "request_tpot",
    "write_records",
    "format_status",
    "Prompt",
    "Scaling",
    "block_tokens",
    "make_prompts",
    "prompt_tokens",
    "SHIPPED_TRACE",
    "TraceError",
    "TraceRequest",
    "load_azure",
    "load_mooncake",
    "load_trace",
]
