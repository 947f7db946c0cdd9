from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class RecentTraceRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class TraceRecord(_message.Message):
    __slots__ = ("timestamp_ms", "input_length", "output_length", "hash_ids", "refused", "ttft_ms", "predicted_ttft_ms")
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HASH_IDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: _containers.RepeatedScalarFieldContainer[int]
    refused: bool
    ttft_ms: float
    predicted_ttft_ms: float
    def __init__(self, timestamp_ms: _Optional[float] = ..., input_length: _Optional[int] = ..., output_length: _Optional[int] = ..., hash_ids: _Optional[_Iterable[int]] = ..., refused: _Optional[bool] = ..., ttft_ms: _Optional[float] = ..., predicted_ttft_ms: _Optional[float] = ...) -> None: ...

class RecentTraceReply(_message.Message):
    __slots__ = ("requests", "block_size", "window_s", "ttft_slo_ms", "tbt_slo_ms", "tpot_slo_ms", "prefill_workers", "decode_workers", "models", "refused_at_door")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_AT_DOOR_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[TraceRecord]
    block_size: int
    window_s: float
    ttft_slo_ms: float
    tbt_slo_ms: float
    tpot_slo_ms: float
    prefill_workers: int
    decode_workers: int
    models: _containers.RepeatedCompositeFieldContainer[WorkerModel]
    refused_at_door: int
    def __init__(self, requests: _Optional[_Iterable[_Union[TraceRecord, _Mapping]]] = ..., block_size: _Optional[int] = ..., window_s: _Optional[float] = ..., ttft_slo_ms: _Optional[float] = ..., tbt_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., prefill_workers: _Optional[int] = ..., decode_workers: _Optional[int] = ..., models: _Optional[_Iterable[_Union[WorkerModel, _Mapping]]] = ..., refused_at_door: _Optional[int] = ...) -> None: ...

class WorkerModel(_message.Message):
    __slots__ = ("worker_id", "kind", "coef", "correction", "block_bytes", "total_blocks", "max_batch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COEF_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kind: str
    coef: _containers.RepeatedScalarFieldContainer[float]
    correction: float
    block_bytes: int
    total_blocks: int
    max_batch: int
    def __init__(self, worker_id: _Optional[str] = ..., kind: _Optional[str] = ..., coef: _Optional[_Iterable[float]] = ..., correction: _Optional[float] = ..., block_bytes: _Optional[int] = ..., total_blocks: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheReply(_message.Message):
    __slots__ = ("store_blocks", "device_blocks")
    STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    store_blocks: int
    device_blocks: int
    def __init__(self, store_blocks: _Optional[int] = ..., device_blocks: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "model", "cache_salt", "policy", "ttft_slo_ms", "tbt_slo_ms", "tpot_slo_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    model: str
    cache_salt: str
    policy: str
    ttft_slo_ms: float
    tbt_slo_ms: float
    tpot_slo_ms: float
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ..., policy: _Optional[str] = ..., ttft_slo_ms: _Optional[float] = ..., tbt_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "cached_device_tokens", "cached_dram_tokens", "cached_ssd_tokens", "cached_remote_tokens", "computed_prompt_tokens", "ttft_ms", "tbt_mean_ms", "tbt_p90_ms", "prefill_worker", "decode_worker", "queue_ms", "transfer_ms", "max_decode_batch", "predicted_ttft_ms", "policy", "predicted_tbt_ms", "prefill_ms", "worker_failures", "predicted_admission_ms", "prefill_answered_ms", "prefill_on_decode")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_DRAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SSD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TBT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ADMISSION_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ANSWERED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ON_DECODE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_device_tokens: int
    cached_dram_tokens: int
    cached_ssd_tokens: int
    cached_remote_tokens: int
    computed_prompt_tokens: int
    ttft_ms: float
    tbt_mean_ms: float
    tbt_p90_ms: float
    prefill_worker: str
    decode_worker: str
    queue_ms: float
    transfer_ms: float
    max_decode_batch: int
    predicted_ttft_ms: float
    policy: str
    predicted_tbt_ms: float
    prefill_ms: float
    worker_failures: int
    predicted_admission_ms: float
    prefill_answered_ms: float
    prefill_on_decode: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_device_tokens: _Optional[int] = ..., cached_dram_tokens: _Optional[int] = ..., cached_ssd_tokens: _Optional[int] = ..., cached_remote_tokens: _Optional[int] = ..., computed_prompt_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tbt_mean_ms: _Optional[float] = ..., tbt_p90_ms: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., queue_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., max_decode_batch: _Optional[int] = ..., predicted_ttft_ms: _Optional[float] = ..., policy: _Optional[str] = ..., predicted_tbt_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., worker_failures: _Optional[int] = ..., predicted_admission_ms: _Optional[float] = ..., prefill_answered_ms: _Optional[float] = ..., prefill_on_decode: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "token_times_ms", "finished", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIMES_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    token_times_ms: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: str
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., token_times_ms: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "kind", "address", "healthy", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kind: str
    address: str
    healthy: bool
    load: WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., kind: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("node_id", "address", "tiers", "memory", "bulk_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    memory: MemoryReport
    bulk_port: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., memory: _Optional[_Union[MemoryReport, _Mapping]] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class MemoryReport(_message.Message):
    __slots__ = ("rss_bytes", "uss_bytes", "pss_bytes", "configured_bytes")
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    USS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    rss_bytes: int
    uss_bytes: int
    pss_bytes: int
    configured_bytes: int
    def __init__(self, rss_bytes: _Optional[int] = ..., uss_bytes: _Optional[int] = ..., pss_bytes: _Optional[int] = ..., configured_bytes: _Optional[int] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "blocks", "hits", "misses", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, tier: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("model", "block_size", "default_policy", "workers", "stores", "requests_total", "requests_rejected", "prompt_tokens_total", "cached_tokens_total", "vocab_size", "conductor_rss_bytes", "model_fingerprint", "kv_dtype", "conductor_memory", "requests_slo_met", "requests_slo_missed", "requests_best_effort")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONDUCTOR_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONDUCTOR_MEMORY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SLO_MET_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SLO_MISSED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BEST_EFFORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    default_policy: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    stores: _containers.RepeatedCompositeFieldContainer[StoreStatus]
    requests_total: int
    requests_rejected: int
    prompt_tokens_total: int
    cached_tokens_total: int
    vocab_size: int
    conductor_rss_bytes: int
    model_fingerprint: str
    kv_dtype: str
    conductor_memory: MemoryReport
    requests_slo_met: int
    requests_slo_missed: int
    requests_best_effort: int
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., default_policy: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., stores: _Optional[_Iterable[_Union[StoreStatus, _Mapping]]] = ..., requests_total: _Optional[int] = ..., requests_rejected: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., vocab_size: _Optional[int] = ..., conductor_rss_bytes: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., conductor_memory: _Optional[_Union[MemoryReport, _Mapping]] = ..., requests_slo_met: _Optional[int] = ..., requests_slo_missed: _Optional[int] = ..., requests_best_effort: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "queued_requests", "queued_tokens", "predicted_queue_ms", "running", "free_blocks", "total_blocks", "prefill_coef", "decode_coef", "total_context_tokens", "kind", "nodes", "block_bytes", "block_size", "model_fingerprint", "waiting", "max_batch_seen", "requests_done", "device", "device_node", "kv_cache_dtype", "capacity_tokens", "fetch_block_bytes", "running_tokens", "seq_positions", "seq_remaining", "seq_blocks", "waiting_positions", "waiting_remaining", "waiting_blocks", "max_batch", "memory", "links", "cpu_turns", "offered_slack_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COEF_FIELD_NUMBER: _ClassVar[int]
    DECODE_COEF_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_DONE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NODE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQ_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SEQ_REMAINING_FIELD_NUMBER: _ClassVar[int]
    SEQ_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REMAINING_FIELD_NUMBER: _ClassVar[int]
    WAITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    CPU_TURNS_FIELD_NUMBER: _ClassVar[int]
    OFFERED_SLACK_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    queued_requests: int
    queued_tokens: int
    predicted_queue_ms: float
    running: int
    free_blocks: int
    total_blocks: int
    prefill_coef: _containers.RepeatedScalarFieldContainer[float]
    decode_coef: _containers.RepeatedScalarFieldContainer[float]
    total_context_tokens: int
    kind: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    block_bytes: int
    block_size: int
    model_fingerprint: str
    waiting: int
    max_batch_seen: int
    requests_done: int
    device: str
    device_node: str
    kv_cache_dtype: str
    capacity_tokens: int
    fetch_block_bytes: float
    running_tokens: int
    seq_positions: _containers.RepeatedScalarFieldContainer[int]
    seq_remaining: _containers.RepeatedScalarFieldContainer[int]
    seq_blocks: _containers.RepeatedScalarFieldContainer[int]
    waiting_positions: _containers.RepeatedScalarFieldContainer[int]
    waiting_remaining: _containers.RepeatedScalarFieldContainer[int]
    waiting_blocks: _containers.RepeatedScalarFieldContainer[int]
    max_batch: int
    memory: MemoryReport
    links: _containers.RepeatedCompositeFieldContainer[LinkSpeed]
    cpu_turns: str
    offered_slack_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., queued_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., predicted_queue_ms: _Optional[float] = ..., running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prefill_coef: _Optional[_Iterable[float]] = ..., decode_coef: _Optional[_Iterable[float]] = ..., total_context_tokens: _Optional[int] = ..., kind: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., block_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., waiting: _Optional[int] = ..., max_batch_seen: _Optional[int] = ..., requests_done: _Optional[int] = ..., device: _Optional[str] = ..., device_node: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., capacity_tokens: _Optional[int] = ..., fetch_block_bytes: _Optional[float] = ..., running_tokens: _Optional[int] = ..., seq_positions: _Optional[_Iterable[int]] = ..., seq_remaining: _Optional[_Iterable[int]] = ..., seq_blocks: _Optional[_Iterable[int]] = ..., waiting_positions: _Optional[_Iterable[int]] = ..., waiting_remaining: _Optional[_Iterable[int]] = ..., waiting_blocks: _Optional[_Iterable[int]] = ..., max_batch: _Optional[int] = ..., memory: _Optional[_Union[MemoryReport, _Mapping]] = ..., links: _Optional[_Iterable[_Union[LinkSpeed, _Mapping]]] = ..., cpu_turns: _Optional[str] = ..., offered_slack_ms: _Optional[float] = ...) -> None: ...

class LinkSpeed(_message.Message):
    __slots__ = ("node", "fixed_ms", "bytes_per_ms", "fetches")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_MS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    node: str
    fixed_ms: float
    bytes_per_ms: float
    fetches: int
    def __init__(self, node: _Optional[str] = ..., fixed_ms: _Optional[float] = ..., bytes_per_ms: _Optional[float] = ..., fetches: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("memory",)
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    memory: bool
    def __init__(self, memory: _Optional[bool] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("block_keys", "store_node", "store_address", "num_tokens", "tail", "tail_tokens", "window_blocks")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    STORE_NODE_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    store_node: str
    store_address: str
    num_tokens: int
    tail: bytes
    tail_tokens: int
    window_blocks: int
    def __init__(self, block_keys: _Optional[_Iterable[bytes]] = ..., store_node: _Optional[str] = ..., store_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., tail: _Optional[bytes] = ..., tail_tokens: _Optional[int] = ..., window_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt", "fetch_from", "fetch_blocks", "no_cache", "deadline_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FETCH_FROM_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    fetch_from: str
    fetch_blocks: int
    no_cache: bool
    deadline_ms: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., fetch_from: _Optional[str] = ..., fetch_blocks: _Optional[int] = ..., no_cache: _Optional[bool] = ..., deadline_ms: _Optional[float] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "handle", "cached_device_tokens", "cached_dram_tokens", "cached_ssd_tokens", "cached_remote_tokens", "computed_tokens", "queue_ms", "prefill_ms", "transfer_ms", "cachegen_levels", "fetched_bytes", "fetch_ms")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_DRAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SSD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    CACHEGEN_LEVELS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    handle: KVHandle
    cached_device_tokens: int
    cached_dram_tokens: int
    cached_ssd_tokens: int
    cached_remote_tokens: int
    computed_tokens: int
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    cachegen_levels: _containers.RepeatedScalarFieldContainer[int]
    fetched_bytes: int
    fetch_ms: float
    def __init__(self, first_token: _Optional[int] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., cached_device_tokens: _Optional[int] = ..., cached_dram_tokens: _Optional[int] = ..., cached_ssd_tokens: _Optional[int] = ..., cached_remote_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., cachegen_levels: _Optional[_Iterable[int]] = ..., fetched_bytes: _Optional[int] = ..., fetch_ms: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "first_token", "handle", "sampling", "cache_salt", "tbt_slo_ms", "prefill_here")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    handle: KVHandle
    sampling: SamplingParams
    cache_salt: str
    tbt_slo_ms: float
    prefill_here: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., tbt_slo_ms: _Optional[float] = ..., prefill_here: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "token_times_ms", "finished", "finish_reason", "transfer_ms", "batch_sizes", "recomputed_tokens", "admitted", "prefilled", "step_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIMES_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_times_ms: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: str
    transfer_ms: float
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    recomputed_tokens: int
    admitted: bool
    prefilled: PrefillReply
    step_ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_times_ms: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., transfer_ms: _Optional[float] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., recomputed_tokens: _Optional[int] = ..., admitted: _Optional[bool] = ..., prefilled: _Optional[_Union[PrefillReply, _Mapping]] = ..., step_ms: _Optional[_Iterable[float]] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SwitchRoleReply(_message.Message):
    __slots__ = ("role", "switching", "message")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    role: str
    switching: bool
    message: str
    def __init__(self, role: _Optional[str] = ..., switching: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
