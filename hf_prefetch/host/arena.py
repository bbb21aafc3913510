"""Host storage for offloaded weights: one exact-size arena, page-locked when the device is CUDA.

PyTorch's pinned allocator rounds every request up to a power of two (a 3 GiB request pins 4 GiB) and caches the
block. The arena instead allocates ordinary memory of exactly the needed size and page-locks it once with
`cudaHostRegister`. For the UVA backend, `map` gives a device tensor over the same pages (zero-copy). The arena knows
byte offsets and layouts; it knows nothing about models or streams.

Before allocating, the arena checks the host's limits (`limits.check_host_memory`): an arena larger than what the
container's memory cgroup still allows is refused with a ValueError that says so.

[Note: UVA lifetime]
With the UVA backend every kernel reads offloaded weights from the arena's pages over the bus: `map` asks the runtime
for the device address of the registered range (`cudaHostGetDevicePointer`) and wraps it as one uint8 CUDA tensor;
parameters are dtype views of it at the arena's offsets. The pages are registered under the execution device (the
pointer's attributes name the device current at registration), so `pin` runs under `torch.cuda.device(device)`.
*When may the pages be unregistered?* Only when no kernel can read them any more: a read of an unregistered address is
an illegal-address fault that poisons the CUDA context, not a stale value. So the mapped tensor's storage holds the
arena, and with it the registration (its finalizer unregisters) lives as long as any view, including one a user took
from `param.data`; `release()` on an arena whose views are alive does nothing; and a removal first synchronizes the
device, points the parameters back at their host tensors, then releases the arena.

[Note: mapped host storage]
The loader can leave a streamed weight where it already is: in the page cache's pages of its checkpoint shard. Such an
arena entry (`files[i]`) is the shard's pages mapped read-only and shared (`MAP_SHARED`, `MAP_FIXED`) into the
arena's range, at the entry's offset within its page, so the tensor's bytes are the file's with no copy, no fresh
memory and no second copy in the page cache; `pin` page-locks the range for reading only (`cudaHostRegister` with
`ReadOnly | Portable`). The rules:
- *Nothing writes a file-backed entry, and nothing hands one out while the model is dispatched.* Its pages are
  read-only (a write faults) and are the file's (a write over the file would change the weights). Every path that
  writes host storage or gives it to the caller first calls `OffloadState.private_host_storage` (`make_writable`
  after every queued copy, under the model's lock): `state_dict()`, `load_state_dict`, `reload_weights`,
  `sync_from_device`, and a removal that leaves the weights in host memory (before anything is undone) or whose
  move to a GPU stops half-way (before its error goes on).
  `make_writable` reads each region's bytes into private memory and moves that memory over the region (`mremap`,
  atomic per region) at the same addresses, then page-locks the range again. Views and engine transfers keep their
  addresses and read the private pages.
- *No CUDA graph records a copy from a file's pages that will be replaced.* A graph's recorded copy of page-locked
  memory fails at its replay once the range was unregistered and registered again
  (`benchmarks/experiments/graph_mapped_host.py`). So on CUDA the forward gate turns the pages private at the start of
  the first call after compiled code ran (torch.compile warms a function up before its CUDA graphs record it), before
  that call computes; where that copy is refused (the host's memory) it warns once and the pages stay.
  `private_host_storage` refuses (RuntimeError, nothing changed) once a graph recorded copies from them (a bare
  `torch.cuda.graph` capture of the eager model).
- *An interrupted move leaves the truth.* An error or Ctrl-C before the moves leaves every region as it was; the
  moves run with Ctrl-C deferred, and after any other exception (a signal handler's, or a failed `mremap`) what maps
  each region is read back from the kernel (`/proc/self/maps`): anonymous memory is a completed move, nothing (a
  failed move that unmapped its target) gets the file's pages mapped back.
- *The file must stay as it was mapped.* The arena keeps a descriptor of each file and its size and modification
  time. Every forward (`ForwardGate`, one `fstat` per file) and `make_writable` refuse a changed file (RuntimeError
  naming it) rather than compute with or copy other weights. Writing over a shard while a model maps it changes or
  removes (`SIGBUS` on touch) its pages, as it does for transformers' own memory-mapped safetensors;
  `save_pretrained` over the loaded folder is safe because it calls `state_dict()` first and writes new files.
  Replacing or deleting the files (what the Hub's cache does) is safe: the mapping holds the old inode.
- *What outlives the arena may be written.* `release` maps a region the arena still holds from a file again,
  copy-on-write (`MAP_PRIVATE`, writable, no copy), after unpinning: a module kept after its model was collected
  may be written, and the file never changes. Its unwritten pages stay the file's, as with transformers' memory-mapped
  loading (a shard written over in place changes them). `remove_offload(model, "cpu")` gives private copies.
- Not detected: a write over a shard in place that keeps its size and modification time (`cp --preserve`,
  `rsync -t --inplace`). After a detected change the model refuses to compute and to be removed to the CPU; drop it
  and load again.
- Only entries stored exactly as loaded are mapped (one checkpoint tensor, same dtype and size, dense, at an offset
  aligned to its dtype), from shards the page cache holds (`reader.MAPPED_FROM`), on a driver that page-locks
  read-only file mappings; never for compressed plans (their host bytes are encoded), UVA or routed experts (kernels
  read host storage in place). The rest of the arena is private memory filled by the loader's reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import warnings
import weakref
from collections.abc import Iterator, Sequence

import torch

from ..alignment import TENSOR_ALIGN_BYTES, round_up
from . import limits
from .files import FilePiece, MappedFiles

__all__ = [
    "HostArena",
    "padded_bytes",
    "span_bytes",
    "own_storage",
    "pinned_bytes",
    "lock_read_only",
    "unlock",
]

logger = logging.getLogger(__name__)


_warned_unpinned = False

# Every range this process registered with cudaHostRegister and has not unregistered yet: address -> bytes. Updated
# only by `_register` and `_unregister`, so it is what the driver was asked to hold page-locked for hf_prefetch.
_registered_bytes: dict[int, int] = {}


def pinned_bytes() -> int:
    """Host bytes that hf_prefetch holds page-locked now (cudaHostRegister'd by host arenas and not yet unregistered).

    A dispatched model's arena counts from `dispatch_model` or the load until `remove_offload` (or re-dispatch, or the
    model's death); memory PyTorch's own pinned allocator holds is not included.

    Example:

    ```python
    >>> import torch
    >>> from hf_prefetch.host.arena import HostArena, pinned_bytes
    >>> before = pinned_bytes()
    >>> arena = HostArena([70_000])
    >>> pinned = arena.pin() if torch.cuda.is_available() else False  # the CPU needs no page-locking
    >>> pinned_bytes() - before == (arena.nbytes if pinned else 0)
    True
    >>> arena.release()
    >>> pinned_bytes() == before
    True

    ```
    """
    return sum(_registered_bytes.copy().values())  # a copy: an arena's finalizer may run while this sums




def padded_bytes(nbytes: int) -> int:
    """What a tensor of `nbytes` takes in the arena (and a buffer in a pool slot, laid out alike): `TENSOR_ALIGN_BYTES`
    multiples."""
    return round_up(nbytes, TENSOR_ALIGN_BYTES)


def span_bytes(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes from a tensor's first element to the end of its last, in its layout (0 for an empty one)."""
    if not all(shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))) * dtype.itemsize


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, a view into host memory (an arena), as a tensor over the same bytes with a storage object of its own,
    which keeps the memory alive. `torch.save` writes every storage whole and refuses two views of one storage in
    different dtypes (an arena holds bf16 weights beside float32 norms, int8 values beside float32 scales): a host
    value handed out in a `state_dict` is saved alone, its bytes only."""
    nbytes = span_bytes(tensor.shape, tensor.stride(), tensor.dtype)
    if tensor.device.type != "cpu" or nbytes == 0:
        return tensor
    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    start = tensor.storage_offset() * tensor.element_size()
    # numpy's view of `whole` keeps it (and the storage) alive; torch.from_numpy makes a new storage over its bytes.
    own = torch.from_numpy(whole.numpy()[start : start + nbytes])
    return own.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())


class HostArena:
    """`sizes[i]` bytes at `offsets[i]` of one host buffer, page-locked with `cudaHostRegister` by `pin()`.

    Fill the arena first, then pin it: registering memory that is already touched is about ten times faster than
    registering fresh memory (the kernel then only locks pages instead of also allocating them). Views stay valid
    after `release()` (the memory is then ordinary pageable memory, freed with the last view).

    `files[i]`, where given, says that entry i's bytes are already in a file: that entry is the file's own pages,
    mapped read-only into the arena's range ([Note: mapped host storage]); the others are private memory to fill.
    Before allocating, `limits.check_host_memory` refuses private memory the container's memory cgroup cannot
    hold (ValueError). `freed_bytes`: host memory released while the arena fills (weights that move into it from the
    CPU). Raises OSError where a file cannot be mapped (nothing is left mapped then).
    """

    def __init__(
        self, sizes: Sequence[int], *, freed_bytes: int = 0, files: Sequence[FilePiece | None] | None = None
    ) -> None:
        files = list(files) if files is not None else [None] * len(sizes)
        if len(files) != len(sizes):
            raise ValueError(f"HostArena: {len(files)} file pieces for {len(sizes)} sizes.")
        self.offsets: list[int] = []
        # Each file-backed entry's pages, page-aligned; the entry starts at its region's start + its page offset.
        regions: list[tuple[int, int, FilePiece]] = []  # (start, length, piece)
        total = private = 0
        for size, piece in zip(sizes, files, strict=True):
            if piece is None:
                self.offsets.append(total)
                total += padded_bytes(size)
                private += padded_bytes(size)
                continue
            total = round_up(total, mmap.PAGESIZE)
            within = piece.offset % mmap.PAGESIZE
            regions.append((total, round_up(within + size, mmap.PAGESIZE), piece))
            self.offsets.append(total + within)
            total += regions[-1][1]
        self.nbytes = round_up(total, max(TENSOR_ALIGN_BYTES, mmap.PAGESIZE))
        if private > 0:
            limits.check_host_memory(private, limits.host_limits(), freed_bytes=freed_bytes)
        self.pinned = False
        self._unpin: weakref.finalize | None = None
        self._mapping: weakref.ref[_DeviceArray] | None = None  # alive while a device view from `map` is
        self._mapped_at = 0  # that view's device address
        if not regions:
            # Over-allocate one page so that the registered range starts on a page boundary and shares no page with
            # another allocation (two registrations of one page fail).
            page = max(TENSOR_ALIGN_BYTES, mmap.PAGESIZE)
            raw = torch.empty(self.nbytes + page, dtype=torch.uint8)
            start = (-raw.data_ptr()) % page
            self._buffer = raw[start : start + self.nbytes]
            self._files = MappedFiles()
            return
        # One private anonymous mapping (page-aligned, never shared with another allocation), freed by the mmap
        # object when the last view of it dies; each file-backed region is then mapped over its part of it.
        reserved = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE)
        self._buffer = torch.frombuffer(reserved, dtype=torch.uint8)
        del reserved  # the buffer's storage holds it
        try:
            self._files = MappedFiles(self._buffer.data_ptr(), regions)
        except BaseException:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # unmaps everything (no other view exists yet)
            raise

    @property
    def file_bytes(self) -> int:
        """Bytes of the arena that are still files' own pages (0 once `make_writable` ran)."""
        return self._files.nbytes

    @staticmethod
    def bytes_for(sizes: Sequence[int]) -> int:
        """The host memory an arena of `sizes` takes (for a check made before anything is allocated or undone)."""
        return round_up(sum(padded_bytes(size) for size in sizes), TENSOR_ALIGN_BYTES)

    def pin(self) -> bool:
        """Page-lock the arena (once); False, with one warning, where the platform refuses."""
        if not self.pinned and self.nbytes > 0:
            # A file's pages are locked for reading only (the mapping is read-only); the device only reads them.
            flags = _REGISTER_PORTABLE | _REGISTER_READ_ONLY if self._files.nbytes else 0
            self.pinned = _register(self._buffer, flags)
            if self.pinned:
                # Unregister when the arena dies even without release() (a dispatched model that is simply
                # dropped): freed memory that stays registered makes the next registration of it fail.
                self._unpin = weakref.finalize(self, _unregister, self._buffer.data_ptr())
                self._unpin.atexit = False
        return self.pinned

    def check_files(self) -> None:
        """Raise RuntimeError if a file the arena still maps changed on disk since it was mapped (its size or
        modification time): its pages may no longer hold the weights that were loaded. One `fstat` per file."""
        self._files.check()

    def make_writable(self) -> None:
        """Turn every file-backed entry into private memory at the same addresses, with the same bytes
        (`MappedFiles.make_private`); then the arena may be written and handed out like any. Views, the device's
        copies and a `map`'s device view keep their addresses (CUDA graphs recorded before do not survive it: see
        [Note: mapped host storage]). Call only while no copy reads the arena. A no-op once done. Refuses a file
        changed on disk (RuntimeError) and private memory the host's limits cannot hold (ValueError)."""
        if not self._files.nbytes:
            return
        if self._mapping is not None and self._mapping() is not None and self._mapped_at != self._buffer.data_ptr():
            raise RuntimeError(
                "Host storage mapped from checkpoint files has a device view at another address than its host one; "
                "its pages cannot be replaced under that view. Load with map_files=False."
            )
        self._files.check()
        limits.check_host_memory(self._files.nbytes, limits.host_limits())
        self._files.make_private(self._unpinned)

    def files_copy_on_write(self) -> None:
        """What is still a file's pages becomes writable copy-on-write (`MAP_PRIVATE`: a write copies the page, the
        file never changes) at the same addresses, with no copy now and no memory asked for; the arena is no longer
        page-locked. For a removal stopped half-way whose `make_writable` failed: its weights may be written, but a
        page not written yet still follows the file, should it change on disk."""
        if self._files.nbytes:
            self._drop_pin()
            self._files.release()

    def _drop_pin(self) -> None:
        # Unregistered now (the finalizer, called once, does it), whatever was page-locked.
        if self._unpin is not None:
            self._unpin()
        self.pinned = False

    @contextlib.contextmanager
    def _unpinned(self) -> Iterator[None]:
        # The range not page-locked for the block; locked again after it (read-only while any part is a file's).
        pinned = self.pinned
        if pinned and self._unpin is not None:
            self._unpin()
            self.pinned = False
        try:
            yield
        finally:
            if pinned:
                self.pin()

    def view(
        self,
        index: int,
        shape: Sequence[int],
        stride: Sequence[int],
        dtype: torch.dtype,
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensor stored at slot `index` of the arena, with the given layout: in host memory, or on the device
        when `base` is the arena's `map`."""
        offset = self.offsets[index]
        buffer = self._buffer if base is None else base
        flat = buffer[offset : offset + span_bytes(shape, stride, dtype)].view(dtype)
        return flat.as_strided(tuple(shape), tuple(stride))

    def map(self, device: torch.device) -> torch.Tensor:
        """The pinned arena as a uint8 tensor on the CUDA `device` whose address is these host pages (UVA zero-copy):
        kernels read and write host memory over the bus, nothing is allocated on the device. Pin it under
        `torch.cuda.device(device)`: registered memory belongs to the device current when it was registered.

        The tensor's storage keeps the arena alive, so the pages stay registered while any view of it lives; a
        `release()` meanwhile leaves them to the arena's finalizer. See [Note: UVA lifetime].
        """
        if not self.pinned:
            raise RuntimeError(
                f"UVA needs the {self.nbytes / 2**30:.2f} GiB of offloaded weights page-locked, and cudaHostRegister "
                "refused (see the warning before this error). Raise the locked-memory limit (ulimit -l, docker "
                "--ulimit memlock=-1), or use offload='prefetch', which works from pageable memory (slower)."
            )
        pointer = _device_pointer(self._buffer.data_ptr(), device)
        holder = _DeviceArray(pointer, self.nbytes, owner=self)
        mapped = torch.as_tensor(holder)
        if mapped.device != device or mapped.data_ptr() != pointer:
            raise RuntimeError(
                f"Mapping host memory for {device} gave a tensor on {mapped.device} at {mapped.data_ptr():#x}, not "
                f"{device} at {pointer:#x}: the arena was registered under another device. Pin it under "
                "torch.cuda.device(device)."
            )
        self._mapping, self._mapped_at = weakref.ref(holder), pointer
        return mapped

    def mapped_like(self, host: torch.Tensor, mapped: torch.Tensor) -> torch.Tensor:
        """The view of `mapped` (this arena's `map`) with the place and layout of `host`, a view of this arena."""
        offset = host.data_ptr() - self._buffer.data_ptr()
        span = span_bytes(host.shape, host.stride(), host.dtype)
        if not 0 <= offset <= self.nbytes - span:
            raise ValueError(f"mapped_like: a tensor at {host.data_ptr():#x} is not a view of this arena.")
        flat = mapped[offset : offset + span].view(host.dtype)
        return flat.as_strided(tuple(host.shape), tuple(host.stride()))

    def bytes_view(self, index: int, nbytes: int) -> torch.Tensor:
        """The raw bytes at slot `index` (uint8), for readers that fill the arena directly."""
        offset = self.offsets[index]
        return self._buffer[offset : offset + nbytes]

    def release(self, forget_files: bool = False) -> None:
        """Unpin the arena. Call only when no copy from it is in flight. While a device view from `map` is alive the
        pages stay registered, and the arena's finalizer unpins them after the last view died. `forget_files`: no view
        will be read again, so a file's pages are dropped rather than kept copy-on-write (`MappedFiles.release`)."""
        if self._mapping is not None and self._mapping() is not None:
            return  # unregistering now would make every live device view fault on its next read
        self._drop_pin()
        self._files.release(forget_files)  # what a view that outlives the arena holds of a file
        self._buffer = torch.empty(0, dtype=torch.uint8)


class _DeviceArray:
    """`nbytes` at a device `pointer`, as `__cuda_array_interface__` (version 3); holds `owner` while a tensor made
    from it by `torch.as_tensor` lives (the tensor's storage holds this object)."""

    def __init__(self, pointer: int, nbytes: int, owner: object) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",  # bytes: numpy has no bfloat16; views give each parameter its dtype
            "data": (pointer, False),  # (address, read-only)
            "strides": None,
            "version": 3,
        }
        self.owner = owner


def _device_pointer(host_pointer: int, device: torch.device) -> int:
    # The device address of registered host memory: equal to the host address where the platform allows it, but
    # only the runtime knows. torch.cuda.cudart() binds no cudaHostGetDevicePointer; call the libcudart torch loaded.
    libraries = _cudart_libraries()
    if not libraries:
        raise RuntimeError(
            "UVA cannot map host memory here: this process has no libcudart loaded to ask for the device address of "
            "page-locked memory (a torch build with the CUDA runtime linked statically). Use offload='prefetch'."
        )
    cudart = libraries[0]
    cudart.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    cudart.cudaHostGetDevicePointer.restype = ctypes.c_int
    pointer = ctypes.c_void_p()
    with torch.cuda.device(device):
        err = cudart.cudaHostGetDevicePointer(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), 0)
    if err != 0 or not pointer.value:
        _clear_last_cuda_error()
        raise RuntimeError(
            f"UVA cannot map host memory into {device}: cudaHostGetDevicePointer returned CUDA error {err} (the "
            "device or platform does not support mapped page-locked memory). Use offload='prefetch'."
        )
    return pointer.value


def _unregister(pointer: int) -> None:
    _registered_bytes.pop(pointer, None)  # also when it fails: the arena never tries again
    err = torch.cuda.cudart().cudaHostUnregister(pointer)
    if int(err) != 0:
        _clear_last_cuda_error()
        logger.warning("cudaHostUnregister failed with CUDA error %s", int(err))


def _register(buffer: torch.Tensor, flags: int = 0) -> bool:
    global _warned_unpinned
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), flags)
    if int(err) == 0:
        _registered_bytes[buffer.data_ptr()] = buffer.numel()
        return True
    _clear_last_cuda_error()
    if not _warned_unpinned:
        _warned_unpinned = True
        warnings.warn(
            f"Could not page-lock {buffer.numel() / 2**30:.2f} GiB of host memory for offloaded weights "
            f"(cudaHostRegister returned error {int(err)}). Falling back to pageable memory: copies will be several "
            "times slower and synchronous. In containers raise the locked-memory limit "
            "(ulimit -l / --ulimit memlock).",
            stacklevel=4,
        )
    return False


# cudaHostRegister flags: pinned for every CUDA context, and the pages only read by the device (required for a
# read-only mapping such as a file's page cache).
_REGISTER_PORTABLE = 1
_REGISTER_READ_ONLY = 8


def lock_read_only(pointer: int, nbytes: int) -> bool:
    """Page-lock `nbytes` at `pointer` of a read-only mapping (a file's page-cache pages) for every device, so that
    the copy engine reads them directly. False where the driver refuses (a device without read-only registration, a
    range past the file's end); the error is cleared. Not counted in `pinned_bytes`: the pages are the page cache's,
    held only while a copy reads them. `unlock` undoes it."""
    err = torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _REGISTER_PORTABLE | _REGISTER_READ_ONLY)
    if int(err) != 0:
        _clear_last_cuda_error()
        return False
    return True


def unlock(pointer: int) -> None:
    """Undo `lock_read_only(pointer, ...)`; only once nothing queued on a device still reads the pages."""
    err = torch.cuda.cudart().cudaHostUnregister(pointer)
    if int(err) != 0:
        _clear_last_cuda_error()
        logger.warning("cudaHostUnregister failed with CUDA error %s", int(err))


def _clear_last_cuda_error() -> None:
    # A failed runtime call leaves its code in the thread's last-error slot, where PyTorch's next kernel-launch check
    # would report it. torch.cuda.cudart() binds no cudaGetLastError, so call the libcudart this process loaded.
    for cudart in _cudart_libraries():
        cudart.cudaGetLastError()


def _cudart_libraries() -> list[ctypes.CDLL]:
    # The CUDA runtime libraries this process loaded (torch's own): the same runtime, so the same contexts.
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:  # not Linux
        return []
    libraries = []
    for path in paths:
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libraries
