from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFingerprint(_message.Message):
    __slots__ = ("vocab_type", "vocab_size", "bos_token_id", "eos_token_ids", "token_texts_sha256", "token_texts_zlib")
    VOCAB_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_ZLIB_FIELD_NUMBER: _ClassVar[int]
    vocab_type: str
    vocab_size: int
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_texts_sha256: str
    token_texts_zlib: bytes
    def __init__(self, vocab_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., token_texts_sha256: _Optional[str] = ..., token_texts_zlib: _Optional[bytes] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("method", "max_k", "needs_hidden_states", "tokenizer", "server_version", "hidden_state_layers")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    method: str
    max_k: int
    needs_hidden_states: bool
    tokenizer: TokenizerFingerprint
    server_version: str
    hidden_state_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, method: _Optional[str] = ..., max_k: _Optional[int] = ..., needs_hidden_states: _Optional[bool] = ..., tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., server_version: _Optional[str] = ..., hidden_state_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("data", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("seq_id", "base_len", "append_token_ids", "k", "temperature", "hidden_states", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    base_len: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    temperature: float
    hidden_states: HiddenStates
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, seq_id: _Optional[str] = ..., base_len: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., temperature: _Optional[float] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("round_id", "sequences", "released_seq_ids")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., released_seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SequenceDraft(_message.Message):
    __slots__ = ("seq_id", "draft_token_ids", "draft_probs", "vocab_size", "resync", "draft_probs_token_ids", "draft_probs_values", "draft_parents")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_VALUES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: bytes
    vocab_size: int
    resync: bool
    draft_probs_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs_values: bytes
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., resync: _Optional[bool] = ..., draft_probs_token_ids: _Optional[_Iterable[int]] = ..., draft_probs_values: _Optional[bytes] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("round_id", "sequences")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDraft]
    def __init__(self, round_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDraft, _Mapping]]] = ...) -> None: ...
