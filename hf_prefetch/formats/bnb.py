"""bitsandbytes' 4-bit and 8-bit parameters as the tensors they are stored in.

A `Params4bit` (transformers' `BitsAndBytesConfig(load_in_4bit=True)`, `bnb.nn.Linear4bit`) is a plain uint8 tensor of
packed weights with a `QuantState` beside it: the blocks' scales (`absmax`), the 16-value code (`code`) and, with
double quantization, the scales' own scales (`offset`, `state2.absmax`, `state2.code`). bitsandbytes' kernels read
those tensors through the parameter, so streaming one means streaming each of them into a slot of its own and pointing
its attribute (`param.quant_state.absmax`) at the slot, as `param.data` points at the packed bytes. Each goes by the
name bitsandbytes' state_dict gives it (`weight:absmax` in a plan). Nothing is dequantized.

bitsandbytes' forward changes a layer's tensors in two cases, which a slot would not follow: on a CPU with AVX512-BF16
it repacks the weight for its CPU kernels (a model dispatched onto the CPU keeps its portable kernels instead,
`repacks_on_cpu`), and it casts a bias to the activations' dtype by assigning `bias.data` (a `Linear4bit`'s bias stays
resident, `replaced_in_forward`).

An 8-bit parameter (`Int8Params`, `BitsAndBytesConfig(load_in_8bit=True)`, `bnb.nn.Linear8bitLt`) is an int8 tensor
with its rows' scales (`SCB`, float32). Its module's forward first moves both from the parameter (`weight.CB`,
`weight.SCB`) into the module's matmul state (`state.CB`, `state.SCB`), then computes from the state and sets
`weight.data` to `state.CB`: once a slot is in the state, nothing would follow the next pointing. So a dispatch keeps
the scales on the parameter (`weight.SCB`, the part `SCB`, pointed at like `data`) and gives the module a state that
reads both through the parameter whatever it points at (`following_state`, journaled); after a removal the layer is
put back as bitsandbytes leaves a freshly quantized one (`settle_int8`): its next forward moves them into its state.

This module knows bitsandbytes' layout, not plans or streams; it never imports bitsandbytes unless a model holds its
parameters.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "is_params4bit",
    "is_int8",
    "following_state",
    "settle_int8",
    "storage_parts",
    "attribute_path",
    "check_layout",
    "unpack_for",
    "repacks_on_cpu",
    "replaced_in_forward",
    "host_state_dict",
    "plain_save",
    "prepare_prequantized",
    "checkpoint_parts",
]


def is_params4bit(param: Any) -> bool:
    """Whether `param` is a bitsandbytes `Params4bit` (checked without importing bitsandbytes)."""
    classes = type(param).__mro__
    return any(cls.__name__ == "Params4bit" and cls.__module__.startswith("bitsandbytes") for cls in classes)


def is_int8(param: Any) -> bool:
    """Whether `param` is a quantized bitsandbytes `Int8Params` (int8 values, not training weights kept in 16 bits)."""
    classes = type(param).__mro__
    named = any(cls.__name__ == "Int8Params" and cls.__module__.startswith("bitsandbytes") for cls in classes)
    return named and param.dtype == torch.int8 and not getattr(param, "has_fp16_weights", True)


def int8_scales(param: torch.Tensor, module: nn.Module | None) -> torch.Tensor | None:
    """An 8-bit parameter's row scales: on the parameter before its first forward, in its module's state after."""
    scales = getattr(param, "SCB", None)
    if scales is None and module is not None and getattr(module, "weight", None) is param:
        scales = getattr(getattr(module, "state", None), "SCB", None)
    return scales


# A 4-bit parameter's tensors: the name each goes by (bitsandbytes' own state_dict keys, after `weight.`), and where
# it is from the parameter. The packed bytes come first; the last three exist with double quantization only.
_PATHS = {
    "data": ("data",),
    "absmax": ("quant_state", "absmax"),
    "quant_map": ("quant_state", "code"),
    "nested_offset": ("quant_state", "offset"),
    "nested_absmax": ("quant_state", "state2", "absmax"),
    "nested_quant_map": ("quant_state", "state2", "code"),
}


def storage_parts(param: torch.Tensor, module: nn.Module | None = None) -> list[tuple[str, torch.Tensor]] | None:
    """A quantized `Params4bit`'s tensors, (name, tensor): the packed bytes (`data`) first, then its quantization
    state's (`absmax`, `quant_map`, with double quantization `nested_offset`, `nested_absmax`, `nested_quant_map`); a
    quantized `Int8Params`'s values (`data`) and row scales (`SCB`, found in `module`'s state after a forward). None
    for any other parameter, and for one not quantized yet (or whose scales cannot be found)."""
    if is_int8(param):
        scales = int8_scales(param, module)
        return None if scales is None else [("data", param.data), ("SCB", scales)]
    state = getattr(param, "quant_state", None) if is_params4bit(param) else None
    if state is None:
        return None
    names = list(_PATHS) if state.nested else list(_PATHS)[:3]
    return [(name, _get(param, _PATHS[name])) for name in names]


def attribute_path(param: torch.Tensor, name: str) -> tuple[str, ...]:
    """Where the tensor `name` is from `param`: a 4-bit parameter's part through its quantization state, anything
    else an attribute of the parameter itself (`data`, a tensor subclass's inner tensor)."""
    return _PATHS[name] if name in _PATHS and is_params4bit(param) else (name,)


def _get(value: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        value = getattr(value, name)
    return value


def check_layout(model: nn.Module, device: torch.device) -> None:
    """Refuse (ValueError) to plan a model for a GPU whose 4-bit layers hold bitsandbytes' CPU layout: a forward on
    the CPU under `no_grad` repacks a `Linear4bit`'s weight and scales for the CPU kernels, which read nothing else,
    and only moving the layer (`.cuda()`) unpacks it."""
    if device.type == "cpu":
        return
    for path, module in model.named_modules():
        if _packed_for_cpu(getattr(module, "weight", None)):
            raise ValueError(
                f"{path}.weight holds bitsandbytes' CPU layout (a forward on the CPU repacked it), which its CUDA "
                f"kernels cannot read, and hf_prefetch streams tensors as they are. Load the model again (e.g. "
                f"device_map='cuda', then .to('cpu')) and dispatch it onto {device} before any forward on the CPU."
            )


def unpack_for(model: nn.Module, device: torch.device) -> None:
    """After a removal onto `device`: 4-bit layers in bitsandbytes' CPU layout unpacked for a GPU (as `.cuda()`)."""
    if device.type == "cpu":
        return
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if _packed_for_cpu(weight):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
            module.quant_state = weight.quant_state


def repacks_on_cpu(module: nn.Module) -> bool:
    """Whether bitsandbytes would repack this module's weight for its CPU kernels at a forward on the CPU (a
    `Linear4bit` on a CPU with AVX512-BF16, not repacked yet): its forward would replace the weight's tensors."""
    weight = getattr(module, "weight", None)
    repacks = getattr(module, "support_avx512bf16_for_cpu", False)  # Linear4bit's; bitsandbytes' other modules: none
    return repacks and is_params4bit(weight) and storage_parts(weight) is not None and not _packed_for_cpu(weight)


def _packed_for_cpu(weight: Any) -> bool:
    # A quantized 4-bit weight that bitsandbytes repacked for its CPU kernels.
    quantized = is_params4bit(weight) and storage_parts(weight) is not None
    return quantized and getattr(weight.quant_state, "packing_format_for_cpu", False)


def replaced_in_forward(module: nn.Module, name: str) -> bool:
    """Whether `module`'s forward may replace its parameter `name` with a new tensor: a `Linear4bit` or `Linear8bitLt`
    casts its bias to the activations' dtype by assigning `bias.data` (bitsandbytes 0.50), which a streamed bias's slot
    would not see."""
    weight = getattr(module, "weight", None)
    return name == "bias" and (is_params4bit(weight) or is_int8(weight))


def int8_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose `weight` is a quantized 8-bit parameter with a matmul state (`Linear8bitLt`)."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if is_int8(getattr(module, "weight", None)) and hasattr(module, "state")
    ]


def following_state(module: nn.Module) -> Any:
    """A matmul state for an 8-bit `module` that reads its values and scales through `module.weight` (`data`, `SCB`)
    whatever they point at, with the original state's other fields (threshold, ...). Setting them to anything else is
    a RuntimeError: bitsandbytes' inference forward never does (its weight has no `CB` during a dispatch). A copy or a
    pickle of it is a plain `MatmulLtState` holding what it reads now (a resident layer copied out of the model)."""
    state = object.__new__(_following_state_class())
    for name, value in vars(module.state).items():
        if name not in ("CB", "SCB"):
            object.__setattr__(state, name, value)
    object.__setattr__(state, "_module", weakref.ref(module))  # the module holds the state: no reference cycle
    return state


@functools.cache
def _following_state_class() -> type:
    from bitsandbytes import MatmulLtState

    class FollowingState(MatmulLtState):
        CB = property(lambda self: self._module().weight.data, lambda self, value: self._keep("CB", value))
        SCB = property(lambda self: self._module().weight.SCB, lambda self, value: self._keep("SCB", value))

        def _keep(self, name: str, value: Any) -> None:
            current = getattr(self, name)
            if value is not None and value.data_ptr() == current.data_ptr() and value.shape == current.shape:
                return  # e.g. `load_state_dict` setting state.SCB to weight.SCB: what it reads already
            raise RuntimeError(
                f"bitsandbytes set the matmul state's {name} of an 8-bit layer dispatched by hf_prefetch, whose "
                "values live in host storage and its slot: train or re-quantize it after hf_prefetch.remove_offload."
            )

        def _fields(self) -> dict[str, Any]:
            fields = {name: value for name, value in vars(self).items() if name != "_module"}
            return fields | {"CB": self.CB, "SCB": self.SCB}

        def __deepcopy__(self, memo: dict) -> MatmulLtState:
            return _matmul_state(copy.deepcopy(self._fields(), memo))

        def __reduce_ex__(self, protocol: Any) -> Any:
            return _matmul_state, (self._fields(),)

    return FollowingState


def _matmul_state(fields: dict[str, Any]) -> Any:
    # A plain bitsandbytes MatmulLtState holding `fields` (a copy or an unpickled `following_state`).
    from bitsandbytes import MatmulLtState

    state = object.__new__(MatmulLtState)
    state.__dict__.update(fields)
    return state


def settle_int8(model: nn.Module) -> None:
    """After a removal, each 8-bit layer (its values and scales named by its parameter only during the dispatch) as
    bitsandbytes leaves a freshly quantized one: `weight.CB` is its data, which may now be other storage than before,
    and its next forward moves both into its matmul state."""
    for _, module in int8_modules(model):
        if module.weight.SCB is not None:
            module.weight.CB = module.weight.data


def host_state_dict(param: torch.Tensor, host: dict[str, torch.Tensor], prefix: str, state_dict: dict) -> None:
    """Replace a streamed `Params4bit`'s entries in `state_dict` (`prefix` is its key: `...weight`) by the values
    of its host tensors (`host`: name -> tensor, as `storage_parts` names them), in the format `Linear4bit` saves
    them."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    state = copy.copy(param.quant_state)  # a copy: the parameter's state points at slots
    if state.nested:
        state.state2 = copy.copy(state.state2)
        state.offset, state.state2.absmax = host["nested_offset"], host["nested_absmax"]
        state.state2.code = host["nested_quant_map"]
    state.absmax, state.code, data = host["absmax"], host["quant_map"], host["data"]
    if getattr(state, "packing_format_for_cpu", False):
        data, state = _convert_weight_packed_for_cpu_inverse(data, state)
    state_dict[prefix] = data
    for key, value in state.as_dict(packed=True).items():
        state_dict[f"{prefix}.{key}"] = value


def plain_save(module: nn.Module) -> Callable[[dict, str, bool], None]:
    """`_save_to_state_dict` for a `Linear4bit` whose weight streams: torch's own (the weight and bias as they are),
    after which the dispatch's state_dict hook writes the host values and the quantization state
    (`host_state_dict`). `Linear4bit`'s own would read the slots, and on the CPU unpack them in place."""
    ref = weakref.ref(module)  # the module holds this function: no reference cycle

    def save(destination: dict, prefix: str, keep_vars: bool) -> None:
        nn.Module._save_to_state_dict(ref(), destination, prefix, keep_vars)

    return save


def prepare_prequantized(model: nn.Module, checkpoint: Any) -> None:
    """A pre-quantized bitsandbytes checkpoint's model, on the meta device after transformers' quantizer replaced its
    linears: each layer's weight made what the checkpoint stores (`checkpoint`: a `checkpoint.Checkpoint`), so that a
    plan counts the stored bytes and the loader reads them into place. A 4-bit weight: the packed bytes' dtype and
    shape, and a quantization state of meta tensors of the stored shapes, its settings (and double quantization's
    offset, a number) read from the checkpoint's packed `weight.quant_state.bitsandbytes__<type>` entry, as
    `Params4bit.from_prequantized` does. An 8-bit weight: int8 values and float32 row scales (`SCB`), both meta. Every
    stored tensor is checked against the layer's features (`ValueError` naming the key)."""
    from bitsandbytes.nn import Linear4bit, Linear8bitLt

    for path, module in model.named_modules():
        if isinstance(module, Linear8bitLt):
            module.weight = _stored_8bit(checkpoint, path, module)
        elif isinstance(module, Linear4bit):
            module.weight = _stored_4bit(checkpoint, path, module)
            _check_4bit(checkpoint, path, module)


def _stored_8bit(checkpoint: Any, path: str, module: nn.Module) -> torch.Tensor:
    from bitsandbytes.nn import Int8Params

    weight, scales = _stored(checkpoint, f"{path}.weight", module), _stored(checkpoint, f"{path}.SCB", module)
    features = (module.out_features, module.in_features)
    stored = (weight.dtype, tuple(weight.shape), scales.dtype, tuple(scales.shape))
    if stored != (torch.int8, features, torch.float32, features[:1]):
        raise ValueError(
            f"{checkpoint[f'{path}.weight'].path}: {path}.weight ({weight.dtype}, {list(weight.shape)}) and "
            f"{path}.SCB ({scales.dtype}, {list(scales.shape)}) are not the 8-bit weight of {path}, a linear of "
            f"{features[1]} inputs and {features[0]} outputs (int8 {list(features)} and float32 [{features[0]}]). The "
            "checkpoint does not match its config.json: re-save it from the quantized model."
        )
    _check_row_major(checkpoint, f"{path}.weight_format")
    return Int8Params(weight, requires_grad=False, has_fp16_weights=False, SCB=scales)


def _stored_4bit(checkpoint: Any, path: str, module: nn.Module) -> torch.Tensor:
    from bitsandbytes.nn import Params4bit
    from bitsandbytes.utils import unpack_tensor_to_dict

    packed = [f"{path}.weight.quant_state.bitsandbytes__{kind}" for kind in ("nf4", "fp4")]
    packed = [key for key in packed if key in checkpoint]
    if len(packed) != 1:
        raise ValueError(
            f"{checkpoint.folder}: the 4-bit layer {path} needs exactly one quantization-state entry "
            f"'{path}.weight.quant_state.bitsandbytes__nf4' (or __fp4), found {packed}. The checkpoint was not "
            "saved from a bitsandbytes 4-bit model of this config: re-save it from the quantized model."
        )
    entry = checkpoint[packed[0]]
    if entry.nbytes > _MAX_SETTINGS_BYTES:
        raise ValueError(
            f"{entry.path}: {entry.key!r} is {entry.nbytes} bytes, not the few hundred of bitsandbytes' packed "
            "quantization settings: the checkpoint is damaged. Re-save it from the quantized model."
        )
    raw = torch.empty(entry.nbytes, dtype=torch.uint8)
    checkpoint.read(entry, raw.numpy())
    try:
        settings = unpack_tensor_to_dict(raw)
        if not isinstance(settings, dict):
            raise ValueError(f"JSON {type(settings).__name__}, not an object")
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and json's errors are ValueErrors
        raise ValueError(
            f"{entry.path}: {entry.key!r} is not bitsandbytes' packed quantization state ({error}): the "
            "checkpoint is damaged. Re-save it from the quantized model."
        ) from None
    nested = ("nested_absmax", "nested_quant_map") if "nested_offset" in settings else ()
    stats = {name: _stored(checkpoint, f"{path}.weight.{name}", module) for name in ("absmax", "quant_map", *nested)}
    stats[packed[0].removeprefix(f"{path}.weight.")] = raw
    weight = _stored(checkpoint, f"{path}.weight", module)
    try:
        param = Params4bit.from_prequantized(weight, stats, device="meta", module=module)
        if param.quant_state.nested:  # a number in the checkpoint: a real tensor, as bitsandbytes makes it
            param.quant_state.offset = torch.tensor(float(settings["nested_offset"]))
    except (AssertionError, KeyError, ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{entry.path}: {entry.key!r} holds settings bitsandbytes cannot build a quantization state from "
            f"({type(error).__name__}: {error}): {settings}. Re-save the checkpoint from the quantized model."
        ) from None
    return param


_MAX_SETTINGS_BYTES = 1 << 16  # a 4-bit layer's packed settings: a JSON object of seven fields


def _check_4bit(checkpoint: Any, path: str, module: nn.Module) -> None:
    # The stored tensors of a 4-bit weight against its linear's features: packed values (two per byte), one scale per
    # block, 16 code values; with double quantization one scale per block of scales, 256 code values.
    state = module.weight.quant_state
    features = (module.out_features, module.in_features)
    values = features[0] * features[1]
    blocks = -(-values // state.blocksize)
    expected = {
        "weight.quant_state": (tuple(state.shape), features, "shape"),
        "weight": (module.weight.numel() * module.weight.element_size(), -(-values // 2), "bytes"),
        "weight.absmax": (state.absmax.numel(), blocks, "scales"),
        "weight.quant_map": (state.code.numel(), 16, "code values"),
    }
    if state.nested:
        expected["weight.nested_absmax"] = (
            state.state2.absmax.numel(),
            -(-blocks // state.state2.blocksize),
            "scales",
        )
        expected["weight.nested_quant_map"] = (state.state2.code.numel(), 256, "code values")
    for key, (stored, wanted, what) in expected.items():
        if stored != wanted:
            name = f"{path}.{key}" + (f".bitsandbytes__{state.quant_type}" if key == "weight.quant_state" else "")
            raise ValueError(
                f"{checkpoint.folder}: {name!r} gives {stored} {what} where {path}, a 4-bit linear of {features[1]} "
                f"inputs and {features[0]} outputs, needs {wanted}. The checkpoint does not match its config.json: "
                "re-save it from the quantized model."
            )


def _check_row_major(checkpoint: Any, key: str) -> None:
    # bitsandbytes saves 8-bit weights row-major (format 0); older releases wrote tiled GPU layouts (1-3).
    if key not in checkpoint:
        return
    entry = checkpoint[key]
    value = None
    if entry.nbytes <= 8 and not entry.dtype.is_floating_point and len(entry.shape) <= 1:
        stored = torch.zeros(entry.nbytes, dtype=torch.uint8)
        checkpoint.read(entry, stored.numpy())
        value = stored.view(entry.dtype).tolist()
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
    if value != 0:
        raise ValueError(
            f"{entry.path}: {key!r} ({entry.dtype}, shape {list(entry.shape)}, value {value}) is not bitsandbytes' "
            "row-major format 0: the 8-bit weight is stored in a tiled GPU layout of an older bitsandbytes, which "
            "hf_prefetch does not convert. Load the checkpoint with transformers and save it again with a current "
            "bitsandbytes."
        )


def _stored(checkpoint: Any, key: str, module: nn.Module) -> torch.Tensor:
    # A meta tensor of the dtype and shape `key` has in the checkpoint.
    if key not in checkpoint:
        shorter = key.partition(".")[2]
        hint = (
            f" It names it {shorter!r}: it was saved from the base model; load it with model_class=transformers."
            "AutoModel (or the base model's class)."
            if shorter in checkpoint
            else " It was saved from another model or without quantization: check config.json, or re-save it."
        )
        raise ValueError(
            f"{checkpoint.folder}: no tensor {key!r} for the bitsandbytes layer {type(module).__name__} that the "
            f"config.json quantization_config makes of it (the checkpoint holds keys like {checkpoint.keys()[:3]})."
            + hint
        )
    entry = checkpoint[key]
    return torch.empty(entry.shape, dtype=entry.dtype, device="meta")


def checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, torch.Tensor] | None]:
    """For the bitsandbytes layers of `model`: each checkpoint key of their weights -> (the part's name in a plan,
    `weight:absmax` after the layer's path, and the tensor it fills), or None for a key that fills nothing (the packed
    quantization settings `prepare_prequantized` read, an 8-bit layer's `weight_format`)."""
    found: dict[str, tuple[str, torch.Tensor] | None] = {}
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if is_int8(weight) and hasattr(module, "state") and weight.SCB is not None:  # as prepare_prequantized makes it
            found[f"{path}.weight"] = (f"{path}.weight:data", weight)
            found[f"{path}.SCB"] = (f"{path}.weight:SCB", weight.SCB)
            found[f"{path}.weight_format"] = None
        elif is_params4bit(weight) and (parts := storage_parts(weight)) is not None:
            state = weight.quant_state
            found[f"{path}.weight"] = (f"{path}.weight:data", weight)
            for name, tensor in parts[1:]:
                if name != "nested_offset":  # a number in the packed settings
                    found[f"{path}.weight.{name}"] = (f"{path}.weight:{name}", tensor)
            found[f"{path}.weight.quant_state.bitsandbytes__{state.quant_type}"] = None
    return found
