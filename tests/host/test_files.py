"""Mapped host storage ([Note: mapped host storage]): streamed weights stored as they are loaded stay in the page
cache's own pages, mapped read-only into the host arena, until something writes or hands out host storage; then they
become private memory at the same addresses, and the checkpoint's files never change."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_prefetch
from hf_prefetch.host import arena as host
from hf_prefetch.host import files as host_files
from hf_prefetch.host.arena import HostArena
from hf_prefetch.host.files import FilePiece
from hf_prefetch.lifecycle.state import Lifecycle
from hf_prefetch.runtime.engine import PrefetchEngine
from tests.models import logits, prompt

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128)  # fmt: skip
EVERY_SECOND = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)


def _save(folder, seed: int = 0, shard: str = "200KB"):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(folder, max_shard_size=shard)
    return model


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


@pytest.fixture
def saved(tmp_path):
    return tmp_path, _save(tmp_path)


# --- the arena --------------------------------------------------------------------------------------------------


def _file(tmp_path, nbytes: int = 5 * 4096 + 123):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "weights.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


def _mapped(tmp_path, sizes: list[int], offsets: list[int | None]):
    """An arena whose entry i is the file's bytes at offsets[i] (None: private memory), the file and its bytes."""
    path, data = _file(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    try:
        pieces = [None if offset is None else FilePiece(str(path), fd, offset) for offset in offsets]
        return HostArena(sizes, files=pieces), path, data
    finally:
        os.close(fd)  # the arena keeps its own descriptor


def _wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the other thread stopped making progress"
        time.sleep(0.001)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_file_entries_are_the_files_bytes_and_stay_so_at_the_same_addresses_once_writable(tmp_path):
    # unaligned offsets, a private entry between two file ones, an entry ending in the file's last page
    offsets = [7, None, 3 * 4096 - 10, 20000]
    sizes = [1000, 5000, 4200, 5 * 4096 + 123 - 20000]
    arena, path, data = _mapped(tmp_path, sizes, offsets)
    views = [arena.view(i, (n,), (1,), torch.uint8) for i, n in enumerate(sizes)]
    addresses = [v.data_ptr() for v in views]
    assert arena.file_bytes == 4096 * (1 + 3 + 2) and arena.nbytes >= arena.file_bytes + 5000
    for view, offset, size in zip(views, offsets, sizes, strict=True):
        if offset is not None:
            assert view.data_ptr() % 4096 == offset % 4096
            assert torch.equal(view, data[offset : offset + size])
    views[1].fill_(3)
    arena.make_writable()
    assert arena.file_bytes == 0
    assert [v.data_ptr() for v in views] == addresses
    for view, offset, size in zip(views, offsets, sizes, strict=True):
        expected = data[offset : offset + size] if offset is not None else torch.full((size,), 3)
        assert torch.equal(view, expected.to(torch.uint8))
    for view in views:
        view.fill_(9)  # private now: writable, and the file stays as it was
    assert path.read_bytes() == data.numpy().tobytes()
    arena.make_writable()  # idempotent
    arena.release()
    assert (views[0] == 9).all()  # views outlive the arena


def test_the_arena_keeps_one_descriptor_per_file_until_it_is_writable_or_released(tmp_path):
    path, data = _file(tmp_path)
    fd = os.open(path, os.O_RDONLY)
    before = _open_fds()
    arena = HostArena([100, 100], files=[FilePiece(str(path), fd, 0), FilePiece(str(path), fd, 9000)])
    assert _open_fds() == before + 1
    arena.make_writable()
    assert _open_fds() == before
    second = HostArena([100], files=[FilePiece(str(path), fd, 0)])
    assert _open_fds() == before + 1
    second.release()
    assert _open_fds() == before
    third = HostArena([100], files=[FilePiece(str(path), fd, 0)])
    del third  # dropped without release: its finalizer closes it
    assert _open_fds() == before
    os.close(fd)


def test_a_file_changed_since_it_was_mapped_is_reported_and_nothing_is_copied(tmp_path):
    arena, path, _ = _mapped(tmp_path, [2000], [100])
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place, say
    with pytest.raises(RuntimeError, match=r"weights\.bin changed on disk since it was loaded.*map_files=False"):
        arena.make_writable()
    assert arena.file_bytes == 4096


def test_a_file_replaced_or_deleted_after_it_was_mapped_is_not_a_change(tmp_path):
    # What the Hub's cache does to a shard: a new file under its name, or the name removed. The mapping holds the old
    # inode, whose status-change time moves with its link count: not a write.
    arena, path, data = _mapped(tmp_path, [2000], [100])
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(bytes(len(data)))
    os.replace(replacement, path)
    arena.check_files()
    path.unlink()
    arena.check_files()
    arena.make_writable()
    assert torch.equal(arena.view(0, (2000,), (1,), torch.uint8), data[100:2100])


def test_a_copy_that_fails_half_way_leaves_every_entry_as_it_was(tmp_path, monkeypatch):
    arena, _, data = _mapped(tmp_path, [4000, 4000], [0, 8192 + 5])
    read_into, calls = host_files._read_into, []

    def fail_second(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        read_into(*args)

    monkeypatch.setattr(host_files, "_read_into", fail_second)
    with pytest.raises(KeyboardInterrupt):
        arena.make_writable()
    assert arena.file_bytes == 2 * 4096  # neither region replaced
    assert torch.equal(arena.view(1, (4000,), (1,), torch.uint8), data[8197:12197])
    monkeypatch.setattr(host_files, "_read_into", read_into)
    arena.make_writable()
    assert arena.file_bytes == 0 and torch.equal(arena.view(1, (4000,), (1,), torch.uint8), data[8197:12197])


def test_a_file_cut_short_since_it_was_mapped_raises_instead_of_faulting(tmp_path):
    arena, path, _ = _mapped(tmp_path, [3000], [4096])
    stamp = path.stat()
    os.truncate(path, 5000)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the same modification time: only the size differs
    with pytest.raises(RuntimeError, match="size 20603 -> 5000 bytes"):
        arena.make_writable()


# --- the loader -------------------------------------------------------------------------------------------------


def test_streamed_weights_stored_as_loaded_are_mapped_and_compute_bitwise(saved):
    folder, reference = saved
    expected = logits(reference)
    mapped = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    copied = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu", map_files=False)
    arena, plain = hf_prefetch.get_state(mapped).arena, hf_prefetch.get_state(copied).arena
    assert arena.file_bytes == arena.nbytes > 0 and plain.file_bytes == 0
    assert torch.equal(logits(mapped), expected) and torch.equal(logits(copied), expected)
    cast = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu", dtype=torch.bfloat16)
    assert hf_prefetch.get_state(cast).arena.file_bytes == 0  # cast on the way in: nothing to map


def test_map_files_arguments(saved):
    folder, _ = saved
    with pytest.raises(ValueError, match="map_files='yes' must be True"):
        hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu", map_files="yes")
    with pytest.raises(ValueError, match="direct_io=True reads around the page cache, and map_files=True"):
        hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu", direct_io=True, map_files=True)
    direct = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu", direct_io=True)
    assert hf_prefetch.get_state(direct).arena.file_bytes == 0


def test_a_file_system_that_cannot_map_falls_back_to_reads(saved, monkeypatch, caplog):
    folder, reference = saved

    def refuse(*args, **kwargs):
        raise OSError(19, "mapping refused")

    monkeypatch.setattr(host_files._File, "__init__", refuse)
    with caplog.at_level("INFO", logger="hf_prefetch.loading"):
        model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    assert hf_prefetch.get_state(model).arena.file_bytes == 0
    assert "Streamed weights are copied into host memory" in caplog.text
    assert torch.equal(logits(model), logits(reference))


def test_state_dict_makes_storage_private_and_a_save_over_the_loaded_folder_round_trips(saved):
    folder, reference = saved
    expected = logits(reference)
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    arena = hf_prefetch.get_state(model).arena
    state_dict = model.state_dict()
    assert arena.file_bytes == 0
    assert all(torch.equal(state_dict[k], v) for k, v in reference.state_dict().items())
    model.save_pretrained(folder, max_shard_size="200KB")  # truncates and rewrites the files it was loaded from
    assert torch.equal(logits(model), expected)
    assert torch.equal(logits(hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")), expected)


@pytest.mark.parametrize("how", ["load_state_dict", "reload_weights", "sync_from_device", "remove_offload"])
def test_writes_go_to_private_memory_never_to_the_checkpoint(saved, tmp_path_factory, how):
    folder, _ = saved
    other = _save(tmp_path_factory.mktemp("other"), seed=1)
    before = _digest(folder)
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    arena = hf_prefetch.get_state(model).arena
    assert arena.file_bytes > 0
    if how == "load_state_dict":
        model.load_state_dict(other.state_dict())
    elif how == "reload_weights":
        hf_prefetch.reload_weights(model, other.state_dict())
    elif how == "sync_from_device":
        hf_prefetch.sync_from_device(model)
    else:
        hf_prefetch.remove_offload(model, "cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(-1)
    assert arena.file_bytes == 0
    assert _digest(folder) == before
    if how in ("load_state_dict", "reload_weights"):
        assert torch.equal(logits(model), logits(other))


def test_state_dict_beside_another_threads_forwards(saved):
    folder, reference = saved
    expected = logits(reference)
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    results, stop = [], threading.Event()

    def forwards():
        while not stop.is_set():
            results.append(torch.equal(logits(model), expected))

    thread = threading.Thread(target=forwards)
    thread.start()
    try:
        _wait_for(lambda: len(results) >= 3)
        state_dict = model.state_dict()
        count = len(results)
        _wait_for(lambda: len(results) >= count + 3)
    finally:
        stop.set()
        thread.join()
    assert hf_prefetch.get_state(model).arena.file_bytes == 0
    assert all(results) and len(results) >= 6
    assert all(torch.equal(state_dict[k], v) for k, v in reference.state_dict().items())


def test_page_locking_is_read_only_for_file_pages_and_redone_for_the_private_copy(tmp_path, monkeypatch):
    # No CUDA here: the registrations are recorded, in order, instead of made.
    calls = []
    monkeypatch.setattr(host, "_register", lambda buffer, flags=0: calls.append(("lock", flags)) or True)
    monkeypatch.setattr(host, "_unregister", lambda pointer: calls.append(("unlock", pointer)))
    arena, _, _ = _mapped(tmp_path, [3000, 500], [10, None])
    assert arena.pin()
    base = arena.view(0, (1,), (1,), torch.uint8).data_ptr() - 10
    arena.make_writable()
    assert calls == [("lock", host._REGISTER_PORTABLE | host._REGISTER_READ_ONLY), ("unlock", base), ("lock", 0)]
    assert arena.pinned


def _compiled_forwards(model, calls: int) -> list[torch.Tensor]:
    torch._dynamo.reset()  # no earlier test's compiled code or recompilation limit in the way
    try:
        compiled = torch.compile(model, backend="eager")
        with torch.no_grad():
            return [compiled(prompt(vocab=128)).logits for _ in range(calls)]
    finally:
        torch._dynamo.reset()  # nor this one's in a later test's


def test_a_cuda_model_running_compiled_code_turns_mapped_storage_private_before_its_next_call(saved, monkeypatch):
    # torch.compile warms a function up before its CUDA graphs record it: the gate's next call makes the pages
    # private first. The state's device is faked to take the CUDA path on the CPU.
    folder, reference = saved
    expected = logits(reference)
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    state = hf_prefetch.get_state(model)
    monkeypatch.setattr(state, "device", torch.device("cuda"))
    outs = _compiled_forwards(model, 1)
    assert state.arena.file_bytes > 0  # the first compiled call: compiled code ran only inside it
    outs.append(logits(model))
    assert state.arena.file_bytes == 0  # made private at the next call's start, before it computed
    assert all(torch.equal(out, expected) for out in outs)


def test_the_cpu_keeps_mapped_storage_under_compiled_code(saved):
    folder, reference = saved
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    assert all(torch.equal(out, logits(reference)) for out in _compiled_forwards(model, 2))
    assert hf_prefetch.get_state(model).arena.file_bytes > 0  # no CUDA graphs to record: nothing copied


def test_a_refused_copy_before_graphs_warns_once_and_computes(saved, monkeypatch):
    folder, reference = saved
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    state = hf_prefetch.get_state(model)
    monkeypatch.setattr(state, "device", torch.device("cuda"))

    def refuse(nbytes, *args, **kwargs):
        raise ValueError(f"The host arena for offloaded weights needs {nbytes} bytes, but only 0 are left.")

    monkeypatch.setattr(host.limits, "check_host_memory", refuse)
    with pytest.warns(UserWarning, match="stay the checkpoint's pages.*needs 368640 bytes.*map_files=False") as record:
        outs = _compiled_forwards(model, 2)
    assert record[0].filename == __file__  # the caller's line, past hf_prefetch's and torch's frames
    assert state.private_refused and state.arena.file_bytes > 0
    assert all(torch.equal(out, logits(reference)) for out in outs)


def test_compiled_forwards_of_a_pipeline_placement(saved):
    # Its engine is one per "GPU" behind one interface, which the compiled ops mark too.
    folder, reference = saved
    two = {0: 360_000, 1: 360_000, "cpu": "1GiB"}  # two "GPUs" on the CPU, three layers streamed
    model = hf_prefetch.from_pretrained(folder, max_memory=two, reserve_bytes=0, device="cpu")
    state = hf_prefetch.get_state(model)
    assert type(state.engine).__name__ == "DeviceEngines" and state.arena.file_bytes > 0
    assert all(torch.equal(out, logits(reference)) for out in _compiled_forwards(model, 2))
    assert state.engine.compiled


def test_state_dict_and_writes_are_refused_once_graphs_recorded_copies_from_the_files(saved, monkeypatch):
    folder, reference = saved
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    arena = hf_prefetch.get_state(model).arena
    monkeypatch.setattr(PrefetchEngine, "graphs", property(lambda self: True))  # as after a capture on CUDA
    for attempt in (model.state_dict, lambda: hf_prefetch.reload_weights(model, reference.state_dict())):
        with pytest.raises(RuntimeError, match="CUDA graphs recorded copies of the streamed weights"):
            attempt()
        assert arena.file_bytes > 0
    monkeypatch.undo()
    assert torch.equal(logits(model), logits(reference))


def test_a_module_kept_after_its_model_was_dropped_can_be_written_without_touching_the_file(saved):
    folder, reference = saved
    before = _digest(folder)
    decoder = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu").model  # the model itself is dropped
    weight = decoder.layers[1].mlp.up_proj.weight  # streamed: back in host storage, once the model's pages
    assert torch.equal(weight, reference.model.layers[1].mlp.up_proj.weight)
    with torch.no_grad():
        weight.mul_(-1)  # copy-on-write now: this process's page, not the file's
    assert torch.equal(weight, -reference.model.layers[1].mlp.up_proj.weight)
    assert _digest(folder) == before


def test_a_shard_whose_data_is_not_aligned_to_its_dtype_is_read_not_mapped(tmp_path):
    reference = _save(tmp_path, shard="10GB")
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.dumps(json.loads(raw[8 : 8 + length]), separators=(",", ":")).encode()
    header += b" " * ((1 - 8 - len(header)) % 8)  # the data starts at an odd byte: float32 views cannot start there
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])
    model = hf_prefetch.from_pretrained(tmp_path, EVERY_SECOND, device="cpu")
    assert hf_prefetch.get_state(model).arena.file_bytes == 0
    assert torch.equal(logits(model), logits(reference))


def test_a_shard_changed_on_disk_stops_forwards_and_removals_before_anything_changes(saved):
    from hf_prefetch.lifecycle import detach as detaching

    folder, reference = saved
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    state = hf_prefetch.get_state(model)
    shard = sorted(folder.glob("*.safetensors"))[1]
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a write over it would
    attempts = (
        lambda: logits(model),
        lambda: model.model(prompt(vocab=128)),  # the decoder called on its own: gated like the model
        lambda: hf_prefetch.remove_offload(model, "cpu"),
        # to a GPU: refused before any move (no GPU here)
        lambda: detaching.detach(model, state, torch.device("cuda")),
    )
    for attempt in attempts:
        with pytest.raises(RuntimeError, match=f"{shard.name} changed on disk since it was loaded"):
            attempt()
    assert state.lifecycle is Lifecycle.ATTACHED and state.arena.file_bytes > 0
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert torch.equal(logits(model), logits(reference))


def _out_of_memory(module, target):
    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def _first_streamed(model) -> str:
    # A streamed parameter that points at the start of host storage (after its layer's hook was removed).
    state = hf_prefetch.get_state(model)
    start = state.arena.bytes_view(0, 1).data_ptr()
    return next(name for name, p in model.named_parameters() if p.data_ptr() == start)


@pytest.mark.parametrize(
    "refusal",
    [None, ValueError("host storage: no memory for a private copy (simulated)"), KeyboardInterrupt()],
    ids=["private copy", "copy-on-write", "Ctrl-C during the private copy"],
)
def test_a_removal_to_a_gpu_that_stops_half_way_leaves_no_weight_on_the_file_s_pages(saved, monkeypatch, refusal):
    # Out of memory half-way through the moves: what did not move is the caller's host memory, which a write would
    # fault on while it is the file's pages. A private copy where the host's memory allows, else (refused, or a
    # second Ctrl-C during it) the pages mapped copy-on-write. (The move is simulated: this runs without a GPU.)
    # Finished on the CPU instead.
    from hf_prefetch.lifecycle import detach as detaching

    folder, reference = saved
    expected, files = logits(reference), _digest(folder)
    model = hf_prefetch.from_pretrained(folder, EVERY_SECOND, device="cpu")
    state = hf_prefetch.get_state(model)
    assert state.arena.file_bytes > 0
    monkeypatch.setattr(detaching, "move_tensors", _out_of_memory)
    if refusal is not None:

        def refuse(self):
            raise refusal

        monkeypatch.setattr(HostArena, "make_writable", refuse)
    interrupted = isinstance(refusal, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt if interrupted else torch.OutOfMemoryError) as raised:
        detaching.detach(model, state, torch.device("cuda"))
    cause = raised.value.__context__ if interrupted else raised.value
    assert isinstance(cause, torch.OutOfMemoryError) and "simulated" in str(cause)
    assert state.lifecycle is Lifecycle.DETACHING and state.arena.file_bytes == 0 and not state.arena.pinned
    streamed = _first_streamed(model)
    weight = model.get_parameter(streamed).data
    weight.copy_(weight.clone())  # a write: no fault, the page private or copied on this write
    monkeypatch.undo()
    hf_prefetch.remove_offload(model, "cpu")  # a removal stopped half-way goes where it is told now
    assert hf_prefetch.get_state(model) is None and all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(logits(model), expected)
    assert _digest(folder) == files  # the checkpoint never changed


def test_an_exception_between_a_move_and_its_bookkeeping_leaves_the_arena_true_to_the_kernel(tmp_path, monkeypatch):
    # A signal handler's exception (SystemExit, say) is not held back like a Ctrl-C: it may land right after mremap.
    arena, _, data = _mapped(tmp_path, [3000, 3000], [0, 9000])
    libc, calls = host_files._libc(), []
    mremap = libc.mremap

    def moves_then_raises(*args):
        calls.append(args)
        moved = mremap(*args)
        if len(calls) == 1:
            raise SystemExit
        return moved

    monkeypatch.setattr(libc, "mremap", moves_then_raises)
    with pytest.raises(SystemExit):
        arena.make_writable()
    assert arena.file_bytes == 4096  # the first region moved, the second did not
    monkeypatch.setattr(libc, "mremap", mremap)
    arena.make_writable()
    assert arena.file_bytes == 0
    assert torch.equal(arena.view(0, (3000,), (1,), torch.uint8), data[:3000])
    assert torch.equal(arena.view(1, (3000,), (1,), torch.uint8), data[9000:12000])


def test_an_mremap_that_fails_after_unmapping_its_target_maps_the_file_back(tmp_path, monkeypatch):
    # The kernel may unmap the target range before a move fails (ENOMEM): no hole is left in the arena.
    arena, _, data = _mapped(tmp_path, [3000, 3000], [0, 9000])
    libc = host_files._libc()
    mremap = libc.mremap

    def unmaps_then_fails(copy, old, new, flags, target):
        libc.munmap(target, new)
        return host_files._MAP_FAILED

    monkeypatch.setattr(libc, "mremap", unmaps_then_fails)
    with pytest.raises(OSError, match="mremap of host storage failed"):
        arena.make_writable()
    assert arena.file_bytes == 2 * 4096
    assert torch.equal(arena.view(0, (3000,), (1,), torch.uint8), data[:3000])  # the file's pages again
    monkeypatch.setattr(libc, "mremap", mremap)
    arena.make_writable()
    assert arena.file_bytes == 0 and torch.equal(arena.view(1, (3000,), (1,), torch.uint8), data[9000:12000])
