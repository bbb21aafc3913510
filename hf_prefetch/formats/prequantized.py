"""Pre-quantized checkpoints: the skeleton's quantized parameters made what the checkpoint stores, and which checkpoint
key fills which of their parts.

transformers' own quantizer prepares the skeleton (loading/skeleton.py); its quantized parameters are then rebuilt on
the meta device from the checkpoint's headers, so that a plan counts the stored bytes and the loader reads each stored
tensor straight into its place, as a part of its parameter (`weight:qdata`, the names `parts.stored_parts` gives):

- bitsandbytes 4-bit and 8-bit layers: `bnb.prepare_prequantized`, `bnb.checkpoint_parts`;
- torchao tensor subclasses (`TorchAoConfig`, saved as safetensors): each subclass parameter is stored flattened, one
  tensor per inner tensor (`<module>._weight_qdata`), with its type and non-tensor attributes in the files'
  `__metadata__`; torchao's own `unflatten_tensor_state_dict` rebuilds it here around meta tensors.

FP8 checkpoints need nothing of this: transformers' `FP8Linear` holds plain tensors. This module reads headers and
metadata only (bitsandbytes' packed settings aside, a few bytes each), never the weights.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import bnb
from .parts import is_dtensor

__all__ = ["prepare", "checkpoint_parts", "quant_method"]


def quant_method(quantization: Any) -> str | None:
    """The method name of a quantization config (transformers' object or config.json's dict), None for none."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    method = getattr(quantization, "quant_method", method)
    return getattr(method, "value", method)  # transformers' QuantizationMethod enum


def prepare(model: nn.Module, checkpoint: Any, method: str) -> None:
    """Make `model`'s quantized parameters (after transformers' quantizer prepared it for quantization `method`) what
    `checkpoint` stores; `ValueError` naming the key or the metadata entry for a checkpoint that does not hold them."""
    if method == "bitsandbytes":
        bnb.prepare_prequantized(model, checkpoint)
    elif method == "torchao":
        _prepare_torchao(model, checkpoint)


def checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, torch.Tensor] | None]:
    """Checkpoint key -> (the name of the parameter part it fills, `<param>:<part>`, and that part's tensor), for
    `model`'s parameters stored as several tensors; None for a key that fills nothing (the entries a parameter's
    settings were read from). A parameter two modules share (tied embeddings) has its parts under both names. A
    tensor-parallel shard (DTensor) is stored whole, under its own name."""
    found = bnb.checkpoint_parts(model)
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            if not is_traceable_wrapper_subclass(param) or is_dtensor(param):  # a DTensor: loading/sharded.py
                continue
            name = f"{path}.{attr}" if path else attr
            owner = f"{path}." if path else ""
            for inner in param.__tensor_flatten__()[0]:
                found[f"{owner}_{attr}_{inner}"] = (f"{name}:{inner}", getattr(param, inner))
    return found


def _prepare_torchao(model: nn.Module, checkpoint: Any) -> None:
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    described = _torchao_tensors(checkpoint)
    # A quantized tensor `<module>.<attr>` is stored as `<module>._<attr>_<inner>`, one key per inner tensor.
    flattened: dict[str, set[str]] = {}  # module -> the names of its keys that start with "_"
    for key in checkpoint.keys():
        module_path, _, leaf = key.rpartition(".")
        if leaf.startswith("_"):
            flattened.setdefault(module_path, set()).add(leaf)
    claimed = {name.rpartition(".")[0]: set() for name in described}  # module -> the keys its tensors name
    for name, (_, inner) in described.items():
        module_path, _, attr = name.rpartition(".")
        claimed[module_path] |= {f"_{attr}_{part}" for part in inner}
    for name, (kind, inner) in described.items():
        module_path, _, attr = name.rpartition(".")
        leaves = flattened.get(module_path, set())
        wanted = {f"_{attr}_{part}" for part in inner}
        missing = sorted(wanted - leaves)
        extra = sorted(leaf for leaf in leaves - claimed[module_path] if leaf.startswith(f"_{attr}_"))
        owner = f"{module_path}." if module_path else ""
        if missing or extra:
            raise ValueError(
                f"{checkpoint.folder}: the torchao {kind} {name} is stored as {inner} (the files' __metadata__), but "
                + (
                    f"there is no tensor {owner + missing[0]!r}"
                    if missing
                    else f"the files also hold {[owner + leaf for leaf in extra]}"
                )
                + ". The checkpoint is damaged or incomplete: re-save it from the quantized model."
            )
        # One tensor at a time: torchao groups keys by prefix, which `weight` shares with a `weight_scale` beside it.
        alone = {"tensor_names": json.dumps([name]), name: checkpoint.metadata[name]}
        try:
            built, _ = unflatten_tensor_state_dict(
                {owner + leaf: _meta(checkpoint, owner + leaf) for leaf in wanted}, alone
            )
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(
                f"{checkpoint.folder}: torchao cannot rebuild {name} as its __metadata__ describes it "
                f"({type(error).__name__}: {error}). Re-save the checkpoint with this torchao version."
            ) from None
        if name not in built:
            raise ValueError(
                f"{checkpoint.folder}: torchao did not rebuild {name} from its stored tensors. Re-save it."
            )
        _install_meta(model, name, built[name], checkpoint)


def _torchao_tensors(checkpoint: Any) -> dict[str, tuple[str, list[str]]]:
    # The quantized tensors the files' __metadata__ describes: name -> (its torchao type, its inner tensors' names).
    from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES

    def refuse(problem: str) -> NoReturn:
        raise ValueError(
            f"{checkpoint.folder}: its safetensors files' __metadata__ does not describe torchao tensors ({problem}). "
            "Save the quantized model with save_pretrained (safetensors) from a transformers and torchao that write "
            "it, or load it with transformers and dispatch it with hf_prefetch.dispatch_model."
        )

    metadata = checkpoint.metadata
    names = _json(metadata.get("tensor_names"))
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        refuse(f"'tensor_names' is {metadata.get('tensor_names')!r:.80}, not a JSON list of tensor names")
    found = {}
    for name in names:
        entry = _json(metadata.get(name))
        kind = entry.get("_type") if isinstance(entry, dict) else None
        if kind == "Tensor":
            continue
        if kind not in ALLOWED_TENSORS_SUBCLASSES:
            refuse(f"{name!r} is {metadata.get(name)!r:.80}: not a tensor type torchao loads")
        inner = entry.get("_tensor_data_names")
        if not isinstance(inner, list) or not inner or not all(isinstance(part, str) for part in inner):
            refuse(f"{name!r} names its inner tensors {inner!r:.80}, not a list of names")
        found[name] = (kind, inner)
    return found


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (json.JSONDecodeError, RecursionError):
        return None


def _meta(checkpoint: Any, key: str) -> torch.Tensor:
    entry = checkpoint[key]
    return torch.empty(entry.shape, dtype=entry.dtype, device="meta")


def _install_meta(model: nn.Module, name: str, tensor: torch.Tensor, checkpoint: Any) -> None:
    # The skeleton's parameter `name` replaced by the rebuilt subclass (on the meta device), shapes checked.
    module_path, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_path)
        current = getattr(module, attr)
    except AttributeError:
        current = None
    if not isinstance(current, nn.Parameter):
        prefix = getattr(model, "base_model_prefix", "")
        hint = (
            " It was saved from the base model: load it with model_class=transformers.AutoModel (or the base "
            "model's class)."
            if prefix and _is_parameter(model, f"{prefix}.{name}")
            else " The checkpoint is for another architecture: check config.json."
        )
        raise ValueError(
            f"{checkpoint.folder}: its __metadata__ describes a quantized tensor {name}, which is not a parameter of "
            f"{type(model).__name__}.{hint}"
        )
    if tuple(current.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{checkpoint.folder}: the quantized {name} has shape {list(tensor.shape)} but {type(model).__name__}'s "
            f"has {list(current.shape)}. The checkpoint was saved for another configuration: check config.json."
        )
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def _is_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True
