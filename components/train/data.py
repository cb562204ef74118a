"""Training data: documents -> one packed token stream -> deterministic (inputs, labels) batches.

    build_token_stream(dataset, dataset_path, tokenizer) -> tokens_N (int32, 1-D)
        every document's tokens followed by tokenizer.eos_id, all documents concatenated.
    TokenBatchLoader(tokens_N, batch_size=B, seq_len=S, rank, world_size, seed)
        next_batch() -> (inputs_BS, labels_BS), int64, labels_BS = inputs shifted left by one.

Document sources (``[training] dataset``):
    python_stdlib: the .py files of the running Python's standard library (offline, deterministic
                   for a given Python; no site-packages, test/tests, idlelib), capped at max_bytes.
    local:         ``[training] dataset_path`` is a .jsonl/.json file (one JSON object per line),
                   a .parquet file, a ``datasets.save_to_disk`` directory (Dataset or DatasetDict,
                   split "train"), or a directory of .jsonl/.json/.parquet files (sorted).
"""

import json
import os
import sysconfig
from collections.abc import Iterator

import numpy as np
import torch

from components.errors import UserError

DEFAULT_STDLIB_BYTES = 16_000_000
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_LOCAL_EXPECTED = (
    "expected a .jsonl/.json/.parquet file, a directory of them, or a datasets.save_to_disk directory"
)


# ---------------------------------------------------------------------------------------------
# Document sources: each yields the documents' texts in a fixed order.
# ---------------------------------------------------------------------------------------------


def stdlib_documents(max_bytes: int = DEFAULT_STDLIB_BYTES) -> Iterator[str]:
    """The stdlib's .py files, sorted by relative path, at most ``max_bytes`` file bytes in all
    (the last file is truncated to fit)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                files.append(rel.replace(os.sep, "/"))
    budget = max_bytes
    for rel in sorted(files):
        if budget <= 0:
            return
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read(budget)
            truncated = f.read(1) != b""
        budget -= len(raw)
        # A truncated file may end in a cut multi-byte character: drop it rather than replace it.
        text = raw.decode("utf-8", errors="ignore" if truncated else "replace")
        if text:
            yield text


def _jsonl_documents(path: str, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{line_no} is not valid JSON ({e}); expected one JSON object per line") from e
            if not isinstance(record, dict) or text_field not in record:
                raise UserError(f"text field {text_field!r} not found in {path!r} (line {line_no})")
            text = record[text_field]
            if text:
                yield str(text)


def _parquet_documents(path: str, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UserError(f"reading {path!r} needs pyarrow: pip install pyarrow") from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path!r} is not a readable parquet file: {' '.join(str(e).split())[:200]}") from e
    if text_field not in pf.schema_arrow.names:
        raise UserError(f"text field {text_field!r} not found in {path!r} (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text:
                yield str(text)


def _hf_disk_documents(path: str, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise UserError(f"reading {path!r} needs the datasets package: pip install datasets") from e
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise UserError(f"{path!r} could not be loaded with datasets.load_from_disk: {' '.join(str(e).split())[:200]}") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{path!r} is a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise UserError(f"text field {text_field!r} not found in {path!r} (columns: {', '.join(ds.column_names)})")
    ds = ds.select_columns([text_field])
    for start in range(0, len(ds), 1024):
        for text in ds[start : start + 1024][text_field]:
            if text:
                yield str(text)


def _is_hf_disk(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _HF_DISK_MARKERS)


def _file_documents(path: str, text_field: str) -> Iterator[str]:
    if path.endswith(".parquet"):
        return _parquet_documents(path, text_field)
    return _jsonl_documents(path, text_field)


def local_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Documents of a local file or directory; the format is inferred from the path.
    The path is checked now; the files are read (and their text field checked) when iterated."""
    if not os.path.exists(path):
        raise UserError(f"[training] dataset_path = {path!r} does not exist; {_LOCAL_EXPECTED}")
    if os.path.isfile(path):
        if not path.endswith(_FILE_SUFFIXES):
            raise UserError(f"[training] dataset_path = {path!r} has an unknown format; {_LOCAL_EXPECTED}")
        return _file_documents(path, text_field)
    if _is_hf_disk(path):
        return _hf_disk_documents(path, text_field)
    files = []
    for dirpath, _, filenames in os.walk(path):
        files += [os.path.join(dirpath, n) for n in filenames if n.endswith(_FILE_SUFFIXES)]
    if not files:
        raise UserError(f"[training] dataset_path = {path!r} holds no .jsonl/.json/.parquet files; {_LOCAL_EXPECTED}")
    files.sort(key=lambda f: os.path.relpath(f, path).replace(os.sep, "/"))
    return (text for file in files for text in _file_documents(file, text_field))


# ---------------------------------------------------------------------------------------------
# Token stream
# ---------------------------------------------------------------------------------------------


def build_token_stream(
    dataset: str,
    dataset_path: str | None,
    tokenizer,
    text_field: str = "text",
    max_bytes: int | None = None,
) -> torch.Tensor:
    """All documents' tokens, each followed by ``tokenizer.eos_id``, as one int32 tensor tokens_N.

    ``max_bytes`` caps the python_stdlib corpus (None: DEFAULT_STDLIB_BYTES); local data is read
    whole unless ``max_bytes`` is given (then reading stops after that many text bytes).
    """
    if dataset == "python_stdlib":
        if dataset_path:
            raise UserError(
                f"[training] dataset_path = {dataset_path!r} is set but [training] dataset = 'python_stdlib' "
                "reads no path; set dataset = 'local' or clear dataset_path"
            )
        docs = stdlib_documents(DEFAULT_STDLIB_BYTES if max_bytes is None else max_bytes)
        where = "the python_stdlib corpus"
    elif dataset == "local":
        if not dataset_path:
            raise UserError("[training] dataset = 'local' needs [training] dataset_path (a .jsonl/.parquet file or directory)")
        dataset_path = os.path.expanduser(dataset_path)
        docs = local_documents(dataset_path, text_field)
        if max_bytes is not None:
            docs = _cap_bytes(docs, max_bytes)
        where = f"[training] dataset_path = {dataset_path!r}"
    else:
        raise UserError(f"[training] dataset = {dataset!r} is not known; expected 'python_stdlib' or 'local'")

    if tokenizer.eos_id is None:
        raise UserError(f"the tokenizer has no end-of-text token to separate documents of {where}")
    eos_1 = np.array([tokenizer.eos_id], dtype=np.int32)

    pieces = []
    chunk = []
    for text in docs:
        chunk.append(text)
        if len(chunk) == 256:
            pieces += [p for ids in tokenizer.encode_batch_to_arrays(chunk) for p in (ids, eos_1)]
            chunk = []
    if chunk:
        pieces += [p for ids in tokenizer.encode_batch_to_arrays(chunk) for p in (ids, eos_1)]
    if not pieces:
        raise UserError(f"{where} has no documents (no non-empty {text_field!r} values)")
    return torch.from_numpy(np.concatenate(pieces).astype(np.int32, copy=False))


def _cap_bytes(docs: Iterator[str], max_bytes: int) -> Iterator[str]:
    budget = max_bytes
    for text in docs:
        if budget <= 0:
            return
        raw = text.encode("utf-8")[:budget]
        budget -= len(raw)
        yield raw.decode("utf-8", errors="ignore")


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


class TokenBatchLoader:
    """Deterministic packed-sequence batches from a token stream.

    Window i is tokens_N[i*S : i*S + S + 1] (inputs never overlap), W = (N - 1) // S windows.
    Epoch e visits the windows in the order randperm(W, seed + e); each global batch is the next
    B * world_size windows of that order and rank r takes windows [r*B, (r+1)*B) of it. The
    incomplete tail of an epoch is dropped. State = (epoch, position = global batches consumed
    in that epoch), so resuming from state_dict() continues exactly where the loader stopped.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or seq_len < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad loader geometry: {batch_size=} {seq_len=} {rank=} {world_size=}")
        self.tokens_N = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size, self.seed = rank, world_size, seed

        self.num_windows = max(tokens.numel() - 1, 0) // seq_len
        global_batch = batch_size * world_size
        if self.num_windows < global_batch:
            raise UserError(
                f"dataset too small: {tokens.numel()} tokens give {self.num_windows} sequences of seq_len {seq_len}, "
                f"need at least {batch_size}*{world_size} = {global_batch}"
            )
        self.batches_per_epoch = self.num_windows // global_batch
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm_W = -1, None
        self._offsets_S1 = torch.arange(seq_len + 1)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm_W = torch.randperm(self.num_windows, generator=g)
            self._perm_epoch = epoch
        return self._perm_W

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_BS, labels_BS), int64 on CPU."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        B = self.batch_size
        start = self.position * B * self.world_size + self.rank * B
        windows_B = self._permutation(self.epoch)[start : start + B]
        idx_BS1 = windows_B[:, None] * self.seq_len + self._offsets_S1[None, :]
        seq_BS1 = self.tokens_N[idx_BS1].long()
        self.position += 1
        return seq_BS1[:, :-1], seq_BS1[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state_dict: dict[str, int], global_batch: int | None = None) -> None:
        """Continue where ``state_dict`` stopped. ``global_batch``: the sequences per step of the loader that
        saved it, when that differs from this one's ``batch_size * world_size`` (another rank count or batch
        size): its position counts those batches, so this loader starts at its first batch that holds no window
        read before in the epoch (fewer than one global batch of unread windows skipped)."""
        epoch, position = int(state_dict["epoch"]), int(state_dict["position"])
        saved = global_batch or self.batch_size * self.world_size
        if epoch < 0 or not 0 <= position * saved <= self.num_windows:
            raise UserError(
                f"data loader state epoch={epoch} position={position} does not fit this dataset "
                f"({self.num_windows // saved} batches per epoch); was the data or batch size changed?"
            )
        read = position * saved  # windows of the epoch's order already read
        self.epoch = epoch
        self.position = min(-(-read // (self.batch_size * self.world_size)), self.batches_per_epoch)
