"""`hf_prefetch.plan`: the plan that `dispatch_model` or `from_pretrained` would execute, without executing it.

For a checkpoint folder it builds the model on the meta device as the loader does, reading only `config.json` and
the safetensors headers; for a Hub id it downloads no weights (`loading/hub.py`, `header_folder`). It moves and
allocates no weights; it touches CUDA only when the device is a GPU, to read its free memory for
`max_memory="auto"` and to measure the link speed when `link_gbps` is not given.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .config import OffloadConfig, PrefetchConfig, UVAConfig, resolve_offload
from .lifecycle.checks import refuse_unknown_keywords, resolve_device
from .loading import skeleton
from .loading.checkpoint import Checkpoint
from .loading.file_layers import stored_layout
from .loading.hub import header_folder
from .loading.keymap import map_keys
from .loading.loader import check_building, set_attention
from .planning.choose import choose_plan
from .planning.link_speed import measure_link_gbps
from .planning.links import resolve_links
from .planning.memory import device_argument, parse_max_memory
from .planning.offload_plan import OffloadPlan
from .planning.selection import make_uva_plan

__all__ = ["plan"]


def plan(
    model_or_checkpoint: nn.Module | str | os.PathLike,
    offload: str | PrefetchConfig | UVAConfig | OffloadConfig = "prefetch",
    *,
    max_memory: dict[int | str, int | str] | str | None = None,
    reserve_bytes: int | str | None = None,
    links: str | Sequence[int | str | torch.device] | None = None,
    device: str | int | torch.device | None = None,
    layers: str | Sequence[str] | None = None,
    dtype: torch.dtype | str | None = None,
    model_class: type | None = None,
    link_gbps: float | None = None,
    revision: str | None = None,
    token: bool | str | None = None,
    subfolder: str | None = None,
    attn_implementation: str | dict[str, str] | None = None,
    trust_remote_code: bool = False,
    **unknown: Any,
) -> OffloadPlan:
    """The plan `dispatch_model` (for a model) or `from_pretrained` (for a checkpoint folder) would execute.

    Nothing is dispatched or loaded. `print(plan)` shows which layers stream, through which slot, and the totals:
    resident, pool and pinned bytes, bytes streamed per forward and, with a link speed, the time those bytes take.

    Args:
        model_or_checkpoint: A built model (its parameters may be on the meta device), or a checkpoint folder or
            Hub id (`"org/name"`) as `from_pretrained` takes it. A Hub id's weights are not downloaded: its
            `config.json` is, and the headers of the shards that are not cached are read from the Hub (a few byte
            ranges of each file). Offline (`HF_HUB_OFFLINE`) the shards must be cached. A bitsandbytes checkpoint's
            shards are downloaded: its model is built from settings stored in them.
        offload, max_memory, reserve_bytes, device, layers, links: As in `dispatch_model`.
        dtype, model_class, revision, token, subfolder, attn_implementation, trust_remote_code: For a checkpoint,
            as in `from_pretrained`.
        link_gbps (`float`, *optional*): Host-to-device link speed in GB/s, for the transfer time per forward. On a
            GPU it is measured when not given (a few 256 MiB pinned copies, once per process and device, then
            cached); on the CPU the line is left out.

    Returns:
        An `OffloadPlan`.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import hf_prefetch
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    ...         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    >>> plan = hf_prefetch.plan(model, max_memory={0: 1_300_000}, reserve_bytes=100_000, device="cpu", link_gbps=50)
    >>> [layer.index for layer in plan.rings[0].streamed], plan.transfer_seconds_per_forward < 1e-4
    ([1, 4, 7], True)

    ```
    """
    refuse_unknown_keywords("plan", unknown)
    config = resolve_offload(offload)
    uva = isinstance(config, UVAConfig)
    if uva and (max_memory is not None or reserve_bytes is not None or links is not None):
        raise ValueError("max_memory, reserve_bytes and links work with the prefetch backend only, not with UVA.")
    max_memory = None if uva else parse_max_memory(max_memory, reserve_bytes, config)
    exec_device = resolve_device(device_argument(max_memory, device))
    link_indices = resolve_links(links, exec_device)
    if link_gbps is not None and (isinstance(link_gbps, bool) or not isinstance(link_gbps, int | float)):
        raise ValueError(f"link_gbps={link_gbps!r} must be a number of GB/s, e.g. link_gbps=55.0, or None.")
    if link_gbps is not None and not link_gbps > 0:
        raise ValueError(f"link_gbps={link_gbps!r} must be > 0 (GB/s), or None.")
    building = dict(dtype=dtype, model_class=model_class, revision=revision, token=token, subfolder=subfolder)
    building.update(attn_implementation=attn_implementation, trust_remote_code=trust_remote_code or None)
    if isinstance(model_or_checkpoint, nn.Module):
        if given := [f"{name}=" for name, value in building.items() if value is not None]:
            names = " and ".join(given) if len(given) < 3 else ", ".join(given[:-1]) + " and " + given[-1]
            raise ValueError(
                f"{names} {'describes' if len(given) == 1 else 'describe'} how a checkpoint is found and built; a "
                "built model already has them. Convert the model, or pass the checkpoint folder or Hub id instead."
            )
        model, as_is = model_or_checkpoint, None
    else:
        check_building(attn_implementation, trust_remote_code)
        with header_folder(model_or_checkpoint, revision=revision, token=token, subfolder=subfolder) as found:
            folder = skeleton.checkpoint_folder(found)
            with Checkpoint.open(folder) as checkpoint:
                model, _ = skeleton.build_skeleton(folder, checkpoint, dtype, model_class)
                as_is = stored_layout(map_keys(model, checkpoint))  # what may stay in the files (a host budget's)
            set_attention(model, attn_implementation)
    if uva:
        result = make_uva_plan(model, config, layers)
    else:
        result = choose_plan(model, config, layers, exec_device, max_memory, link_indices, as_is)
    if link_gbps is None and exec_device.type == "cuda":
        link_gbps = measure_link_gbps(exec_device)
    return dataclasses.replace(result, link_gbps=link_gbps)
