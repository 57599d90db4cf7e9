from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutorRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTOR_ROLE_UNSPECIFIED: _ClassVar[ExecutorRole]
    EXECUTOR_ROLE_BOTH: _ClassVar[ExecutorRole]
    EXECUTOR_ROLE_PREFILL: _ClassVar[ExecutorRole]
    EXECUTOR_ROLE_DECODE: _ClassVar[ExecutorRole]

class KVTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KVTransport]
    KV_TRANSPORT_GRPC: _ClassVar[KVTransport]
    KV_TRANSPORT_SHM: _ClassVar[KVTransport]

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
EXECUTOR_ROLE_UNSPECIFIED: ExecutorRole
EXECUTOR_ROLE_BOTH: ExecutorRole
EXECUTOR_ROLE_PREFILL: ExecutorRole
EXECUTOR_ROLE_DECODE: ExecutorRole
KV_TRANSPORT_UNSPECIFIED: KVTransport
KV_TRANSPORT_GRPC: KVTransport
KV_TRANSPORT_SHM: KVTransport
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType

class KVBlockList(_message.Message):
    __slots__ = ("seq_id", "block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("sequences", "transport", "chunk_bytes", "instance_id", "leader_epoch")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[KVBlockList]
    transport: KVTransport
    chunk_bytes: int
    instance_id: str
    leader_epoch: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[KVBlockList, _Mapping]]] = ..., transport: _Optional[_Union[KVTransport, str]] = ..., chunk_bytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("sequences", "dtype", "shape", "num_bytes", "crc32", "transport", "shm_name", "host_id", "instance_id", "leader_epoch", "shm_reuse")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHM_REUSE_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[KVBlockList]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    crc32: int
    transport: KVTransport
    shm_name: str
    host_id: str
    instance_id: str
    leader_epoch: int
    shm_reuse: bool
    def __init__(self, sequences: _Optional[_Iterable[_Union[KVBlockList, _Mapping]]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., transport: _Optional[_Union[KVTransport, str]] = ..., shm_name: _Optional[str] = ..., host_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., shm_reuse: _Optional[bool] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("export", "dst_address", "dst_sequences", "dst_instance_id", "dst_tls_server_name")
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    DST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DST_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_TLS_SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    export: ExportKVRequest
    dst_address: str
    dst_sequences: _containers.RepeatedCompositeFieldContainer[KVBlockList]
    dst_instance_id: str
    dst_tls_server_name: str
    def __init__(self, export: _Optional[_Union[ExportKVRequest, _Mapping]] = ..., dst_address: _Optional[str] = ..., dst_sequences: _Optional[_Iterable[_Union[KVBlockList, _Mapping]]] = ..., dst_instance_id: _Optional[str] = ..., dst_tls_server_name: _Optional[str] = ...) -> None: ...

class ImportKVResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("instance_id", "model_name", "architecture", "dtype", "device", "block_size", "num_device_blocks", "num_cpu_blocks", "max_model_len", "vocab_size", "eos_token_ids", "attention_backend", "max_logprobs", "tensor_parallel_size", "draining", "hidden_size", "cpu_kernel_isa", "max_loras", "max_lora_rank", "draft_model_name", "draft_num_layers", "draft_vocab_size", "role", "kv_push")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNEL_ISA_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model_name: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_device_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    max_logprobs: int
    tensor_parallel_size: int
    draining: bool
    hidden_size: int
    cpu_kernel_isa: str
    max_loras: int
    max_lora_rank: int
    draft_model_name: str
    draft_num_layers: int
    draft_vocab_size: int
    role: ExecutorRole
    kv_push: bool
    def __init__(self, instance_id: _Optional[str] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., max_logprobs: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., draining: _Optional[bool] = ..., hidden_size: _Optional[int] = ..., cpu_kernel_isa: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., draft_model_name: _Optional[str] = ..., draft_num_layers: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., role: _Optional[_Union[ExecutorRole, str]] = ..., kv_push: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "num_logprobs", "min_tokens", "min_tokens_suppressed_ids", "logit_bias", "num_prompt_logprobs", "prompt_only", "pooling")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_SUPPRESSED_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ONLY_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    num_logprobs: int
    min_tokens: int
    min_tokens_suppressed_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    num_prompt_logprobs: int
    prompt_only: bool
    pooling: PoolingParams
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., num_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., min_tokens_suppressed_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., num_prompt_logprobs: _Optional[int] = ..., prompt_only: _Optional[bool] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("type", "normalize", "dimensions")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    type: PoolingType
    normalize: bool
    dimensions: int
    def __init__(self, type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "sampling_params", "block_table", "num_computed_tokens", "num_scheduled_tokens", "lora_name", "lora_path")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_name: str
    lora_path: str
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_table: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class BlockReplacement(_message.Message):
    __slots__ = ("logical_index", "block_id")
    LOGICAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    logical_index: int
    block_id: int
    def __init__(self, logical_index: _Optional[int] = ..., block_id: _Optional[int] = ...) -> None: ...

class CachedSequence(_message.Message):
    __slots__ = ("seq_id", "new_block_ids", "new_token_ids", "num_scheduled_tokens", "num_computed_tokens", "replaced_blocks", "spec_token_ids", "num_draft_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    num_computed_tokens: int
    replaced_blocks: _containers.RepeatedCompositeFieldContainer[BlockReplacement]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., replaced_blocks: _Optional[_Iterable[_Union[BlockReplacement, _Mapping]]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class BlockMapping(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class ExecuteModelRequest(_message.Message):
    __slots__ = ("step_id", "new_sequences", "cached_sequences", "finished_seq_ids", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "decode_seq_ids", "decode_num_computed_tokens", "instance_id", "leader_epoch", "after_step_id", "token_masks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CACHED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    cached_sequences: _containers.RepeatedCompositeFieldContainer[CachedSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    decode_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    leader_epoch: int
    after_step_id: int
    token_masks: TokenMasks
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., cached_sequences: _Optional[_Iterable[_Union[CachedSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[str]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., decode_seq_ids: _Optional[_Iterable[str]] = ..., decode_num_computed_tokens: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., after_step_id: _Optional[int] = ..., token_masks: _Optional[_Union[TokenMasks, _Mapping]] = ...) -> None: ...

class TokenMasks(_message.Message):
    __slots__ = ("seq_positions", "row_index", "rows")
    SEQ_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROW_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    seq_positions: _containers.RepeatedScalarFieldContainer[int]
    row_index: _containers.RepeatedScalarFieldContainer[int]
    rows: bytes
    def __init__(self, seq_positions: _Optional[_Iterable[int]] = ..., row_index: _Optional[_Iterable[int]] = ..., rows: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs", "spec_sampled", "draft_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    spec_sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., spec_sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "entries")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    first_position: int
    entries: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprob]
    def __init__(self, seq_id: _Optional[str] = ..., first_position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[PromptTokenLogprob, _Mapping]]] = ...) -> None: ...

class PromptTokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ExecuteModelResponse(_message.Message):
    __slots__ = ("step_id", "sampled", "execute_time_us", "decode_token_ids", "decode_logprobs", "prompt_logprobs", "draining", "pooled")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_time_us: int
    decode_token_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    draining: bool
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_time_us: _Optional[int] = ..., decode_token_ids: _Optional[_Iterable[int]] = ..., decode_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., draining: _Optional[bool] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("seq_id", "data")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    data: bytes
    def __init__(self, seq_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("files", "tokenizer_class")
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CLASS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    tokenizer_class: str
    def __init__(self, files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ..., tokenizer_class: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("leader_epoch",)
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    def __init__(self, leader_epoch: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("num_dropped",)
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_dropped: int
    def __init__(self, num_dropped: _Optional[int] = ...) -> None: ...
