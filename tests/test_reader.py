import os

import pytest
import torch
from safetensors.torch import save_file

from hf_prefetch import reader as reader_module
from hf_prefetch.checkpoint import Checkpoint
from hf_prefetch.reader import TensorReader


@pytest.fixture
def shards(tmp_path):
    """Two files whose tensors have odd sizes and offsets (so windows cut tensors anywhere)."""
    torch.manual_seed(0)
    tensors = {
        "a": torch.randn(1000, 37).to(torch.bfloat16),
        "b": torch.randint(0, 100, (3,), dtype=torch.int64),
        "c": torch.randn(5000),
        "d": torch.randn(17, 3, 11).to(torch.float16),
    }
    save_file({k: tensors[k] for k in "ab"}, str(tmp_path / "one.safetensors"))
    save_file({k: tensors[k] for k in "cd"}, str(tmp_path / "two.safetensors"))
    return tmp_path, tensors


def _checkpoint(folder):
    # A checkpoint over both files (as an index would make it).
    one, two = Checkpoint.open(folder / "one.safetensors"), Checkpoint.open(folder / "two.safetensors")
    return Checkpoint(folder, {**one.entries, **two.entries})


def _buffered_as_direct(monkeypatch):
    # Windowed reads through an ordinary descriptor: the windows, bounce buffers and copies run where the file
    # system refuses O_DIRECT (tmpfs in CI).
    monkeypatch.setattr(reader_module, "open_direct", lambda path: os.open(path, os.O_RDONLY))


@pytest.mark.parametrize("window_bytes", [4096, 8 * 2**20])
def test_windowed_reads_fill_host_tensors_bitwise(shards, monkeypatch, window_bytes):
    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", window_bytes)
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    for k in tensors:
        assert torch.equal(outs[k], tensors[k]), k
    total = sum(t.nbytes for t in tensors.values())
    assert reader.bytes_read == reader.direct_bytes == total


def test_cast_and_strided_destinations_are_read_through_the_page_cache(shards, monkeypatch):
    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    cast = torch.empty(1000, 37, dtype=torch.float32)
    strided = torch.empty(11, 3, 17, dtype=torch.float16).permute(2, 1, 0)
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
        reader.load([(checkpoint["a"], cast), (checkpoint["d"], strided)])
    assert torch.equal(cast, tensors["a"].float()) and torch.equal(strided, tensors["d"])
    assert reader.direct_bytes == 0


def test_direct_false_and_cached_files_read_through_the_page_cache(shards, monkeypatch):
    folder, tensors = shards
    opened = []
    monkeypatch.setattr(reader_module, "open_direct", lambda path: opened.append(path))
    out = torch.empty_like(tensors["c"])
    with _checkpoint(folder) as checkpoint:
        with TensorReader(checkpoint, direct=False) as reader:
            reader.load([(checkpoint["c"], out)])
        monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 1.0)  # the page cache holds it
        with TensorReader(checkpoint) as reader:
            reader.load([(checkpoint["c"], out)])
        monkeypatch.setattr(reader_module, "cached_fraction", lambda path: 0.1)  # on the disk only
        with TensorReader(checkpoint) as reader:
            reader.load([(checkpoint["c"], out)])
    assert opened == [folder / "two.safetensors"] and torch.equal(out, tensors["c"])


def test_a_file_truncated_after_opening_is_an_error_naming_it(shards, monkeypatch):
    folder, tensors = shards
    _buffered_as_direct(monkeypatch)
    with _checkpoint(folder) as checkpoint:
        os.truncate(folder / "two.safetensors", checkpoint["d"].offset + 10)
        out = torch.empty_like(tensors["d"])
        with TensorReader(checkpoint, direct=True) as reader, pytest.raises(ValueError, match="two.safetensors: the "
                                                                            "file ended at byte"):  # fmt: skip
            reader.load([(checkpoint["d"], out)])


def test_real_direct_io_where_the_file_system_allows_it(shards):
    folder, tensors = shards
    from hf_prefetch.diskio import open_direct

    fd = open_direct(folder / "one.safetensors")
    if fd is None:
        pytest.skip(f"the file system of {folder} refuses O_DIRECT")
    os.close(fd)
    outs = {k: torch.empty_like(t) for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=True) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k], tensors[k]) for k in tensors)
    assert reader.direct_bytes == reader.bytes_read


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [None, True])
def test_windowed_reads_onto_cuda(shards, monkeypatch, direct):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)
    outs = {k: torch.empty_like(t, device="cuda") for k, t in tensors.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint, direct=direct) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in tensors])
    assert all(torch.equal(outs[k].cpu(), tensors[k]) for k in tensors)


@pytest.mark.gpu
def test_windowed_reads_cast_onto_cuda(shards, monkeypatch):
    folder, tensors = shards
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)  # casts of pieces cut at many window boundaries
    casts = {"a": torch.float32, "c": torch.bfloat16, "d": torch.float32}
    outs = {k: torch.empty(tensors[k].shape, dtype=dtype, device="cuda") for k, dtype in casts.items()}
    with _checkpoint(folder) as checkpoint, TensorReader(checkpoint) as reader:
        reader.load([(checkpoint[k], outs[k]) for k in casts])
    assert all(torch.equal(outs[k].cpu(), tensors[k].to(casts[k])) for k in casts)
