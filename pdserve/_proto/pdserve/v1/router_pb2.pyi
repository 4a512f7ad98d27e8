from pdserve._proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "namespace", "model", "exclude_worker_ids", "prompt_token_ids", "max_tokens", "prefer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    namespace: str
    model: str
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    prefer: str
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., namespace: _Optional[str] = ..., model: _Optional[str] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., prefer: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("mode", "prefill", "decode", "both", "reason", "cached_tokens", "predicted_ttft_s", "predicted_e2e_s", "debug", "decode_cached_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    BOTH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_E2E_S_FIELD_NUMBER: _ClassVar[int]
    DEBUG_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    prefill: _common_pb2.WorkerInfo
    decode: _common_pb2.WorkerInfo
    both: _common_pb2.WorkerInfo
    reason: str
    cached_tokens: int
    predicted_ttft_s: float
    predicted_e2e_s: float
    debug: str
    decode_cached_tokens: int
    def __init__(self, mode: _Optional[str] = ..., prefill: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., both: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_e2e_s: _Optional[float] = ..., debug: _Optional[str] = ..., decode_cached_tokens: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "loads")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    loads: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoadReport]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ..., loads: _Optional[_Iterable[_Union[_common_pb2.LoadReport, _Mapping]]] = ...) -> None: ...
