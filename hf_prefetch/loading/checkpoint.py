"""The checkpoint: safetensors files (one, or shards named by an index), parsed, validated and read by position.

A checkpoint is untrusted input. `Checkpoint.open` reads only the headers and checks every value in them against
the files before anyone allocates anything: header lengths, JSON, dtypes, shapes, byte ranges (which must tile the
data section exactly, as safetensors requires), and (for sharded checkpoints) that every shard exists and lies inside
the checkpoint folder. `Checkpoint.read` copies a tensor's bytes into a caller's buffer with positional reads;
filling caller-owned tensors from a thread pool is `reader.TensorReader`'s job. The checkpoint knows
nothing about models: which tensor goes where is the loader's call.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from ..interrupts import deferred_interrupts

__all__ = ["Checkpoint", "TensorEntry", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# The safetensors format refuses headers above 100 MB; so do we, before reading them.
MAX_HEADER_BYTES = 100_000_000

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where its bytes are (`offset` is absolute in `path`) and what they hold. A slice
    of a stored tensor (a tensor-parallel rank's columns, loading/sharded.py) is `rows` runs of `nbytes / rows`
    bytes, `row_stride` bytes apart; every other entry is one run."""

    key: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    rows: int = 1
    row_stride: int = 0

    @property
    def one_run(self) -> bool:
        """Whether the entry's bytes are one run of its file (what mapping, direct I/O and extents need)."""
        return self.rows == 1


class Checkpoint:
    """The validated tensors of a safetensors checkpoint, read with positional reads (thread-safe).

    Example:

    ```python
    >>> import tempfile, numpy as np, torch
    >>> from safetensors.torch import save_file
    >>> from hf_prefetch.loading.checkpoint import Checkpoint
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, f"{folder}/model.safetensors")
    ...     with Checkpoint.open(folder) as checkpoint:
    ...         entry = checkpoint["w"]
    ...         out = np.empty(entry.nbytes, dtype=np.uint8)
    ...         checkpoint.read(entry, out)
    >>> entry.dtype, entry.shape, torch.from_numpy(out).view(entry.dtype).reshape(entry.shape)
    (torch.float32, (2, 3), tensor([[0., 1., 2.],
            [3., 4., 5.]]))

    ```
    """

    def __init__(self, folder: Path, entries: dict[str, TensorEntry], metadata: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.entries = entries
        self.metadata = metadata or {}  # the files' `__metadata__`, merged (torchao describes its tensors there)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        # What `close` did not get to (a Ctrl-C as it began, a checkpoint dropped unclosed) closes when this goes.
        weakref.finalize(self, _close_all, self._fds)

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        """Parse and validate a checkpoint: a folder, a `.safetensors` file, or a `model.safetensors.index.json`.

        Raises `FileNotFoundError` for missing files and `ValueError` for anything malformed, naming the file, the
        key and the fix. Reads headers only.
        """
        path = Path(path)
        if path.is_dir():
            folder = path
            if (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
                path = path / SAFE_WEIGHTS_INDEX_NAME
            elif (path / SAFE_WEIGHTS_NAME).is_file():
                path = path / SAFE_WEIGHTS_NAME
            else:
                names = sorted(p.name for p in folder.iterdir())
                if any(name.endswith(".bin") for name in names):  # pytorch_model.bin, or its shards
                    fix = (
                        "Its .bin files are PyTorch pickles, which hf_prefetch does not read: load the model with "
                        "transformers and save it again, in safetensors (save_pretrained's default), e.g. "
                        f"AutoModelForCausalLM.from_pretrained({str(folder)!r}).save_pretrained(new_folder)."
                    )
                else:
                    fix = "Save the model with model.save_pretrained(folder), which writes safetensors."
                raise FileNotFoundError(
                    f"{folder} holds neither {SAFE_WEIGHTS_INDEX_NAME} nor {SAFE_WEIGHTS_NAME} (found {names[:10]}). "
                    + fix
                )
        elif not path.is_file():
            raise FileNotFoundError(f"Checkpoint {path} does not exist; pass a folder or a .safetensors file.")
        else:
            folder = path.parent
        if path.name.endswith(".json"):
            return cls(folder, *_entries_from_index(path, folder))
        _check_inside(path, folder, path, "the checkpoint file")
        return cls(folder, *_parse_file(path))

    def __getitem__(self, key: str) -> TensorEntry:
        return self.entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[str]:
        return list(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def read(self, entry: TensorEntry, out: np.ndarray, start: int = 0) -> None:
        """Fill `out` (contiguous uint8) with `out.nbytes` bytes of `entry`, beginning at byte `start` of it."""
        if start < 0 or start + out.nbytes > entry.nbytes:
            raise ValueError(f"Bytes [{start}, {start + out.nbytes}) are outside {entry.key!r} ({entry.nbytes} B).")
        view, fd = memoryview(out).cast("B"), self.fd(entry.path)
        run, first = entry.nbytes // entry.rows, 0
        while first < len(view):  # each run of the entry that bytes [start, start + out.nbytes) cross
            row, within = divmod(start + first, run)
            last = min(first + run - within, len(view))
            position, done = entry.offset + row * entry.row_stride + within, first
            while done < last:
                got = os.preadv(fd, [view[done:last]], position + done - first)
                if got == 0:
                    raise ValueError(
                        f"{entry.path}: the file ended while reading {entry.key!r} (byte {position + done - first}); "
                        "it was truncated after it was opened. Re-download or re-save the checkpoint."
                    )
                done += got
            first = last

    def close(self) -> None:
        with self._lock, deferred_interrupts():
            _close_all(self._fds)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        files = len({entry.path for entry in self.entries.values()})
        return f"Checkpoint({str(self.folder)!r}, tensors={len(self)}, files={files}, nbytes={self.nbytes})"

    def fd(self, path: Path) -> int:
        """A descriptor of one of the checkpoint's files, opened once and shared (positional reads only)."""
        with self._lock:
            if path not in self._fds:
                with deferred_interrupts():  # opened and recorded with no Ctrl-C between: `close` finds it
                    self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]


def _close_all(fds: dict[Path, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])


def _entries_from_index(index_path: Path, folder: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    _check_inside(index_path, folder, index_path, "the index")
    if index_path.stat().st_size > MAX_HEADER_BYTES:
        raise ValueError(f"{index_path} is over {MAX_HEADER_BYTES} bytes: not a weight map. Re-save the checkpoint.")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{index_path} is not valid JSON ({err}). Re-download or re-save the checkpoint.") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"{index_path} has no 'weight_map' object of tensor name -> shard file name. Re-save the checkpoint."
        )
    keys_by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        keys_by_shard.setdefault(shard, []).append(key)

    entries: dict[str, TensorEntry] = {}
    metadata: dict[str, str] = {}
    for shard, keys in keys_by_shard.items():
        shard_path = folder / shard
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise ValueError(
                f"{index_path} maps {keys[0]!r} to {shard!r}, which is outside the checkpoint folder {folder}. "
                "Shard names must be plain file names next to the index; fix the index or move the shard."
            )
        if not shard_path.is_file():
            raise FileNotFoundError(
                f"{index_path} maps {keys[0]!r}{f' (and {len(keys) - 1} more)' if len(keys) > 1 else ''} to "
                f"{shard!r}, but {shard_path} does not exist. Download the missing shard or re-save the checkpoint."
            )
        _check_inside(shard_path, folder, index_path, f"the shard holding {keys[0]!r}")
        parsed, shard_metadata = _parse_file(shard_path)
        metadata.update(shard_metadata)
        for key in keys:
            if key not in parsed:
                raise ValueError(
                    f"{index_path} maps {key!r} to {shard!r}, but that file has no such tensor. The index and the "
                    "shards are from different saves: re-download or re-save the checkpoint."
                )
        for key, entry in parsed.items():
            if key in entries:
                raise ValueError(
                    f"Tensor {key!r} is stored twice: in {entries[key].path.name} and in {shard_path.name}. "
                    "Re-save the checkpoint."
                )
            entries[key] = entry
    return entries, metadata


def _check_inside(path: Path, folder: Path, named_by: Path, what: str) -> None:
    # A symlink may lead out of the folder; resolve it. Hugging Face's cache keeps a snapshot's files as symlinks into
    # the repository's `blobs` folder, which belongs to the same checkpoint.
    roots = [folder.resolve()]
    if folder.resolve().parent.name == "snapshots":
        roots.append(folder.resolve().parent.parent / "blobs")
    target = path.resolve()
    if not any(target.is_relative_to(root) for root in roots):
        raise ValueError(
            f"{named_by} names {what} at {path}, which resolves to {target}, outside the checkpoint folder "
            f"{folder.resolve()}. Checkpoint files must live inside the checkpoint folder; copy them there."
        )


def _parse_file(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    # The rules are safetensors' own (`SafeTensors::read_metadata` and `Metadata::validate` in its Rust source): a file
    # that safetensors refuses is refused here too, and one it accepts is accepted unless it holds a dtype that
    # hf_prefetch cannot load or a dimension of 2**63 or more.
    file_bytes = path.stat().st_size
    header_bytes, header = _read_header(path, file_bytes)
    metadata = header.pop("__metadata__", None)
    _check_metadata(path, metadata)
    data_start, data_bytes = 8 + header_bytes, file_bytes - 8 - header_bytes
    entries = {key: _parse_entry(path, key, info, data_start, data_bytes) for key, info in header.items()}
    _check_coverage(path, list(entries.values()), header_bytes, data_bytes)
    return entries, metadata or {}


def _read_header(path: Path, file_bytes: int) -> tuple[int, dict[str, Any]]:
    # The header's length (the file's first 8 bytes) and its JSON object.
    if file_bytes < 8:
        raise ValueError(
            f"{path} is truncated: {file_bytes} bytes, fewer than the 8-byte header length of a safetensors file. "
            "Re-download or re-save it."
        )
    with open(path, "rb") as file:
        header_bytes = int.from_bytes(file.read(8), "little")
        if header_bytes > MAX_HEADER_BYTES:
            raise ValueError(
                f"{path} declares a {header_bytes}-byte header, above safetensors' {MAX_HEADER_BYTES}-byte limit; "
                "the file is corrupt or not a safetensors file. Re-download or re-save it."
            )
        if header_bytes > file_bytes - 8:
            raise ValueError(
                f"{path} declares a {header_bytes}-byte header but holds only {file_bytes - 8} bytes after the "
                "length: the file is truncated. Re-download or re-save it."
            )
        raw = file.read(header_bytes)
    try:
        # Like serde_json, which safetensors uses: the JSON may be surrounded by whitespace (save_file pads it with
        # spaces), but NaN, Infinity and lone UTF-16 surrogates ("\ud800", which cannot be encoded) are refused.
        header = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as err:  # UnicodeError and JSONDecodeError are ValueErrors
        raise ValueError(
            f"{path} has an invalid JSON header ({err}); the file is corrupt or not a safetensors file. "
            "Re-download or re-save it."
        ) from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object of tensor entries. Re-download or re-save it.")
    return header_bytes, header


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _check_metadata(path: Path, metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ must be a JSON object of strings. Re-download or re-save it.")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ValueError(
                f"{path}: __metadata__ {key!r} is {value!r:.50}, not a string; safetensors allows only strings there. "
                "Re-save the file with string metadata."
            )


def _parse_entry(path: Path, key: str, info: Any, data_start: int, data_bytes: int) -> TensorEntry:
    where = f"{path}: tensor {key!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"{where} needs 'dtype', 'shape' and 'data_offsets'; got {info!r:.200}. Re-save the file.")
    dtype = _DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise ValueError(
            f"{where} has dtype {info['dtype']!r:.50}, which hf_prefetch cannot load; known dtypes are "
            f"{sorted(_DTYPES)}. Convert the tensor to one of them and re-save."
        )
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) and d < 2**63 for d in shape):
        raise ValueError(f"{where} has shape {shape!r:.100}; a shape is a list of non-negative ints. Re-save it.")
    expected = _nbytes(shape, dtype.itemsize)
    if expected is None:
        raise ValueError(
            f"{where} has shape {shape}: its size in elements or bits overflows 64 bits, which safetensors refuses "
            "even where a dimension is 0. Re-save the file."
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise ValueError(f"{where} has data_offsets {offsets!r:.100}; expected [begin, end]. Re-save the file.")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise ValueError(
            f"{where} has data_offsets [{begin}, {end}] outside the file's {data_bytes}-byte data section: the file "
            "is truncated, or its header length is too large. Re-download or re-save it."
        )
    if end - begin != expected:
        raise ValueError(
            f"{where} holds {end - begin} bytes but dtype {info['dtype']} x shape {shape} needs {expected}; the file "
            "is corrupt. Re-download or re-save it."
        )
    return TensorEntry(key, path, dtype, tuple(shape), data_start + begin, expected)


def _nbytes(shape: list[int], itemsize: int) -> int | None:
    # The bytes of a tensor, or None where safetensors' checked 64-bit arithmetic overflows: it multiplies the
    # dimensions in order, then by the dtype's size in bits.
    count = 1
    for factor in [*shape, 8 * itemsize]:
        count *= factor
        if count >= 2**64:
            return None
    return count // 8


def _check_coverage(path: Path, entries: list[TensorEntry], header_bytes: int, data_bytes: int) -> None:
    # Sorted by (begin, end), the tensors must tile the data section exactly: no gap, no overlap, no byte after the
    # last one. A header length a few bytes short of the header's end (the JSON still parses when it was padded with
    # spaces) shifts every tensor; the bytes it leaves after the last tensor are what tells.
    data_start, covered, previous = 8 + header_bytes, 0, None
    for entry in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        begin = entry.offset - data_start
        if begin < covered:
            raise ValueError(
                f"{path}: the bytes of {entry.key!r} [{begin}, {begin + entry.nbytes}) overlap those of "
                f"{previous.key!r} [{previous.offset - data_start}, {covered}); the file is corrupt. "
                "Re-download or re-save it."
            )
        if begin > covered:
            between = f"between {previous.key!r} and {entry.key!r}" if previous else f"before {entry.key!r}"
            raise ValueError(
                f"{path}: bytes [{covered}, {begin}) of the data section, {between}, belong to no tensor; safetensors "
                "refuses such files. Re-download or re-save it."
            )
        covered, previous = begin + entry.nbytes, entry
    if covered != data_bytes:
        raise ValueError(
            f"{path}: the tensors end at byte {covered} of the {data_bytes}-byte data section: the last "
            f"{data_bytes - covered} bytes belong to no tensor. Either the header length ({header_bytes}) stops "
            f"short of the header's end, which would have every tensor read {data_bytes - covered} bytes early, or "
            "bytes were appended to the file. Re-download or re-save it."
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
