"""The memory budget in bytes: `max_memory` and `reserve_bytes` parsed, then resolved on the execution device.

`parse_max_memory` checks the caller's arguments before anything is planned; `resolve_budget` (one GPU) and
`resolve_budgets` (pipeline placement) turn them into `MemoryBudget`s once the device is known, asking CUDA only for
`"auto"` (its free memory). This module knows sizes and devices; choosing a plan for a budget is `budget`'s job.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import PrefetchConfig

__all__ = [
    "DEFAULT_RESERVE_BYTES",
    "MaxMemory",
    "MemoryBudget",
    "available_device_bytes",
    "device_argument",
    "parse_max_memory",
    "resolve_budget",
    "resolve_budgets",
]

# Device memory left free for activations and the KV cache when `reserve_bytes` is not given. 1 GiB covers batch-1
# decoding of an 8B model with a few thousand tokens of context (its KV cache takes 128 KiB per token in bf16); raise
# it for long prompts, large batches or a forward that returns logits for every position.
DEFAULT_RESERVE_BYTES = 2**30


@dataclass(frozen=True)
class MemoryBudget:
    """What a plan must fit, in bytes: `device_bytes` on the execution device, of which `reserve_bytes` stay free for
    activations and the KV cache, and at most `host_bytes` of pinned host memory (None: not checked): the host arena's
    real size, `OffloadPlan.host_bytes`, with every tensor's alignment padding and encoded bytes where compressed."""

    device_bytes: int
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    host_bytes: int | None = None
    source: str = "the device budget"  # where `device_bytes` came from, for messages: "max_memory[0]", ...

    def __post_init__(self) -> None:
        for name in ("device_bytes", "reserve_bytes", "host_bytes"):
            value = getattr(self, name)
            if value is None and name == "host_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryBudget.{name}={value!r} must be a number of bytes (an int >= 0).")

    @property
    def weights_bytes(self) -> int:
        """What resident weights and the buffer pool may take: the device budget less the reserve."""
        return self.device_bytes - self.reserve_bytes


@dataclass(frozen=True)
class MaxMemory:
    """A parsed `max_memory` argument and `reserve_bytes`, before the execution device is known."""

    gpus: tuple[tuple[int | None, int | None], ...]  # (GPU index, None for "cuda"; bytes, None for "auto")
    host_bytes: int | None
    reserve_bytes: int


def parse_max_memory(
    max_memory: Mapping[int | str, int | str] | str | None,
    reserve_bytes: int | str | None = None,
    config: PrefetchConfig | None = None,
) -> MaxMemory | None:
    """Validate `max_memory` (accelerate's format, or `"auto"`) and `reserve_bytes`; None when no budget is asked for.

    Keys are GPU indices (`0`, `"cuda:0"`, `"cuda"` for the execution device) and `"cpu"`; values are bytes (`int`) or
    sizes (`"10GiB"`, `"9.5GB"`, `"500MB"`), or `"auto"` for a GPU: its free memory. A budget chooses the streamed
    layers itself, so `group_size` and `num_in_group` must not be given as well.

    Example:

    ```python
    >>> from hf_prefetch.planning.memory import parse_max_memory
    >>> parse_max_memory({0: "10GiB", "cpu": "64GiB"}, reserve_bytes="512MiB")
    MaxMemory(gpus=((0, 10737418240),), host_bytes=68719476736, reserve_bytes=536870912)

    ```
    """
    if max_memory is None:
        if reserve_bytes is not None:
            raise ValueError(
                f"reserve_bytes={reserve_bytes!r} is only used with a memory budget; pass max_memory too, e.g. "
                "max_memory={0: '10GiB'} or max_memory='auto'."
            )
        return None
    default = PrefetchConfig()
    if config is not None and (config.group_size, config.num_in_group) != (default.group_size, default.num_in_group):
        raise ValueError(
            f"max_memory chooses the streamed layers itself, so it cannot be combined with "
            f"group_size={config.group_size}, num_in_group={config.num_in_group}. Pass max_memory with a "
            "PrefetchConfig that sets only prefetch_step and offload_params, or drop max_memory to stream the group "
            "pattern."
        )
    reserve = DEFAULT_RESERVE_BYTES if reserve_bytes is None else _to_bytes(reserve_bytes, "reserve_bytes")
    if isinstance(max_memory, str) and max_memory == "auto":
        return MaxMemory(((None, None),), None, reserve)
    if not isinstance(max_memory, Mapping):
        raise ValueError(
            f"max_memory={max_memory!r} must be a dict like {{0: '10GiB', 'cpu': '64GiB'}} (accelerate's format) or "
            "'auto' (the GPU's free memory)."
        )
    if not max_memory:
        raise ValueError(
            "max_memory={} gives no budget; pass the execution device's budget, e.g. max_memory={0: '10GiB', 'cpu': "
            "'64GiB'}, or max_memory='auto' for its free memory (or drop max_memory to stream the group pattern)."
        )
    gpus: dict[int | None, int | None] = {}
    keys: dict[int | None, Any] = {}  # as the caller wrote them, for messages
    host = None
    for key, value in max_memory.items():
        if key == "cpu":
            host = _to_bytes(value, "max_memory['cpu']")
            continue
        index = _gpu_index(key)
        if index in gpus:
            raise ValueError(f"max_memory names one GPU twice, as {keys[index]!r} and {key!r}; keep one entry.")
        keys[index] = key
        gpus[index] = None if value == "auto" else _to_bytes(value, f"max_memory[{key!r}]")
    return MaxMemory(tuple(gpus.items()), host, reserve)


def _gpu_index(key: Any) -> int | None:
    if isinstance(key, torch.device) and key.type == "cuda":
        return key.index
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str):
        if key == "cuda":
            return None
        name = key.removeprefix("cuda:")
        if name.isdigit():
            return int(name)
    raise ValueError(
        f"max_memory has the key {key!r}; keys are GPU indices (0, 'cuda:0', or 'cuda' for the execution device) and "
        "'cpu'. hf_prefetch runs a model on one GPU and streams from host memory: there is no 'disk' or 'mps'."
    )


def _to_bytes(value: Any, name: str) -> int:
    from accelerate.utils import convert_file_size_to_int

    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            size = convert_file_size_to_int(value.strip())
        except (ValueError, OverflowError):
            pass
        else:
            if size >= 0:
                return size
    raise ValueError(
        f"{name}={value!r} is not a size; use bytes (an int >= 0) or a string with a unit such as '10GiB', '9.5GB' "
        "or '500MB' (GiB/MiB are powers of 2, GB/MB powers of 10)."
    )


def device_argument(max_memory: MaxMemory | None, device: Any) -> Any:
    """The `device` argument to resolve: the given one, else the one GPU index `max_memory` names (with CUDA)."""
    if device is not None or max_memory is None:
        return device
    indices = [index for index, _ in max_memory.gpus if index is not None]
    return indices[0] if len(indices) == 1 and torch.cuda.is_available() else None


def resolve_budget(max_memory: MaxMemory, device: torch.device, model: nn.Module) -> MemoryBudget:
    """The budget in bytes on `device`. Asks CUDA for the free memory only when the entry is `"auto"`.

    On the CPU (no GPU, or `device="cpu"`) the one GPU entry is planned for as if the CPU were that GPU, so that a plan
    can be tried and tested without one.
    """
    if not max_memory.gpus and device.type != "cuda":
        raise ValueError(
            f"max_memory gives only a 'cpu' entry, so it has no budget for the execution device ({device}). Add one, "
            "e.g. max_memory={0: '10GiB', 'cpu': '64GiB'} (on the CPU the one GPU entry is planned for as if the CPU "
            "were that GPU)."
        )
    entries = dict(max_memory.gpus) or {None: None}  # only 'cpu' given: the GPU's free memory
    if device.type == "cuda" and device.index in entries:
        key = device.index
    elif device.type == "cuda" and None in entries:
        key = None
    elif device.type == "cpu" and len(entries) == 1:
        key = next(iter(entries))
    else:
        named = [("cuda" if index is None else index) for index in entries]
        raise ValueError(
            f"max_memory names the GPUs {named} but the model executes on {device}: hf_prefetch runs a model on one "
            "device. Pass device= for one of them and keep only its entry; other GPUs can carry a share of the "
            "streamed bytes over their own host links with links=[0, 1] (their max_memory entries then bound their "
            "staging buffers)."
        )
    host, reserve = max_memory.host_bytes, max_memory.reserve_bytes
    if entries[key] is not None:
        source = f"max_memory[{'cuda' if key is None else key!r}]"
        return MemoryBudget(entries[key], reserve, host, source)
    if device.type != "cuda":
        raise ValueError(
            f"max_memory='auto' measures a CUDA device's free memory, but the model executes on {device}. Give a "
            "size instead, e.g. max_memory={0: '10GiB'}."
        )
    return MemoryBudget(available_device_bytes(model, device), reserve, host, f"free memory of {device}")


def resolve_budgets(max_memory: MaxMemory, device: torch.device, model: nn.Module) -> list[tuple[int, MemoryBudget]]:
    """Pipeline placement: each GPU of `max_memory` with its budget in bytes, the execution device first, then the
    others by index. On the CPU (no GPU, or `device="cpu"`) every GPU entry is planned for as if the CPU were that GPU,
    and `"auto"` is refused."""
    entries = dict(max_memory.gpus)
    if None in entries:
        raise ValueError(
            "max_memory names several GPUs and 'cuda' (the execution device) among them; name every GPU by its index, "
            "e.g. max_memory={0: '20GiB', 1: '20GiB', 'cpu': '64GiB'}."
        )
    if device.type == "cuda":
        if device.index not in entries:
            raise ValueError(
                f"max_memory names the GPUs {sorted(entries)} but the model executes on {device}: the execution "
                "device holds the first layers and everything outside the layer list. Add its entry, or pass device= "
                "for one of them."
            )
        count = torch.cuda.device_count()
        missing = [index for index in entries if index >= count]
        if missing:
            raise ValueError(
                f"max_memory names GPU {missing[0]}, but this machine has {count} CUDA device(s) (0 to {count - 1}). "
                "Name only GPUs that exist."
            )
        order = [device.index] + sorted(index for index in entries if index != device.index)
    else:
        order = sorted(entries)
    budgets = []
    for index in order:
        if entries[index] is not None:
            budgets.append(
                (
                    index,
                    MemoryBudget(
                        entries[index], max_memory.reserve_bytes, max_memory.host_bytes, f"max_memory[{index}]"
                    ),
                )
            )
        elif device.type != "cuda":
            raise ValueError(
                f"max_memory[{index}]='auto' measures a CUDA device's free memory, but the model executes on "
                f"{device}. Give a size instead, e.g. max_memory={{0: '10GiB', 1: '10GiB'}}."
            )
        else:
            free = available_device_bytes(model, torch.device("cuda", index))
            budgets.append(
                (
                    index,
                    MemoryBudget(
                        free, max_memory.reserve_bytes, max_memory.host_bytes, f"free memory of cuda:{index}"
                    ),
                )
            )
    return budgets


def available_device_bytes(model: nn.Module, device: torch.device) -> int:
    """Memory a dispatch of `model` can use on `device`: free memory (`torch.cuda.mem_get_info`), plus what PyTorch
    has cached but not allocated, plus what the model's own tensors already take there."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    own = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device == device:
            storage = tensor.untyped_storage()
            own[storage.data_ptr()] = storage.nbytes()
    return free + cached + sum(own.values())
