"""What every verb checks before it changes anything: its arguments (the execution device, the config, keywords it
does not take) and the model (another offloading mechanism that manages it). Nothing here changes a model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import PrefetchConfig, UVAConfig, resolve_offload
from ..formats.compressed_tensors import decompresses, is_compressed

__all__ = ["resolve_device", "resolve_config", "refuse_unknown_keywords", "refuse_other_offload"]


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """The execution device: CUDA when available and not told otherwise, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        # A GPU index names a CUDA device (whose absence is said below), whatever accelerator torch would pick.
        resolved = torch.device("cuda", device) if type(device) is int else torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device; use 'cuda', 'cuda:0', 0 or 'cpu'.") from err
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device={device!r}: hf_prefetch executes on 'cuda' or 'cpu' devices only.")
    if not torch.cuda.is_available():
        reason = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA driver or GPU was found"
        raise ValueError(f"device={device!r} but CUDA is not available ({reason}). Pass device='cpu'.")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: there are only {torch.cuda.device_count()} CUDA device(s).")
    return torch.device("cuda", index)


def resolve_config(offload: Any, verb: str) -> PrefetchConfig:
    """The prefetch config of a verb that runs prefetch only (the loaders, `plan` of a folder)."""
    resolved = resolve_offload(offload)
    if isinstance(resolved, UVAConfig):
        raise ValueError(
            f"The UVA backend (offload='uva' or a UVAConfig) works with hf_prefetch.dispatch_model only ({verb} runs "
            "prefetch): load the model in host "
            "memory (e.g. with transformers), then call hf_prefetch.dispatch_model(model, UVAConfig(cpu_offload_gb="
            "...)); hf_prefetch.plan(model, UVAConfig(...)) shows the plan."
        )
    return resolved


_TAKES_DTYPE = {"from_pretrained", "load_checkpoint_and_dispatch", "plan"}


def refuse_unknown_keywords(verb: str, keywords: dict[str, Any]) -> None:
    """A clear error for keywords a verb does not take: config fields, and accelerate's and transformers' names."""
    if not keywords:
        return
    from dataclasses import fields

    given = sorted(keywords)
    hints = []
    for config_class in (PrefetchConfig, UVAConfig):
        names = {f.name for f in fields(config_class)}
        if chosen := [k for k in given if k in names]:
            values = ", ".join(f"{k}={keywords[k]!r}" for k in chosen)
            hints.append(
                f"pass the configuration as an object: {verb}(..., hf_prefetch.{config_class.__name__}({values}))"
            )
    dtype = "is called dtype= here" if verb in _TAKES_DTYPE else f"has no use: {verb} keeps the model's dtypes"
    renames = {
        "device_map": "is called device= here (one execution device; max_memory= gives a budget)",
        "torch_dtype": dtype,
        "config": "is called offload= here (a PrefetchConfig or UVAConfig)",
        "low_cpu_mem_usage": "has no use: hf_prefetch always reads each tensor once into its final place",
    }
    hints += [f"{k}= {renames[k]}" for k in given if k in renames]
    hint = "; ".join(hints) or f"see help(hf_prefetch.{verb}) for the arguments it takes"
    raise TypeError(f"{verb}() got unexpected keyword argument(s) {given}: {hint}.")


def refuse_other_offload(model: nn.Module) -> None:
    """Refuse a model that another offloading mechanism manages: accelerate's `cpu_offload` / `disk_offload` hooks
    (diffusers' `enable_sequential_cpu_offload`), `cpu_offload_with_hook` (`enable_model_cpu_offload`), or diffusers'
    group offloading. Each moves the weights hf_prefetch places, so the two would fight (a `.to()` refused in the
    middle of a pipeline call, or weights on the meta device); or compressed-tensors' decompression hook or
    offloading."""
    _refuse_compressed_tensors(model)
    for name, module in model.named_modules():
        for hook in _accelerate_hooks(module):
            kind = type(hook).__name__
            if kind in ("CpuOffload", "UserCpuOffloadHook") or (kind == "AlignDevicesHook" and hook.offload):
                where = f"{name!r} ({type(module).__name__})" if name else "the model itself"
                raise ValueError(
                    f"{type(model).__name__} is managed by accelerate's CPU offloading ({kind} on {where}: "
                    "enable_model_cpu_offload / enable_sequential_cpu_offload, cpu_offload, disk_offload). "
                    "hf_prefetch places the weights itself. Remove those hooks first (pipe.remove_all_hooks(), or "
                    "accelerate.hooks.remove_hook_from_module(model, recurse=True)), then dispatch."
                )
        registry = getattr(module, "_diffusers_hook", None)
        # Group offloading moves the weights, layerwise casting casts them at every forward (`module.to`).
        moving = [key for key in getattr(registry, "hooks", {}) if "offload" in key or "casting" in key]
        if moving:
            where = f"{name!r} ({type(module).__name__})" if name else "the model itself"
            raise ValueError(
                f"{type(model).__name__} has a diffusers hook that moves or casts its weights ({moving[0]} on "
                f"{where}: group offloading or layerwise casting). hf_prefetch places the weights itself. Dispatch a "
                "model without it (diffusers offers no call that removes it: build or load the model again)."
            )


def _refuse_compressed_tensors(model: nn.Module) -> None:
    # compressed-tensors keeps a model it loaded compressed (`dequantize=False`, transformers' default) until a hook
    # decompresses it at the first forward; that decompression also strips accelerate's hooks (hf_prefetch's) and
    # wraps every module in compressed-tensors' own offloading, which moves the tensors hf_prefetch places.
    modules = list(model.named_modules())
    for name, module in modules:
        if is_compressed(module) and not decompresses(module):
            raise ValueError(
                f"{name!r} ({type(module).__name__}) of {type(model).__name__} still holds compressed-tensors' "
                "compressed weights, which its first forward replaces with decompressed ones. Dispatch it after that "
                "forward and after removing compressed-tensors' offloading "
                "(compressed_tensors.offload.remove_dispatch(model, onload_tensors=True)) to stream the dense "
                "weights; hf_prefetch.from_pretrained streams compressed-tensors FP8 and pack-quantized checkpoints "
                "as stored."
            )
    if getattr(model, "ct_decompress_hook", None) is not None:
        raise ValueError(
            f"{type(model).__name__} carries compressed-tensors' decompression hook (`ct_decompress_hook`), which "
            "runs at its first forward, removes accelerate's hooks (hf_prefetch's among them) and puts "
            "compressed-tensors' offloading in their place. None of its modules is compressed (FP8 loaded with "
            "use_optimized_inference), so it has nothing else to do: remove it first with "
            "model.ct_decompress_hook.remove(); del model.ct_decompress_hook."
        )
    for name, module in modules:
        if type(module._parameters).__module__.startswith("compressed_tensors"):
            where = f"{name!r} ({type(module).__name__})" if name else "the model itself"
            raise ValueError(
                f"{where} of {type(model).__name__} is managed by compressed-tensors' offloading (its decompression "
                "puts it on every module), which moves the tensors hf_prefetch places. Remove it first: "
                "compressed_tensors.offload.remove_dispatch(model, onload_tensors=True)."
            )


def _accelerate_hooks(module: nn.Module) -> list[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])  # a SequentialHook holds several
