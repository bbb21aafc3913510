"""Checkpoint parsing, validation and reading: hand-written safetensors files, good and bad."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_prefetch import checkpoint as checkpoint_module
from hf_prefetch.checkpoint import Checkpoint, TensorReader


def write_raw(path, header, data: bytes = b"", header_bytes: int | None = None) -> None:
    """A safetensors file with the given header (dict or raw bytes) and data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if header_bytes is None else header_bytes
    path.write_bytes(struct.pack("<Q", length) + raw + data)


def entry(dtype="F32", shape=(2, 2), begin=0, end=16) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


ZEROS = b"\0" * 16
# (name, header, data, header length override, expected message)
BAD_FILES = [
    ("too_short", None, b"", None, r"is truncated: 3 bytes"),
    ("header_beyond_file", {"w": entry()}, ZEROS, 4096, r"declares a 4096-byte header but holds only"),
    ("header_over_cap", {"w": entry()}, ZEROS, 200_000_000, r"above safetensors' 100000000-byte limit"),
    ("invalid_json", b"{not json", b"", None, r"invalid JSON header"),
    ("not_an_object", [1, 2], b"", None, r"not a JSON object"),
    ("unknown_dtype", {"w": entry(dtype="F4")}, ZEROS, None, r"'w' has dtype 'F4'.*known dtypes"),
    ("missing_field", {"w": {"dtype": "F32", "shape": [4]}}, ZEROS, None, r"'w' needs 'dtype', 'shape'"),
    ("negative_shape", {"w": entry(shape=(-2, 2))}, ZEROS, None, r"'w' has shape \[-2, 2\]"),
    ("huge_dim", {"w": entry(shape=(2**64, 0), end=0)}, ZEROS, None, r"'w' has shape \[18446744073709551616, 0\]"),
    ("deep_json", b"[" * 100_000 + b"]" * 100_000, b"", None, r"invalid JSON header"),
    ("bool_offsets", {"w": entry(begin=False)}, ZEROS, None, r"'w' has data_offsets \[False, 16\]"),
    ("offsets_out_of_range", {"w": entry(begin=0, end=32)}, ZEROS, None, r"'w' has data_offsets \[0, 32\] outside"),
    ("reversed_offsets", {"w": entry(begin=16, end=0)}, ZEROS, None, r"'w' has data_offsets \[16, 0\] outside"),
    ("size_mismatch", {"w": entry(end=12)}, ZEROS, None, r"'w' holds 12 bytes but dtype F32 x shape \[2, 2\]"),
    (
        "overlap",
        {"a": entry(), "b": entry(begin=8, end=24)},
        ZEROS + ZEROS,
        None,
        r"bytes of 'b' overlap those of 'a'",
    ),
    ("bad_metadata", {"__metadata__": [1], "w": entry()}, ZEROS, None, r"__metadata__ must be a JSON object"),
]


@pytest.mark.parametrize("name, header, data, header_bytes, message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_file_is_rejected_with_its_name(tmp_path, name, header, data, header_bytes, message):
    path = tmp_path / "model.safetensors"
    if header is None:
        path.write_bytes(b"abc")
    else:
        write_raw(path, header, data, header_bytes)
    with pytest.raises(ValueError, match=message) as info:
        Checkpoint.open(tmp_path)
    assert str(path) in str(info.value)
    assert "Re-" in str(info.value) or "Convert" in str(info.value)  # every message says how to fix it


def write_sharded(folder, weight_map: dict[str, str], shards: dict[str, dict[str, torch.Tensor]]) -> None:
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_round_trip(tmp_path):
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int64)
    shards = {"s1.safetensors": {"a": a}, "s2.safetensors": {"b": b}}
    write_sharded(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}, shards)
    with Checkpoint.open(tmp_path) as checkpoint:
        assert sorted(checkpoint.keys()) == ["a", "b"]
        assert checkpoint["a"].shape == (3, 4) and checkpoint["b"].dtype == torch.int64
        assert checkpoint.nbytes == a.nbytes + b.nbytes
        with TensorReader(checkpoint) as reader:
            assert torch.equal(reader.read_tensor(checkpoint["a"]), a)
            assert torch.equal(reader.read_tensor(checkpoint["b"]), b)


# (name, weight map, shards written, error type, expected message)
BAD_INDEXES = [
    ("missing_shard", {"w": "gone.safetensors"}, {}, FileNotFoundError, r"maps 'w' .* to 'gone.safetensors', but"),
    ("parent_dir", {"w": "../w.safetensors"}, {}, ValueError, r"maps 'w' to '../w.safetensors', which is outside"),
    ("absolute", {"w": "/etc/passwd"}, {}, ValueError, r"maps 'w' to '/etc/passwd', which is outside"),
    ("key_not_in_shard", {"w": "s.safetensors", "x": "s.safetensors"}, {"s.safetensors": ["w"]}, ValueError,
     r"maps 'x' to 's.safetensors', but that file has no such tensor"),
    ("stored_twice", {"w": "s1.safetensors"}, {"s1.safetensors": ["w"], "s2.safetensors": ["w"]}, ValueError,
     r"'w' is stored twice"),
]  # fmt: skip


@pytest.mark.parametrize("name, weight_map, shards, error, message", BAD_INDEXES, ids=[c[0] for c in BAD_INDEXES])
def test_bad_index_is_rejected(tmp_path, name, weight_map, shards, error, message):
    if name == "stored_twice":
        weight_map = {"w": "s1.safetensors", "v": "s2.safetensors"}
        shards = {"s1.safetensors": {"w": torch.ones(2)}, "s2.safetensors": {"w": torch.ones(2), "v": torch.ones(1)}}
    else:
        shards = {shard: {key: torch.ones(2) for key in keys} for shard, keys in shards.items()}
    write_sharded(tmp_path, weight_map, shards)
    with pytest.raises(error, match=message):
        Checkpoint.open(tmp_path)


def test_index_symlink_leading_out_is_rejected(tmp_path):
    outside, folder = tmp_path / "outside", tmp_path / "ckpt"
    outside.mkdir()
    folder.mkdir()
    save_file({"w": torch.ones(2)}, str(outside / "s.safetensors"))
    (folder / "s.safetensors").symlink_to(outside / "s.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "s.safetensors"}}))
    with pytest.raises(ValueError, match=r"resolves to .*outside/s.safetensors, outside the checkpoint folder"):
        Checkpoint.open(folder)


def test_hub_cache_symlinks_into_blobs_are_allowed(tmp_path):
    # huggingface_hub keeps snapshots/<revision>/<file> as symlinks to ../../blobs/<hash>.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(blobs / "f00d"))
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blobs / "f00d", snapshot))
    with Checkpoint.open(snapshot) as checkpoint:
        assert checkpoint.keys() == ["w"]


@pytest.mark.parametrize(
    "index, message",
    [("{oops", r"is not valid JSON"), ('{"weight_map": ["w"]}', r"has no 'weight_map' object")],
)
def test_malformed_index_json(tmp_path, index, message):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=message):
        Checkpoint.open(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds neither model.safetensors.index.json nor model.safetensors"):
        Checkpoint.open(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        Checkpoint.open(tmp_path / "nope.safetensors")


def test_file_truncated_after_open(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64)}, str(path))
    checkpoint = Checkpoint.open(path)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 100)
    out = np.empty(checkpoint["w"].nbytes, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"the file ended while reading 'w'"):
        checkpoint.read(checkpoint["w"], out)
    checkpoint.close()


def test_reader_fills_host_tensors_in_chunks_with_casts(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "_CHUNK_BYTES", 64)  # many reads per tensor
    tensors = {
        "f32": torch.randn(7, 33),
        "bf16": torch.randn(50).to(torch.bfloat16),
        "i64": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    expected = load_file(str(tmp_path / "model.safetensors"))
    outs = {
        "f32": torch.empty(7, 33, dtype=torch.bfloat16),  # cast through small temporaries
        "bf16": torch.empty(50, dtype=torch.bfloat16),  # straight into the bytes
        "i64": torch.empty(4, 3, dtype=torch.int64).t(),  # not contiguous: whole-tensor temporary
        "flag": torch.empty(3, dtype=torch.bool),
        "scalar": torch.empty((), dtype=torch.float64),
        "empty": torch.empty(0, 4),
    }
    read = []
    with Checkpoint.open(tmp_path) as checkpoint, TensorReader(checkpoint, on_read=read.append) as reader:
        reader.load([(checkpoint[key], out) for key, out in outs.items()])
        with pytest.raises(ValueError, match=r"'f32' has shape \[7, 33\], the destination \[33, 7\]"):
            reader.load([(checkpoint["f32"], torch.empty(33, 7))])
    for key, out in outs.items():
        assert torch.equal(out, expected[key].to(out.dtype)), key
    assert sum(read) == reader.bytes_read == sum(t.nbytes for t in tensors.values())
    assert len(read) > len(tensors)  # big tensors were split into several reads


def test_reader_error_propagates_and_waits_for_other_reads(tmp_path, monkeypatch):
    save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(checkpoint_module, "_CHUNK_BYTES", 256)
    real_read = Checkpoint.read

    def flaky(self, entry, out, start=0):
        if entry.key == "b" and start >= 2048:
            raise OSError("disk on fire")
        real_read(self, entry, out, start)

    monkeypatch.setattr(Checkpoint, "read", flaky)
    with Checkpoint.open(tmp_path) as checkpoint, TensorReader(checkpoint) as reader:
        with pytest.raises(OSError, match="disk on fire"):
            reader.load([(checkpoint["a"], torch.empty(1000)), (checkpoint["b"], torch.empty(1000))])
