"""The load's steps between its plan and its dispatch: the host arena built (private memory, or the checkpoint's own
pages for tensors stored as loaded), every tensor read once into the arena or onto the device, the page-locking in
the background, and the read values installed in the model. The order of the steps is loader.py's."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config import warn_at_caller
from ..formats.parts import get_part, with_inner
from ..formats.prequantized import quant_method
from ..host.arena import HostArena
from ..host.diskio import cached_fraction
from ..host.files import FilePiece
from ..host.offloaded import OffloadedParam
from ..lifecycle.journal import Journal, Phase
from ..planning.offload_plan import OffloadPlan
from ..planning.placements import INNER_SEP, ParamSpec
from .checkpoint import Checkpoint
from .keymap import KeyMap, cast_source, convert, filled_names, region_view
from .reader import MAPPED_FROM, TensorReader, driver_maps_files

__all__ = [
    "LoadTimeline",
    "Background",
    "check_direct_io",
    "check_fp8_matmuls",
    "file_pieces",
    "new_arena",
    "read_all",
    "pin_on",
    "offloaded_param",
    "install",
]

logger = logging.getLogger(__name__)

# A load's CUDA destinations go through the reader's windows (pinned bounce buffers), not its mapped reads: the load
# runs beside the warm-up thread, and the driver does not overlap page-locking with the warm-up's own calls; windows
# page-lock only their bounce buffers (the first token came 0.93x as soon, median of 13 alternated pairs on an H100).
# Reloads, with no warm-up beside them, keep mapped reads.
_MAPPED_READS = False


def check_direct_io(direct_io: object, map_files: object) -> None:
    if direct_io is not None and not isinstance(direct_io, bool):
        raise ValueError(
            f"direct_io={direct_io!r} must be True (read every shard around the page cache), False (through it) or "
            "None (directly only the shards the page cache does not hold)."
        )
    if map_files is not None and not isinstance(map_files, bool):
        raise ValueError(
            f"map_files={map_files!r} must be True (streamed weights stay in the page cache's pages of every shard), "
            "False (copied into host memory) or None (mapped from the shards the page cache holds)."
        )
    if direct_io and map_files:
        raise ValueError(
            "direct_io=True reads around the page cache, and map_files=True keeps streamed weights in it: pass one "
            "of them (map_files=None maps nothing when direct_io=True)."
        )


def file_pieces(
    layout: list[tuple[str, ParamSpec]],
    keymap: KeyMap,
    checkpoint: Checkpoint,
    device: torch.device,
    plan: OffloadPlan,
    map_files: bool | None,
    direct_io: bool | None,
    compressing: bool,
) -> list[FilePiece | None]:
    # Which arena entries are their file's own pages ([Note: mapped host storage] in host/arena.py): a tensor stored
    # as it is loaded (one checkpoint tensor of the same dtype and size, laid out densely), in a shard the page cache
    # holds (or any shard with map_files=True) that the driver page-locks read-only mappings of. Not for compressed
    # plans (the encoded bytes are new), nor UVA or routed experts (kernels read the arena in place).
    pieces: list[FilePiece | None] = [None] * len(layout)
    # Routed experts' rows are read in place by kernels (through the arena's device view), as UVA's weights are.
    routed = any(spec.routing is not None for _, spec in layout)
    unmapped = (
        "compress=True stores the streamed weights encoded anew"
        if compressing
        else "the UVA backend's kernels read the weights in place"
        if plan.backend == "uva"
        else "routed experts' rows are read in place by kernels and by the host's experts compute"
        if routed
        else None
    )
    if map_files and unmapped is not None:
        warn_at_caller(
            f"map_files=True maps nothing in this plan: {unmapped}, so the streamed weights are read into host "
            "memory. Drop map_files."
        )
    if map_files is False or (map_files is None and direct_io) or unmapped is not None:
        return pieces
    mappable: dict[Path, bool] = {}
    for i, (path, spec) in enumerate(layout):
        sources = keymap.streamed.get(f"{path}.{spec.name}", [])
        if len(sources) != 1 or sources[0][1] is not None:
            continue
        entry = sources[0][0]
        dense = spec.stride == torch.empty(spec.shape, device="meta").stride()  # torch's contiguous strides
        if entry.dtype != spec.dtype or entry.nbytes != spec.nbytes or not dense or entry.nbytes == 0:
            continue
        if not entry.one_run:  # a slice of rows (loading/sharded.py)
            continue
        if entry.offset % entry.dtype.itemsize:  # a file whose data is not aligned to its dtype: a view cannot be
            continue
        if entry.path not in mappable:
            fraction = cached_fraction(entry.path) if map_files is None else 1.0
            mappable[entry.path] = (
                fraction is not None
                and fraction >= MAPPED_FROM
                and (device.type != "cuda" or driver_maps_files(checkpoint, device, entry.path))
            )
        if mappable[entry.path]:
            pieces[i] = FilePiece(str(entry.path), checkpoint.fd(entry.path), entry.offset)
    return pieces


def new_arena(layout: list[tuple[str, ParamSpec]], files: list[FilePiece | None]) -> HostArena:
    sizes = [spec.nbytes for _, spec in layout]
    if any(files):
        try:
            return HostArena(sizes, files=files)
        except OSError as err:  # a file system that cannot map files: the arena is filled by reads instead
            logger.info("Streamed weights are copied into host memory: %s", err)
            files[:] = [None] * len(files)
    return HostArena(sizes)


def check_fp8_matmuls(model: nn.Module, device: torch.device) -> None:
    # A compressed-tensors FP8 checkpoint loads as transformers' FP8 matmul modules (skeleton.py), which need a GPU of
    # compute capability 8.9 or newer (the CPU runs them too). Packed integer ones need no FP8 matmul.
    quantization = getattr(getattr(model, "config", None), "quantization_config", None)
    fp8 = getattr(quantization, "use_optimized_inference", False)
    if quant_method(quantization) != "compressed-tensors" or not fp8 or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"{device} has compute capability {capability[0]}.{capability[1]}; the FP8 matmuls that a "
            "compressed-tensors FP8 checkpoint computes with need 8.9 or newer (Ada, Hopper). Load it with "
            "transformers on this GPU (it computes with decompressed weights) and dispatch that model."
        )


class LoadTimeline:
    """Seconds spent in each phase of a load, in order (`OffloadState.load_timeline`, `benchmarks/load.py`). A phase
    that queues device work waits for it when given the device (a synchronisation at the end of that phase only)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str, device: torch.device | None = None) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


def read_all(
    checkpoint, keymap, dests, model, progress, direct_io, timeline, skip: set[str]
) -> tuple[float, TensorReader]:
    # Host destinations (the arena) and device destinations in one load: the host's CPU copies into place, the
    # device's CPU copies into bounce buffers and the copy engine's from them, so they overlap. `skip`: the arena's
    # entries that are their file's pages already (and must not be written).
    reads = [
        (e, region_view(dests[name], region))
        for name, pieces in keymap.streamed.items()
        if name not in skip
        for e, region in pieces
    ]
    total = sum(e.nbytes for e, _ in reads) + sum(e.nbytes for e, _ in keymap.duplicates)
    total += sum(e.nbytes for _, _, sources, _ in keymap.converted for _, e in sources)
    from tqdm.auto import tqdm  # imported here: importing it in Jupyter without ipywidgets warns

    disable = None if progress is None else not progress  # None: tqdm shows it only on a terminal
    started = time.perf_counter()
    with (
        tqdm(total=total, unit="B", unit_scale=True, desc="Loading checkpoint", disable=disable) as bar,
        TensorReader(checkpoint, on_read=bar.update, direct=direct_io, mapped=_MAPPED_READS) as reader,
    ):
        reader.load(reads)
        timeline.mark("read")
        if keymap.converted:
            logger.info("Not streamed (converted through transformers): %s", [t for _, t, _, _ in keymap.converted])
        for converter, target_key, sources, names in keymap.converted:
            dtype = dests[next(iter(names.values()))].dtype  # transformers casts the sources before converting
            outputs = convert(model, converter, target_key, sources, lambda e, d=dtype: cast_source(reader, e, d))
            for out_key, value in outputs.items():
                dests[names[out_key]].copy_(value)
        for entry, name in keymap.duplicates:
            if not torch.equal(reader.read_tensor(entry).to(dests[name].dtype), dests[name].cpu()):
                raise ValueError(
                    f"{entry.path}: {entry.key!r} and {keymap.streamed[name][0][0].key!r} fill one tensor ({name}: "
                    "the config ties them) but hold different values. Set tie_word_embeddings=False in config.json."
                )
        timeline.mark("convert")  # tensors transformers converts, and tied duplicates checked
    return time.perf_counter() - started, reader  # closed, its counters final


class Background:
    """`fn()` in a thread once `start()`ed (assign it first, so that an error path always sees it); `join()` waits
    and re-raises what it raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="hf_prefetch-pin", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as err:
            self._error = err

    def join(self, raise_error: bool = True) -> None:
        if self._thread.ident is not None:  # started
            self._thread.join()
        if raise_error and self._error is not None:
            raise self._error


def pin_on(arena: HostArena, device: torch.device) -> None:
    with torch.cuda.device(device):  # registered under the execution device, as dispatch_model does
        arena.pin()


def offloaded_param(model: nn.Module, keymap: KeyMap, name: str, host: torch.Tensor) -> OffloadedParam:
    param_name, _, inner = name.partition(INNER_SEP)
    if inner:  # one of the tensors a parameter is stored in (a bitsandbytes layer's)
        return OffloadedParam(name, model.get_parameter(param_name), host, None, inner)
    return OffloadedParam(name, keymap.model_tensors[name], host)


def install(model: nn.Module, keymap: KeyMap, dests: dict[str, torch.Tensor], journal: Journal) -> None:
    # Swap each meta tensor's contents for its loaded value in place, so every name of a tied tensor sees it. The parts
    # of a parameter stored as several tensors (`weight:absmax`, `weight:qdata`) become its parts: a tensor subclass
    # (torchao) is rebuilt around them and swapped in; a bitsandbytes parameter's data is swapped for a tensor of its
    # class and attributes, its other parts pointed at. A part no checkpoint tensor fills (a 4-bit layer's
    # double-quantization offset, a number in its packed settings) keeps the value the skeleton has.
    filled = set(filled_names(keymap))
    subclass_parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in dests.items():
        param_name, _, inner = name.partition(INNER_SEP)
        if not inner:
            tensor = keymap.model_tensors[name]
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            journal.swap(tensor, value, f"{name} loaded")
            continue
        param = model.get_parameter(param_name)
        if name not in filled:
            value.copy_(get_part(param, inner))
        if is_traceable_wrapper_subclass(param):
            subclass_parts.setdefault(param_name, {})[inner] = value
        elif inner != "data":
            journal.point(Phase.PLACE, param, value, f"{name} loaded", inner)
        else:  # a meta parameter's data cannot be assigned a real tensor
            value = torch.Tensor._make_subclass(type(param), value, param.requires_grad)
            value.__dict__.update(param.__dict__)
            journal.swap(param, value, f"{name} loaded")
    for param_name, inner in subclass_parts.items():
        param = model.get_parameter(param_name)
        rebuilt = with_inner(param, inner)
        journal.swap(param, nn.Parameter(rebuilt, requires_grad=param.requires_grad), f"{param_name} loaded")
