from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType

class ArtifactHeader(_message.Message):
    __slots__ = ("layout_version", "fingerprint", "key", "parent_key", "token_count", "num_layers", "num_kv_heads", "head_dim", "dtype", "codec", "codec_level", "lossy", "codec_meta", "chunk_index", "created_unix", "steer")
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    CODEC_META_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STEER_FIELD_NUMBER: _ClassVar[int]
    layout_version: int
    fingerprint: bytes
    key: bytes
    parent_key: bytes
    token_count: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    codec: str
    codec_level: str
    lossy: bool
    codec_meta: bytes
    chunk_index: int
    created_unix: float
    steer: str
    def __init__(self, layout_version: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., token_count: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[str] = ..., codec_level: _Optional[str] = ..., lossy: _Optional[bool] = ..., codec_meta: _Optional[bytes] = ..., chunk_index: _Optional[int] = ..., created_unix: _Optional[float] = ..., steer: _Optional[str] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("tenant", "salt")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    salt: str
    def __init__(self, tenant: _Optional[str] = ..., salt: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("fingerprint", "namespace", "keys", "local_only", "probe")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    local_only: bool
    probe: bool
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., local_only: _Optional[bool] = ..., probe: _Optional[bool] = ...) -> None: ...

class Location(_message.Message):
    __slots__ = ("tier", "node_id", "address")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    node_id: str
    address: str
    def __init__(self, tier: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("available", "locations", "node_id")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    available: int
    locations: _containers.RepeatedCompositeFieldContainer[Location]
    node_id: str
    def __init__(self, available: _Optional[int] = ..., locations: _Optional[_Iterable[_Union[Location, _Mapping]]] = ..., node_id: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("fingerprint", "namespace", "key", "codec", "require_lossless", "local_only", "next_keys", "shm")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_LOSSLESS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    NEXT_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace: Namespace
    key: bytes
    codec: str
    require_lossless: bool
    local_only: bool
    next_keys: _containers.RepeatedScalarFieldContainer[bytes]
    shm: bool
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., key: _Optional[bytes] = ..., codec: _Optional[str] = ..., require_lossless: _Optional[bool] = ..., local_only: _Optional[bool] = ..., next_keys: _Optional[_Iterable[bytes]] = ..., shm: _Optional[bool] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("data", "total_size", "source", "shm_name")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_size: int
    source: str
    shm_name: str
    def __init__(self, data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., source: _Optional[str] = ..., shm_name: _Optional[str] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("fingerprint", "namespace", "key", "total_size")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace: Namespace
    key: bytes
    total_size: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., key: _Optional[bytes] = ..., total_size: _Optional[int] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: str
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("fingerprint", "namespace", "keys", "codec", "document")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    codec: str
    document: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., codec: _Optional[str] = ..., document: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("action", "fingerprint", "namespace", "keys", "document", "ttl_s", "priority", "cron", "schedule_id", "emphasis")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[HintRequest.Action]
        PIN: _ClassVar[HintRequest.Action]
        UNPIN: _ClassVar[HintRequest.Action]
        SET_TTL: _ClassVar[HintRequest.Action]
        SET_PRIORITY: _ClassVar[HintRequest.Action]
        SCHEDULE_PREFETCH: _ClassVar[HintRequest.Action]
        CANCEL_SCHEDULE: _ClassVar[HintRequest.Action]
        EMPHASIZE: _ClassVar[HintRequest.Action]
    ACTION_UNSPECIFIED: HintRequest.Action
    PIN: HintRequest.Action
    UNPIN: HintRequest.Action
    SET_TTL: HintRequest.Action
    SET_PRIORITY: HintRequest.Action
    SCHEDULE_PREFETCH: HintRequest.Action
    CANCEL_SCHEDULE: HintRequest.Action
    EMPHASIZE: HintRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CRON_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    EMPHASIS_FIELD_NUMBER: _ClassVar[int]
    action: HintRequest.Action
    fingerprint: bytes
    namespace: Namespace
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    document: str
    ttl_s: float
    priority: int
    cron: str
    schedule_id: str
    emphasis: str
    def __init__(self, action: _Optional[_Union[HintRequest.Action, str]] = ..., fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., document: _Optional[str] = ..., ttl_s: _Optional[float] = ..., priority: _Optional[int] = ..., cron: _Optional[str] = ..., schedule_id: _Optional[str] = ..., emphasis: _Optional[str] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ("affected", "schedule_id", "steer_variant")
    AFFECTED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    STEER_VARIANT_FIELD_NUMBER: _ClassVar[int]
    affected: int
    schedule_id: str
    steer_variant: str
    def __init__(self, affected: _Optional[int] = ..., schedule_id: _Optional[str] = ..., steer_variant: _Optional[str] = ...) -> None: ...

class BulkRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BulkOffer(_message.Message):
    __slots__ = ("port", "ticket", "ttl_s", "shm_segments", "shm_bytes", "local_socket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    ttl_s: float
    shm_segments: int
    shm_bytes: int
    local_socket: str
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., ttl_s: _Optional[float] = ..., shm_segments: _Optional[int] = ..., shm_bytes: _Optional[int] = ..., local_socket: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "role", "counters", "json")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    counters: _containers.ScalarMap[str, float]
    json: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., counters: _Optional[_Mapping[str, float]] = ..., json: _Optional[str] = ...) -> None: ...

class ComputeRequest(_message.Message):
    __slots__ = ("fingerprint", "namespace", "tokens", "codec")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace: Namespace
    tokens: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ...) -> None: ...

class ComputeResponse(_message.Message):
    __slots__ = ("keys", "computed", "already_stored")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    computed: int
    already_stored: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., computed: _Optional[int] = ..., already_stored: _Optional[int] = ...) -> None: ...

class DocumentRequest(_message.Message):
    __slots__ = ("namespace", "document", "fingerprint", "emphasis")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EMPHASIS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    document: str
    fingerprint: bytes
    emphasis: str
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., document: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., emphasis: _Optional[str] = ...) -> None: ...

class DocumentResponse(_message.Message):
    __slots__ = ("keys", "steer_variant")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    STEER_VARIANT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    steer_variant: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., steer_variant: _Optional[str] = ...) -> None: ...

class BlendRequest(_message.Message):
    __slots__ = ("fingerprint", "namespace", "tokens", "documents", "codec")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    namespace: Namespace
    tokens: _containers.RepeatedScalarFieldContainer[int]
    documents: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    def __init__(self, fingerprint: _Optional[bytes] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., documents: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ...) -> None: ...

class BlendResponse(_message.Message):
    __slots__ = ("keys", "covered_tokens", "variant", "documents", "document_tokens", "recomputed_tokens", "ratio", "refused", "reason", "cached")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    COVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    covered_tokens: int
    variant: str
    documents: int
    document_tokens: int
    recomputed_tokens: int
    ratio: float
    refused: str
    reason: str
    cached: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., covered_tokens: _Optional[int] = ..., variant: _Optional[str] = ..., documents: _Optional[int] = ..., document_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., ratio: _Optional[float] = ..., refused: _Optional[str] = ..., reason: _Optional[str] = ..., cached: _Optional[bool] = ...) -> None: ...

class Announcement(_message.Message):
    __slots__ = ("node_id", "address", "weight", "ttl_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    weight: float
    ttl_s: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., weight: _Optional[float] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class Members(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Announcement]
    def __init__(self, members: _Optional[_Iterable[_Union[Announcement, _Mapping]]] = ...) -> None: ...

class SignalMessage(_message.Message):
    __slots__ = ("to", "sender", "session", "kind", "sdp")
    TO_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SDP_FIELD_NUMBER: _ClassVar[int]
    to: str
    sender: str
    session: str
    kind: str
    sdp: str
    def __init__(self, to: _Optional[str] = ..., sender: _Optional[str] = ..., session: _Optional[str] = ..., kind: _Optional[str] = ..., sdp: _Optional[str] = ...) -> None: ...

class SignalAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SignalPoll(_message.Message):
    __slots__ = ("node_id", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    wait_s: float
    def __init__(self, node_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class SignalBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[SignalMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[SignalMessage, _Mapping]]] = ...) -> None: ...
