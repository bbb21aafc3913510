"""Checkpoint parsing, validation and reading: hand-written safetensors files, good and bad."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hf_prefetch.loading import reader as reader_module
from hf_prefetch.loading.checkpoint import Checkpoint
from hf_prefetch.loading.reader import TensorReader


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
        r"bytes of 'b' \[8, 24\) overlap those of 'a' \[0, 16\)",
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


def saved_file(folder) -> tuple[str, bytes]:
    """The header text (JSON and the spaces padding it) and the data section of a file written by save_file."""
    path = folder / "saved.safetensors"
    tensors = {"first": torch.arange(4.0), "second": torch.arange(6.0).reshape(2, 3) + 10}
    save_file(tensors, str(path), metadata={"note": "seven"})  # this metadata makes save_file pad with 7 spaces
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    text, data = raw[8 : 8 + length].decode(), raw[8 + length :]
    assert len(text) - len(text.rstrip(" ")) == 7 and len(data) == 40  # "first" is bytes [0, 16), "second" [16, 40)
    return text, data


def pack(text: str, data: bytes, length_change: int = 0) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw) + length_change) + raw + data


def padded(header: dict) -> str:
    raw = json.dumps(header, separators=(",", ":"))
    return raw + " " * (-len(raw) % 8)  # as save_file pads


Make = Callable[[str, bytes], bytes]  # (saved header text, saved data) -> the bytes of the file to test


def rewrite(text=lambda t: t, data=lambda d: d, length_change: int = 0) -> Make:
    """The saved file with its header text and data section changed, and its length field off by `length_change`."""
    return lambda t, d: pack(text(t), data(d), length_change)


def edited(change: Callable[[dict], dict]) -> Make:
    """The saved file with its header JSON replaced by `change(header)`."""
    return lambda t, d: pack(padded(change(json.loads(t))), d)


def shifted(key: str, by: int) -> Make:
    """`by` zero bytes inserted before tensor `key` (`-by` bytes removed if negative); it and those after it moved."""

    def make(text: str, data: bytes) -> bytes:
        header = json.loads(text)
        begin = header[key]["data_offsets"][0]
        for info in header.values():
            if "data_offsets" in info and info["data_offsets"][0] >= begin:
                info["data_offsets"] = [offset + by for offset in info["data_offsets"]]
        data = data[:begin] + bytes(by) + data[begin:] if by >= 0 else data[: begin + by] + data[begin:]
        return pack(padded(header), data)

    return make


def with_metadata(**metadata) -> Make:
    return edited(lambda header: {**header, "__metadata__": metadata})


def with_entries(**entries) -> Make:
    return edited(lambda header: {**header, **entries})


# (name, how the saved file is changed, expected message; None: safetensors and hf_prefetch both accept the file)
HEADER_CASES = [
    # A length field short by k <= 7 leaves the JSON whole (it ends in 7 spaces of padding): the data section then
    # starts k bytes early, and only the bytes left after the last tensor tell.
    *[(f"length_short_by_{k}", rewrite(length_change=-k), rf"the last {k} bytes belong to no") for k in range(1, 8)],
    ("length_short_by_8", rewrite(length_change=-8), r"invalid JSON header"),  # cuts the closing brace
    ("length_long_by_4", rewrite(length_change=4), r"invalid JSON header"),  # the header takes 4 NUL data bytes
    (
        "length_long_by_4_into_spaces",
        rewrite(data=lambda d: b"    " + d[4:], length_change=4),
        r"'second' has data_offsets \[16, 40\] outside the file's 36-byte data section",
    ),
    ("gap_before_first", shifted("first", 4), r"bytes \[0, 4\) of the data section, before 'first', belong to no"),
    ("gap_between", shifted("second", 4), r"bytes \[16, 20\) of the data section, between 'first' and 'second'"),
    ("overlap", shifted("second", -4), r"bytes of 'second' \[12, 36\) overlap those of 'first' \[0, 16\)"),
    (
        "empty_tensor_inside_another",
        with_entries(empty=entry(shape=(0,), begin=8, end=8)),
        r"bytes of 'empty' \[8, 8\) overlap those of 'first'",
    ),
    ("trailing_bytes", rewrite(data=lambda d: d + bytes(4)), r"the last 4 bytes belong to no tensor"),
    ("data_too_short", rewrite(data=lambda d: d[:-4]), r"'second' has data_offsets \[16, 40\] outside the file's 36"),
    ("metadata_not_string", with_metadata(note="seven", step=3), r"__metadata__ 'step' is 3, not a string"),
    (
        "shape_overflows",
        with_entries(empty=entry(shape=(2**32, 2**32, 0), begin=40, end=40)),
        r"'empty' has shape \[4294967296, 4294967296, 0\].*overflows",
    ),
    ("nan_in_header", rewrite(text=lambda t: t.replace('"F32"', '"F32","x":NaN', 1)), r"invalid JSON header"),
    ("lone_surrogate", rewrite(text=lambda t: t.replace('"first"', '"first\\ud800"')), r"invalid JSON header"),
    ("as_saved", rewrite(), None),
    ("other_whitespace_padding", rewrite(text=lambda t: t.rstrip() + " \t\r\n \n\t"), None),
    ("leading_whitespace", rewrite(text=lambda t: "\n" + t[:-1]), None),
    ("metadata_null", edited(lambda header: {**header, "__metadata__": None}), None),
    ("metadata_empty", with_metadata(), None),
    (
        "empty_tensors",
        with_entries(at_start=entry(shape=(0,), begin=0, end=0), at_end=entry(shape=(3, 0), begin=40, end=40)),
        None,
    ),
    ("no_tensors", rewrite(text=lambda t: "{}      ", data=lambda d: b""), None),  # what save_file({}) writes
]


def read_with_safetensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}


@pytest.mark.parametrize("name, make, message", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_header_is_checked_as_strictly_as_safetensors(tmp_path, name, make, message):
    path = tmp_path / "model.safetensors"
    path.write_bytes(make(*saved_file(tmp_path)))
    if message is not None:
        with pytest.raises(SafetensorError):
            read_with_safetensors(path)
        with pytest.raises(ValueError, match=message) as info:
            Checkpoint.open(path)
        assert str(path) in str(info.value) and "Re-" in str(info.value)
        return
    expected = read_with_safetensors(path)
    with Checkpoint.open(path) as checkpoint, TensorReader(checkpoint) as reader:
        got = {key: reader.read_tensor(checkpoint[key]) for key in checkpoint.keys()}
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


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


def _descriptors_of(folder) -> int:
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            pass
    return sum(path.startswith(str(folder)) for path in opened)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_checkpoint_dropped_without_its_close_closes_its_files(tmp_path):
    # A Ctrl-C as `close` began (the end of a load's `with`) left a descriptor per shard for the process's life.
    import gc

    shards = {"s1.safetensors": {"a": torch.randn(3)}, "s2.safetensors": {"b": torch.randn(2)}}
    write_sharded(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"}, shards)
    checkpoint = Checkpoint.open(tmp_path)
    for key in ("a", "b"):
        checkpoint.fd(checkpoint[key].path)
    assert _descriptors_of(tmp_path) == 2
    del checkpoint
    gc.collect()
    assert _descriptors_of(tmp_path) == 0
    with Checkpoint.open(tmp_path) as checkpoint:  # closed at the end of its block, as before
        checkpoint.fd(checkpoint["a"].path)
    assert _descriptors_of(tmp_path) == 0


# (name, weight map, shards written, error type, expected message)
BAD_INDEXES = [
    ("missing_shard", {"w": "gone.safetensors"}, {}, FileNotFoundError, r"maps 'w' to 'gone.safetensors', but"),
    ("missing_shard_of_two", {"w": "gone.safetensors", "x": "gone.safetensors"}, {}, FileNotFoundError,
     r"maps 'w' \(and 1 more\) to 'gone.safetensors', but"),
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


def test_a_folder_of_bin_files_names_a_fix_transformers_5_runs(tmp_path):
    # save_pretrained(..., safe_serialization=True) was the fix named: transformers 5 has no such parameter (it always
    # writes safetensors).
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError) as raised:
        Checkpoint.open(tmp_path)
    message = str(raised.value)
    assert "['pytorch_model.bin']" in message and "PyTorch pickles" in message and "safe_serialization" not in message
    assert f"AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).save_pretrained(new_folder)" in message
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"\(found \[\]\)\. Save the model with model\.save_pretrained\(folder\)"
    ):
        Checkpoint.open(tmp_path)


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
    monkeypatch.setattr(reader_module, "_CHUNK_BYTES", 64)  # many reads per tensor
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
    monkeypatch.setattr(reader_module, "_CHUNK_BYTES", 256)
    real_read = Checkpoint.read

    def flaky(self, entry, out, start=0):
        if entry.key == "b" and start >= 2048:
            raise OSError("disk on fire")
        real_read(self, entry, out, start)

    monkeypatch.setattr(Checkpoint, "read", flaky)
    with Checkpoint.open(tmp_path) as checkpoint, TensorReader(checkpoint) as reader:
        with pytest.raises(OSError, match="disk on fire"):
            reader.load([(checkpoint["a"], torch.empty(1000)), (checkpoint["b"], torch.empty(1000))])
