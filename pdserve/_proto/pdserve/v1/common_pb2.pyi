from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GuidedSpec(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "allowed_token_ids", "has_allowed_token_ids", "bad_words", "no_repeat_ngram_size", "logprobs", "prompt_logprobs", "logprobs_mode", "skip_special_tokens", "guided", "beam_width", "length_penalty", "early_stopping")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    n: int
    best_of: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    typical_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_allowed_token_ids: bool
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    no_repeat_ngram_size: int
    logprobs: int
    prompt_logprobs: int
    logprobs_mode: str
    skip_special_tokens: bool
    guided: GuidedSpec
    beam_width: int
    length_penalty: float
    early_stopping: str
    def __init__(self, n: _Optional[int] = ..., best_of: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., has_allowed_token_ids: _Optional[bool] = ..., bad_words: _Optional[_Iterable[str]] = ..., no_repeat_ngram_size: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logprobs_mode: _Optional[str] = ..., skip_special_tokens: _Optional[bool] = ..., guided: _Optional[_Union[GuidedSpec, _Mapping]] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ...) -> None: ...

class Lifecycle(_message.Message):
    __slots__ = ("deadline_unix", "priority", "predicted_output_tokens", "kv_share")
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_SHARE_FIELD_NUMBER: _ClassVar[int]
    deadline_unix: float
    priority: int
    predicted_output_tokens: int
    kv_share: float
    def __init__(self, deadline_unix: _Optional[float] = ..., priority: _Optional[int] = ..., predicted_output_tokens: _Optional[int] = ..., kv_share: _Optional[float] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("fingerprint", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_bytes", "tp_size", "tp_rank", "kv_head_start", "total_kv_heads", "kv_cache_dtype", "kv_kind")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_KIND_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    tp_size: int
    tp_rank: int
    kv_head_start: int
    total_kv_heads: int
    kv_cache_dtype: str
    kv_kind: str
    def __init__(self, fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_bytes: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_kind: _Optional[str] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "base_addr", "num_blocks", "device_id", "mem_type", "layout")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    device_id: int
    mem_type: str
    layout: KvLayout
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("worker_id", "worker_address", "block_ids", "num_tokens", "lease_id", "lease_expiry_unix", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    lease_id: str
    lease_expiry_unix: float
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_expiry_unix: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "generated_tokens", "verified_tokens", "accepted_tokens", "kv_growth_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_GROWTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    generated_tokens: int
    verified_tokens: int
    accepted_tokens: int
    kv_growth_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., verified_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., kv_growth_tokens: _Optional[int] = ...) -> None: ...

class StageTimes(_message.Message):
    __slots__ = ("arrival", "first_scheduled", "first_token", "finished", "kv_transfer_start", "kv_transfer_end", "kv_bytes")
    ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_START_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_END_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    arrival: float
    first_scheduled: float
    first_token: float
    finished: float
    kv_transfer_start: float
    kv_transfer_end: float
    kv_bytes: int
    def __init__(self, arrival: _Optional[float] = ..., first_scheduled: _Optional[float] = ..., first_token: _Optional[float] = ..., finished: _Optional[float] = ..., kv_transfer_start: _Optional[float] = ..., kv_transfer_end: _Optional[float] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "outputs", "finished", "state", "usage", "error", "times", "prompt_logprobs", "retryable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    finished: bool
    state: str
    usage: Usage
    error: str
    times: StageTimes
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    retryable: bool
    def __init__(self, request_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[CompletionDelta, _Mapping]]] = ..., finished: _Optional[bool] = ..., state: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., times: _Optional[_Union[StageTimes, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., retryable: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "model", "agent_name", "capacity_blocks", "layout", "labels", "kv_transport", "role_switch", "kv_transport_observed")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class KvTransportObservedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ROLE_SWITCH_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    model: str
    agent_name: str
    capacity_blocks: int
    layout: KvLayout
    labels: _containers.ScalarMap[str, str]
    kv_transport: str
    role_switch: str
    kv_transport_observed: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., agent_name: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., kv_transport: _Optional[str] = ..., role_switch: _Optional[str] = ..., kv_transport_observed: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "num_running", "num_waiting", "kv_blocks_in_use", "kv_blocks_total", "pinned_blocks", "prefix_hit_ratio", "prefill_tokens_per_s", "prefill_overhead_s", "decode_step_s", "decode_step_per_seq_s", "pending_prefill_tokens", "kv_bytes_per_s", "handoff_overhead_s", "report_time", "max_num_seqs", "tensor_parallel_size", "decode_step0_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_PER_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    REPORT_TIME_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP0_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_running: int
    num_waiting: int
    kv_blocks_in_use: int
    kv_blocks_total: int
    pinned_blocks: int
    prefix_hit_ratio: float
    prefill_tokens_per_s: float
    prefill_overhead_s: float
    decode_step_s: float
    decode_step_per_seq_s: float
    pending_prefill_tokens: int
    kv_bytes_per_s: float
    handoff_overhead_s: float
    report_time: float
    max_num_seqs: int
    tensor_parallel_size: int
    decode_step0_s: float
    def __init__(self, worker_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_in_use: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., prefix_hit_ratio: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_overhead_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., decode_step_per_seq_s: _Optional[float] = ..., pending_prefill_tokens: _Optional[int] = ..., kv_bytes_per_s: _Optional[float] = ..., handoff_overhead_s: _Optional[float] = ..., report_time: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., decode_step0_s: _Optional[float] = ...) -> None: ...
