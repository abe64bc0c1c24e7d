"""Type stubs of the compiled core (use the wrappers: shardkit.saev, .flat_tokens, .eagle3, .sdnb)."""

from typing import Any, Callable, Dict, Generic, Iterator, List, Optional, Sequence, Tuple, TypedDict, TypeVar, Union

__version__: str

# The core hands records and batches over as dicts with named keys (these TypedDicts exist
# only in this stub).

class WriterShape(TypedDict):
    n_examples: int
    n_layers: int
    tokens_per_example: int
    d_model: int

class DatasetLayout(TypedDict):
    n_examples: int
    n_layers: int
    tokens_per_example: int
    d_model: int
    content_tokens: int
    cls_token: bool
    examples_per_shard: int
    n_shards: int

class IndexedRow(TypedDict):
    act: "RustBuffer"
    example_idx: int
    token_idx: int
    token_label: Optional[int]

class SaevBatchOut(TypedDict):
    act: "RustBuffer"
    example_idx: "RustBuffer"
    token_idx: "RustBuffer"
    layer: Optional["RustBuffer"]
    token_label: Optional["RustBuffer"]
    cursor: int

class RankWorld(TypedDict):
    rank: int
    world_size: int


class RustBuffer:
    def __len__(self) -> int: ...

class Writer:
    def __init__(self, root: str, metadata_json: str, resume: bool = ...) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def start(self) -> str: ...
    @property
    def next_example(self) -> int: ...
    @property
    def shape(self) -> WriterShape: ...
    @property
    def content_tokens(self) -> int: ...
    def write(self, acts: Any, labels: Any = ...) -> None: ...
    def finish(self) -> str: ...
    def abort(self) -> None: ...

class Dataset:
    def __init__(self, path: str) -> None: ...
    @property
    def metadata_json(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def layout(self) -> DatasetLayout: ...
    @property
    def layers(self) -> List[int]: ...
    @property
    def has_labels(self) -> bool: ...
    @property
    def warnings(self) -> List[str]: ...
    def get(self, example: int, layer: int, token: int) -> RustBuffer: ...
    def take(self, examples: Sequence[int], layers: Sequence[int], tokens: Sequence[int]) -> RustBuffer: ...
    def indexed_len(self, layer: int, tokens: str) -> int: ...
    def indexed_get(self, layer: int, tokens: str, i: int) -> IndexedRow: ...

_Batch = TypeVar("_Batch", covariant=True)

class BatchIter(Iterator[_Batch], Generic[_Batch]):
    """One pass of any loader (the one class every format's ``iter()`` returns)."""

    def __next__(self) -> _Batch: ...
    def close(self) -> None: ...

DEFAULT_ORDER: str
"""The order every loader serves when none is asked for (``"block"``: shuffled)."""

class Loader:
    def __init__(
        self,
        path: str,
        layer: Union[int, str],
        tokens: str = ...,
        batch_size: int = ...,
        order: Optional[str] = ...,
        seed: int = ...,
        epoch: int = ...,
        rank: Optional[int] = ...,
        world_size: Optional[int] = ...,
        drop_last: bool = ...,
        memory_budget: Optional[int] = ...,
        ignore_labels: Sequence[int] = ...,
        io_threads: int = ...,
        direct_io: bool = ...,
        threads: int = ...,
        verify: bool = ...,
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def rank_world(self) -> RankWorld: ...
    @property
    def d_model(self) -> int: ...
    @property
    def order(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...
    def iter(self) -> BatchIter[SaevBatchOut]: ...
    @property
    def batch_bytes(self) -> int: ...
    def _set_batch_buffers(self, keeper: Any, regions: List[Tuple[int, int]]) -> None: ...
    def _drain(self) -> int: ...

def validate(path: str) -> str: ...
def inspect(path: str) -> str: ...

# flat-tokens (wrapped by shardkit.flat_tokens)

class FinishCounts(TypedDict):
    seq_count: int
    token_count: int
    max_token_id: int

class WriterCounts(FinishCounts):
    sequences_with_id_zero: int

class SplitCounts(TypedDict):
    token_count: int
    seq_count: int
    max_token_id: int

class SplitInfo(TypedDict):
    format: str
    completion: str
    sharded: bool

class HostRows(TypedDict):
    start: int
    end: int

class TokensBatchOut(TypedDict):
    step: int
    inputs: RustBuffer
    targets: RustBuffer
    segment_ids: RustBuffer
    is_seq_start: RustBuffer
    mask: RustBuffer

class TokensWriter:
    def __init__(
        self,
        path: str,
        split: str,
        layout: Optional[str] = ...,
        resume: bool = ...,
        checkpoint_tokens: int = ...,
        tokens_per_shard: Optional[int] = ...,
        tokens_per_chunk: Optional[int] = ...,
    ) -> None: ...
    @property
    def resumed_from(self) -> Optional[int]: ...
    @property
    def format(self) -> str: ...
    @property
    def counts(self) -> WriterCounts: ...
    def append_flat(self, tokens: Any, lengths: Any) -> None: ...
    def flush(self) -> None: ...
    def finish(self) -> FinishCounts: ...
    def abort(self) -> None: ...

class TokensSplit:
    def __init__(self, path: str, split: str) -> None: ...
    @property
    def counts(self) -> SplitCounts: ...
    @property
    def info(self) -> SplitInfo: ...
    @property
    def path(self) -> str: ...
    def seq_starts(self, start: int, stop: int) -> RustBuffer: ...
    def encoded(self, start: int, stop: int) -> RustBuffer: ...
    def ids(self, i: int) -> RustBuffer: ...

TokensBatchIter = BatchIter[TokensBatchOut]

class TokensLoader:
    def __init__(
        self,
        path: str,
        split: str,
        seq_len: int,
        batch_size: int,
        packed: bool,
        streams: int,
        read_blocks_per_shuffle_buffer: int,
        sequences_per_read_block: Optional[int],
        seed: int,
        host_index: int,
        host_count: int,
        epochs: bool,
        threads: int = ...,
        verify: bool = ...,
        buffer_in_memory: Optional[bool] = ...,
    ) -> None: ...
    @property
    def buffers_in_memory(self) -> bool: ...
    @property
    def step_count(self) -> int: ...
    @property
    def sequences_per_read_block(self) -> int: ...
    @property
    def batch_bytes(self) -> int: ...
    def _set_batch_buffers(self, keeper: Any, regions: List[Tuple[int, int]]) -> None: ...
    @property
    def host_rows(self) -> HostRows: ...
    def load(self, step: int) -> TokensBatchOut: ...
    def rows(self, step: int) -> RustBuffer: ...
    def state_dict(self, epoch: int, step: int) -> Dict[str, Any]: ...
    def resume_step(self, state: Dict[str, Any]) -> int: ...
    def iter(self, step: int) -> TokensBatchIter: ...

def tokens_validate(path: str) -> str: ...
def tokens_splits(path: str) -> List[str]: ...
def local_path(path: str) -> Optional[str]: ...
def tokens_inspect(path: str) -> str: ...
def tokens_mark_complete(path: str) -> None: ...
class ConvertedSplit(FinishCounts):
    split: str

def tokens_convert(src: str, dst: str, layout: str) -> List[ConvertedSplit]: ...
def tokens_build(
    path: str,
    split: str,
    inputs: List[str],
    field: Optional[str] = ...,
    tokenizer: Optional[str] = ...,
    tokenizer_is_json: bool = ...,
    layout: Optional[str] = ...,
    resume: bool = ...,
    append: bool = ...,
    checkpoint_tokens: int = ...,
    num_threads: int = ...,
    progress: Optional[Callable[[int, Optional[int], int, int], None]] = ...,
) -> str: ...

# EAGLE-3 (wrapped by shardkit.eagle3)

class Eagle3FieldSpec(TypedDict):
    name: str
    dtype: str
    shape: List[int]

class Eagle3Field(Eagle3FieldSpec):
    array: RustBuffer

class Eagle3BatchOut(TypedDict):
    cursor: int
    indices: List[int]
    fields: List[Eagle3Field]

class Eagle3Writer:
    def __init__(self, cache_dir: str, manifest_json: str, version: int = ..., resume: bool = ...) -> None: ...
    @property
    def manifest_json(self) -> str: ...
    @property
    def fields(self) -> List[Eagle3FieldSpec]: ...
    @property
    def next_sample(self) -> int: ...
    @property
    def resumed_from(self) -> Optional[int]: ...
    def add_rows(self, n: int, fields: Dict[str, Any]) -> None: ...
    def write_target_embeddings(self, data: Any, rows: int, cols: int) -> None: ...
    def finish(self) -> str: ...
    def abort(self) -> None: ...

class Eagle3Cache:
    def __init__(self, cache_dir: str, max_open: int = ...) -> None: ...
    def __len__(self) -> int: ...
    @property
    def manifest_json(self) -> str: ...
    def item(self, i: int) -> List[Eagle3Field]: ...
    def target_embeddings(self) -> RustBuffer: ...

Eagle3BatchIter = BatchIter[Eagle3BatchOut]

class Eagle3Loader:
    def __init__(
        self,
        cache_dir: str,
        batch_size: int,
        shuffle: bool = ...,
        seed: int = ...,
        epoch: int = ...,
        rank: Optional[int] = ...,
        world_size: Optional[int] = ...,
        drop_last: bool = ...,
        threads: int = ...,
        prefetch: int = ...,
        verify: bool = ...,
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def rank_world(self) -> RankWorld: ...
    @property
    def epoch(self) -> int: ...
    def indices(self) -> List[int]: ...
    def set_epoch(self, epoch: int) -> None: ...
    def advance_to(self, batch: int) -> None: ...
    @property
    def resumed(self) -> bool: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...
    def iter(self) -> Eagle3BatchIter: ...
    @property
    def batch_bytes(self) -> int: ...
    def _set_batch_buffers(self, keeper: Any, regions: List[Tuple[int, int]]) -> None: ...

def eagle3_validate(cache_dir: str, deep: bool = ...) -> str: ...
def eagle3_inspect(cache_dir: str) -> str: ...
def eagle3_set_version(cache_dir: str, version: int) -> str: ...

# SameDiff containers (wrapped by shardkit.sdnb)

class SdnbVariable(TypedDict):
    name: str
    var_type: str
    dtype: str
    shape: Optional[List[int]]
    storage: str
    nbytes: int
    order: str

class SdnbArray(TypedDict):
    dtype: str
    array: RustBuffer

class SdnbContainer:
    def __init__(self, path: str) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def shards(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def metadata(self) -> List[Tuple[str, str]]: ...
    @property
    def variables(self) -> List[SdnbVariable]: ...
    @property
    def op_count(self) -> int: ...
    @property
    def parts(self) -> List[str]: ...
    @property
    def extra_entries(self) -> List[str]: ...
    def extra_entry(self, name: str) -> bytes: ...
    def array(self, name: str) -> SdnbArray: ...
    def prefetch(self, names: List[str]) -> None: ...
    def close(self) -> None: ...

def sdnb_save(
    path: str,
    tensors: Sequence[Tuple[str, str, str, List[int], str, Any]],
    metadata: Sequence[Tuple[str, str]],
    format: Optional[str],
    shard_size: Optional[int],
    align: int,
    slack: int,
    extra_entries: Sequence[Tuple[str, bytes]],
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[str]: ...
def sdnb_convert(
    src: Union[str, SdnbContainer],
    dst: str,
    format: Optional[str],
    shard_size: Optional[int],
    metadata: Sequence[Tuple[str, str]],
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[str]: ...
class SetMetadataResult(TypedDict):
    in_place: bool
    files: List[str]

class Damage(TypedDict):
    file: str
    start: int
    end: int
    what: str

class CachedObject(TypedDict):
    url: str
    bytes: int
    pages: int
    last_used: float

class CacheInfo(TypedDict):
    dir: str
    bytes: int
    limit_bytes: int
    objects: List[CachedObject]

class ChecksumVerdict(TypedDict):
    has_sidecar: bool
    damage: List[Damage]

def sdnb_set_metadata(path: str, changes: Sequence[Tuple[str, Optional[str]]], rewrite: bool) -> SetMetadataResult: ...
def sdnb_validate(path: str, deep: bool = ...) -> str: ...
def checksum(path: str) -> str: ...
def transfer(
    src: str, dst: str, upload: bool, progress: Optional[Callable[[int, int], None]] = ...
) -> Dict[str, int]: ...
def storage_counters() -> Dict[str, int]: ...
def wait_for_cache() -> None: ...
def cache_info(dir: Optional[str] = ...) -> CacheInfo: ...
def clear_cache(url: Optional[str] = ..., dir: Optional[str] = ...) -> Dict[str, int]: ...
def verify_checksums(path: str) -> ChecksumVerdict: ...
# Tests only: present in builds with the `fault-injection` feature (scripts/test's), not in the
# user's wheel.
def _inject_fault(name: str, after: int) -> None: ...
def _clear_faults() -> None: ...
