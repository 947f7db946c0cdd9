from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVClearReply(_message.Message):
    __slots__ = ("dropped", "deferred")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    deferred: int
    def __init__(self, dropped: _Optional[int] = ..., deferred: _Optional[int] = ...) -> None: ...

class KVLookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVLookupReply(_message.Message):
    __slots__ = ("num_blocks", "tiers", "sizes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVBlockPart(_message.Message):
    __slots__ = ("block", "layer", "offset", "data")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block: int
    layer: int
    offset: int
    data: bytes
    def __init__(self, block: _Optional[int] = ..., layer: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVGetChunk(_message.Message):
    __slots__ = ("headers", "tiers", "parts")
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedScalarFieldContainer[bytes]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    parts: _containers.RepeatedCompositeFieldContainer[KVBlockPart]
    def __init__(self, headers: _Optional[_Iterable[bytes]] = ..., tiers: _Optional[_Iterable[str]] = ..., parts: _Optional[_Iterable[_Union[KVBlockPart, _Mapping]]] = ...) -> None: ...

class KVPutOpen(_message.Message):
    __slots__ = ("keys", "sizes", "parent", "model_fingerprint")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    parent: bytes
    model_fingerprint: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., parent: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class KVPutData(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[KVBlockPart]
    def __init__(self, parts: _Optional[_Iterable[_Union[KVBlockPart, _Mapping]]] = ...) -> None: ...

class KVPutCommit(_message.Message):
    __slots__ = ("headers",)
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, headers: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVPutChunk(_message.Message):
    __slots__ = ("open", "data", "commit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    open: KVPutOpen
    data: KVPutData
    commit: KVPutCommit
    def __init__(self, open: _Optional[_Union[KVPutOpen, _Mapping]] = ..., data: _Optional[_Union[KVPutData, _Mapping]] = ..., commit: _Optional[_Union[KVPutCommit, _Mapping]] = ...) -> None: ...

class KVPutReply(_message.Message):
    __slots__ = ("stored", "held")
    STORED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    stored: int
    held: int
    def __init__(self, stored: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class KVLeaseRequest(_message.Message):
    __slots__ = ("mode", "keys", "sizes", "parent", "model_fingerprint", "lease_id", "packed")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        READ: _ClassVar[KVLeaseRequest.Mode]
        WRITE: _ClassVar[KVLeaseRequest.Mode]
        RENEW: _ClassVar[KVLeaseRequest.Mode]
    READ: KVLeaseRequest.Mode
    WRITE: KVLeaseRequest.Mode
    RENEW: KVLeaseRequest.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    mode: KVLeaseRequest.Mode
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    parent: bytes
    model_fingerprint: str
    lease_id: int
    packed: bool
    def __init__(self, mode: _Optional[_Union[KVLeaseRequest.Mode, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., sizes: _Optional[_Iterable[int]] = ..., parent: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ..., lease_id: _Optional[int] = ..., packed: _Optional[bool] = ...) -> None: ...

class KVBlockSlot(_message.Message):
    __slots__ = ("index", "offset", "length", "tier", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    length: int
    tier: str
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., tier: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVLeaseReply(_message.Message):
    __slots__ = ("lease_id", "ttl_s", "slots", "shm_path", "indices", "offsets", "lengths", "tiers")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_s: float
    slots: _containers.RepeatedCompositeFieldContainer[KVBlockSlot]
    shm_path: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[int] = ..., ttl_s: _Optional[float] = ..., slots: _Optional[_Iterable[_Union[KVBlockSlot, _Mapping]]] = ..., shm_path: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class KVReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "corrupt")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    corrupt: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[int] = ..., corrupt: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KVCommitRequest(_message.Message):
    __slots__ = ("lease_id", "writer_hashed")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_HASHED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    writer_hashed: bool
    def __init__(self, lease_id: _Optional[int] = ..., writer_hashed: _Optional[bool] = ...) -> None: ...

class KVStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVTierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "blocks", "hits", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: int
    evictions: int
    def __init__(self, tier: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class KVStatsReply(_message.Message):
    __slots__ = ("node_id", "tiers", "hits", "misses", "promotions", "demotions", "leases", "pending_blocks", "rss_bytes", "uss_bytes", "pss_bytes", "configured_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    USS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[KVTierStats]
    hits: int
    misses: int
    promotions: int
    demotions: int
    leases: int
    pending_blocks: int
    rss_bytes: int
    uss_bytes: int
    pss_bytes: int
    configured_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[KVTierStats, _Mapping]]] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., leases: _Optional[int] = ..., pending_blocks: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., uss_bytes: _Optional[int] = ..., pss_bytes: _Optional[int] = ..., configured_bytes: _Optional[int] = ...) -> None: ...

class KVInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVInfoReply(_message.Message):
    __slots__ = ("node_id", "hostname", "boot_id", "shm_path", "shm_size", "model_fingerprint", "max_message_bytes", "chunk_bytes", "lease_s", "bulk_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hostname: str
    boot_id: str
    shm_path: str
    shm_size: int
    model_fingerprint: str
    max_message_bytes: int
    chunk_bytes: int
    lease_s: float
    bulk_port: int
    def __init__(self, node_id: _Optional[str] = ..., hostname: _Optional[str] = ..., boot_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., shm_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., lease_s: _Optional[float] = ..., bulk_port: _Optional[int] = ...) -> None: ...
