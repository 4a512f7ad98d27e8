from pdserve._proto.pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "namespace", "prompt", "lifecycle", "resume")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    namespace: str
    prompt: str
    lifecycle: _common_pb2.Lifecycle
    resume: Resume
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., namespace: _Optional[str] = ..., prompt: _Optional[str] = ..., lifecycle: _Optional[_Union[_common_pb2.Lifecycle, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("output_token_ids",)
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "namespace", "lifecycle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    namespace: str
    lifecycle: _common_pb2.Lifecycle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., namespace: _Optional[str] = ..., lifecycle: _Optional[_Union[_common_pb2.Lifecycle, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "cumulative_logprob", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    cumulative_logprob: float
    logprob: _common_pb2.TokenLogprob
    def __init__(self, token_id: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_tokens", "finished", "final", "kv", "num_cached_tokens", "times", "first")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    finished: bool
    final: _common_pb2.GenerateResponse
    kv: _common_pb2.KvHandle
    num_cached_tokens: int
    times: _common_pb2.StageTimes
    first: _common_pb2.GenerateResponse
    def __init__(self, request_id: _Optional[str] = ..., first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ..., finished: _Optional[bool] = ..., final: _Optional[_Union[_common_pb2.GenerateResponse, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., times: _Optional[_Union[_common_pb2.StageTimes, _Mapping]] = ..., first: _Optional[_Union[_common_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class GenerateFromPrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "namespace", "kv", "first_tokens", "lifecycle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    namespace: str
    kv: _common_pb2.KvHandle
    first_tokens: _containers.RepeatedCompositeFieldContainer[FirstToken]
    lifecycle: _common_pb2.Lifecycle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., namespace: _Optional[str] = ..., kv: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., first_tokens: _Optional[_Iterable[_Union[FirstToken, _Mapping]]] = ..., lifecycle: _Optional[_Union[_common_pb2.Lifecycle, _Mapping]] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KvHandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "layout")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout: _common_pb2.KvLayout
    def __init__(self, protocol_version: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ...) -> None: ...

class KvHandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "incarnation", "region", "tp_regions")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    TP_REGIONS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    incarnation: str
    region: _common_pb2.KvRegion
    tp_regions: _containers.RepeatedCompositeFieldContainer[_common_pb2.KvRegion]
    def __init__(self, protocol_version: _Optional[int] = ..., incarnation: _Optional[str] = ..., region: _Optional[_Union[_common_pb2.KvRegion, _Mapping]] = ..., tp_regions: _Optional[_Iterable[_Union[_common_pb2.KvRegion, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("load", "states", "role", "role_switch")
    class StatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_SWITCH_FIELD_NUMBER: _ClassVar[int]
    load: _common_pb2.LoadReport
    states: _containers.ScalarMap[str, int]
    role: str
    role_switch: str
    def __init__(self, load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ..., states: _Optional[_Mapping[str, int]] = ..., role: _Optional[str] = ..., role_switch: _Optional[str] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_s", "handoff")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    role: str
    drain_timeout_s: float
    handoff: str
    def __init__(self, role: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ..., handoff: _Optional[str] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("old_role", "role", "switched", "seconds", "drain_s", "drained_requests", "error", "handed_off", "handoff")
    OLD_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SWITCHED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    old_role: str
    role: str
    switched: bool
    seconds: float
    drain_s: float
    drained_requests: int
    error: str
    handed_off: int
    handoff: str
    def __init__(self, old_role: _Optional[str] = ..., role: _Optional[str] = ..., switched: _Optional[bool] = ..., seconds: _Optional[float] = ..., drain_s: _Optional[float] = ..., drained_requests: _Optional[int] = ..., error: _Optional[str] = ..., handed_off: _Optional[int] = ..., handoff: _Optional[str] = ...) -> None: ...
