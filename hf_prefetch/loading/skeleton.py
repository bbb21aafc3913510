"""The model of a checkpoint folder, built on the meta device with the dtypes it will be loaded in.

Finds the folder's `config.json` (nothing is downloaded), resolves `dtype="auto"` as transformers does, builds the
model class (an Auto class or a model class) under `init_empty_weights` with buffers real, prepares a pre-quantized
FP8, bitsandbytes, torchao or compressed-tensors (FP8 or packed integer) checkpoint's model with transformers' own
quantizer and makes its quantized parameters what the checkpoint stores (formats/prequantized.py,
formats/compressed_tensors.py), keeps an MXFP4 (gpt-oss) checkpoint's experts packed (formats/mxfp4.py; other
quantization methods are refused), and applies transformers' per-module dtype plan
(`_keep_in_fp32_modules`). It reads no weights (but bitsandbytes' packed quantization settings): filling the model is
the loader's job; `hf_prefetch.plan` of a folder uses the skeleton alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..formats import compressed_tensors, mxfp4, prequantized
from ..lifecycle.journal import Journal, Phase
from .checkpoint import Checkpoint

__all__ = ["build_skeleton", "checkpoint_folder", "set_dtypes"]

# float8 dtypes: quantized storage, never a dtype to load or cast a model in.
FLOAT8 = frozenset(
    t for name in dir(torch) if name.startswith("float8_") and isinstance(t := getattr(torch, name), torch.dtype)
)


def checkpoint_folder(path: str | os.PathLike) -> Path:
    """`path` as a folder that holds a config.json (nothing is downloaded)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no config.json. hf_prefetch reads local folders only (nothing is downloaded): pass "
            "the folder written by save_pretrained, or a local snapshot (huggingface_hub.snapshot_download)."
        )
    return folder


def build_skeleton(
    folder: Path, checkpoint: Checkpoint, dtype: Any, model_class: type | None
) -> tuple[nn.Module, torch.dtype]:
    """The model of a checkpoint folder on the meta device (buffers real), with the dtypes it will be loaded in."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

    model_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    quantizer = _prequantized(folder, getattr(model_config, "quantization_config", None))
    torch_dtype = _auto_dtype(dtype, model_config, checkpoint)
    model = _build_empty(model_class or AutoModelForCausalLM, model_config, torch_dtype)
    model.config.name_or_path = str(folder)
    method = prequantized.quant_method(quantizer.quantization_config) if quantizer is not None else None
    if method == "mxfp4":
        # transformers' preparation would put its hub kernels' experts modules in place (or, without them, keep the
        # dense ones it dequantizes into at load): the experts keep the packed tensors and dequantize them at every
        # forward instead (formats/mxfp4.py).
        mxfp4.prepare(model, checkpoint)
        model.is_quantized, model.quantization_method = True, method  # as transformers' preparation marks a model
    elif quantizer is not None:
        # transformers' own preparation, on the meta device: its quantized modules, whose parameters are the packed
        # tensors the checkpoint holds (read as they are, never dequantized). Under the model's dtype as the default,
        # as in transformers' from_pretrained: a new module's unquantized parameters (a bias) are created in it.
        from transformers.modeling_utils import local_torch_dtype

        with local_torch_dtype(torch_dtype, type(model).__name__):
            quantizer.preprocess_model(model, dtype=torch_dtype, device_map=None)
    if quantizer is not None:
        if method == "compressed-tensors":
            # compressed-tensors' preparation hooks a decompression of the whole model onto its first forward, which
            # would also strip accelerate's hooks (hf_prefetch's) and put its own offloading in their place. FP8
            # groups became FP8 matmul modules; packed ones decompress at every forward instead
            # (formats/compressed_tensors.py).
            quantizer.compressor.remove_decompression_hook(model)
            compressed_tensors.install(model)
            compressed_tensors.use_stored_zero_points(model, checkpoint)
        model.hf_quantizer = quantizer
        model.config.quantization_config = quantizer.quantization_config
        if method in ("bitsandbytes", "torchao"):
            # transformers' torchao quantizer reads the files' metadata in its own preparation, from files it opens;
            # here it is the metadata Checkpoint already read (torchao describes its tensors there).
            quantizer.metadata = checkpoint.metadata
            prequantized.prepare(model, checkpoint, method)  # each quantized parameter as stored (meta tensors)
            quantizer.postprocess_model(model)  # transformers' marks of a loaded one (is_loaded_in_4bit, ...)
    if isinstance(model, PreTrainedModel):
        model.tie_weights()  # as _load does: the plan must see tied tensors as one parameter
    set_dtypes(model, torch_dtype, cast=False, journal=Journal())
    return model, torch_dtype


# Pre-quantized checkpoints whose packed storage is plain tensors that transformers' quantizer declares on the meta
# device (the loader fills them like any parameter).
# bitsandbytes' layers and torchao's tensor subclasses are made to hold what the checkpoint stores
# (formats/prequantized.py).
# compressed-tensors: FP8 schemes built as transformers builds them with `use_optimized_inference=True`
# (`CompressedTensorsFP8Linear`, which computes with the stored bytes), and packed integer schemes kept packed and
# decompressed at every forward (formats/compressed_tensors.py) where transformers decompresses them once.
# MXFP4 experts (gpt-oss) kept packed and dequantized at every forward (formats/mxfp4.py) where transformers without
# its hub kernels dequantizes them once.
PREQUANTIZED = ("fp8", "bitsandbytes", "torchao", "compressed-tensors", "mxfp4")
_PACKAGES = {"bitsandbytes": "bitsandbytes", "torchao": "torchao", "compressed-tensors": "compressed_tensors"}


def _prequantized(folder: Path, quantization: Any) -> Any:
    """transformers' quantizer for a pre-quantized checkpoint hf_prefetch loads (None for an unquantized one)."""
    if quantization is None:
        return None
    method = prequantized.quant_method(quantization)
    where = f"{folder}/config.json quantization_config"
    if method not in PREQUANTIZED:
        raise ValueError(
            f"{where}.quant_method = {method!r}: from_pretrained loads unquantized checkpoints and pre-quantized ones "
            f"of {list(PREQUANTIZED)} (transformers' fine-grained FP8, bitsandbytes 4-bit and 8-bit, torchao, "
            "compressed-tensors FP8 and packed integers, MXFP4 experts of gpt-oss). A model "
            "quantized in memory streams its packed bytes through hf_prefetch.dispatch_model: load it with "
            "transformers' from_pretrained (e.g. device_map='cuda', then .to('cpu'), or device_map='cpu') and "
            "dispatch it. That covers transformers' fine-grained FP8 (FP8Linear), torchao's tensor subclasses "
            "(quantize_ or TorchAoConfig) and bitsandbytes' 4-bit and 8-bit layers."
        )
    if method in _PACKAGES:
        _check_installed(where, method)
    if method == "bitsandbytes":
        _check_bitsandbytes(where, quantization)
    from transformers.quantizers import AutoHfQuantizer

    if method == "compressed-tensors":
        quantization = _compressed_tensors(where, quantization)
    try:
        quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=True)
    except (ValueError, TypeError) as error:  # transformers' validation of the settings, which names the field
        raise ValueError(f"{where}: {str(error).rstrip('.')}. Fix that setting in config.json.") from None
    if method == "compressed-tensors":
        # What transformers' validate_environment sets where FP8 matmuls run. The CPU's scaled_mm runs them; a GPU
        # without FP8 matmuls is refused by the loader, which knows the device.
        quantizer.use_fp8_kernel = quantizer.quantization_config.use_optimized_inference
    settings = quantizer.quantization_config
    if getattr(settings, "dequantize", False):
        raise ValueError(
            f"{where}.dequantize = True asks for the weights dequantized to bf16 at load time; hf_prefetch streams "
            "the packed bytes. Set it to false, or load the dequantized model with transformers and dispatch it."
        )
    if getattr(settings, "scale_fmt", "float") != "float":
        raise ValueError(
            f"{where}.scale_fmt = {settings.scale_fmt!r}: scales that transformers converts after loading are not "
            "supported yet; from_pretrained reads FP8 checkpoints with float scales (scale_fmt 'float')."
        )
    return quantizer


def _check_installed(where: str, method: str) -> None:
    import importlib.util

    if importlib.util.find_spec(_PACKAGES[method]) is None:
        raise ImportError(
            f"{where}.quant_method = {method!r}: loading this checkpoint needs the {method} package, which is not "
            f"installed. pip install {method}"
        )


def _compressed_tensors(where: str, quantization: Any) -> Any:
    """The settings of a compressed-tensors checkpoint that streams its stored bytes: every config group FP8 weights
    (symmetric, a scale per row or per tensor: `use_optimized_inference=True`, transformers' FP8 matmul), or every one
    packed integer weights without quantized activations (`pack-quantized`: decompressed at every forward,
    formats/compressed_tensors.py); `ValueError` naming what is neither."""
    from transformers import CompressedTensorsConfig

    raw = quantization if isinstance(quantization, dict) else quantization.to_dict()
    try:
        settings = CompressedTensorsConfig.from_dict(dict(raw))
    except (ValueError, TypeError) as error:  # compressed-tensors' validation, which names the field
        raise ValueError(f"{where}: {str(error).rstrip('.')}. Fix that setting in config.json.") from None
    details = settings.quantization_config
    if not settings.is_quantization_compressed:  # post_init then sets dequantize, which config.json may not say
        status = getattr(details, "quantization_status", None)
        raise ValueError(
            f"{where}.quantization_status = {getattr(status, 'value', status)!r}: the checkpoint's "
            "weights are not stored compressed, so transformers loads them dense; from_pretrained streams "
            "compressed checkpoints. Load it with transformers and pass it to hf_prefetch.dispatch_model."
        )
    groups = details.config_groups if details is not None else {}
    if not groups:
        raise ValueError(f"{where}.config_groups is empty: the checkpoint names no quantized weights. Re-save it.")
    kinds = {name: _compressed_tensors_kind(where, name, group, details.format) for name, group in groups.items()}
    if len(set(kinds.values())) > 1:
        raise ValueError(
            f"{where}.config_groups mixes FP8 and packed integer weights ({kinds}): from_pretrained streams "
            "checkpoints whose groups are all one or all the other."
        )
    settings.use_optimized_inference = "fp8" in kinds.values()
    settings.post_init()
    return settings


def _compressed_tensors_kind(where: str, name: str, group: Any, format: Any) -> str:
    # "fp8" or "packed" for a config group from_pretrained streams; ValueError for another.
    weights = group.weights
    strategy = getattr(getattr(weights, "strategy", None), "value", getattr(weights, "strategy", None))
    format = getattr(group, "format", None) or format
    if weights is not None and weights.type == "float" and weights.num_bits == 8:
        if strategy in ("channel", "tensor") and weights.symmetric:
            return "fp8"
        raise ValueError(
            f"{where}.config_groups[{name!r}].weights: strategy {strategy!r}, symmetric {weights.symmetric}. "
            "transformers' FP8 matmul for compressed-tensors (CompressedTensorsFP8Linear) takes symmetric FP8 "
            "weights with a scale per row ('channel') or per tensor ('tensor'); transformers cannot load other "
            "FP8 layouts that way either."
        )
    packed = (
        weights is not None
        and weights.type == "int"
        and weights.num_bits in (4, 8)
        and strategy in ("group", "channel")
        and group.input_activations is None
        and group.output_activations is None
        and format == "pack-quantized"
    )
    if packed:
        return "packed"
    scheme = "no quantized"
    if weights is not None:
        symmetric = "symmetric" if weights.symmetric else "asymmetric"
        scheme = f"{weights.num_bits}-bit {symmetric} {weights.type} ({strategy})"
    raise ValueError(
        f"{where}.config_groups[{name!r}] stores {scheme} weights (format {format!r}, input_activations "
        f"{'set' if group.input_activations is not None else 'none'}, output_activations "
        f"{'set' if group.output_activations is not None else 'none'}). from_pretrained streams "
        "compressed-tensors checkpoints of FP8 weights (channel or tensor scales) or of packed 4- or 8-bit integer "
        "weights without quantized activations (pack-quantized, group or channel scales). Load this one with "
        "transformers, run one forward (which decompresses it), remove compressed-tensors' offloading "
        "(compressed_tensors.offload.remove_dispatch(model, onload_tensors=True)) and pass it to "
        "hf_prefetch.dispatch_model, which streams the dense weights."
    )


def _check_bitsandbytes(where: str, quantization: Any) -> None:
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    if settings.get("llm_int8_has_fp16_weight"):
        raise ValueError(
            f"{where}.llm_int8_has_fp16_weight = True: the checkpoint keeps 16-bit weights that bitsandbytes "
            "quantizes at every forward (training), which hf_prefetch does not stream. Set it to false for an 8-bit "
            "checkpoint, or load the model with transformers and train it resident."
        )


_EMPTY_WEIGHTS = threading.Lock()


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """accelerate's `init_empty_weights(include_buffers=False)` (parameters on the meta device, buffers real), one
    thread at a time: it patches `nn.Module.register_parameter` for the whole process and puts back what it found on
    exit, so two at once in two threads (two loads) can leave the patch in place for every later module."""
    from accelerate import init_empty_weights

    with _EMPTY_WEIGHTS, init_empty_weights(include_buffers=False):
        yield


def _build_empty(model_class: type, config: Any, dtype: torch.dtype) -> nn.Module:
    # Parameters on the meta device, buffers real: non-persistent buffers (rotary tables, ...) are computed by the
    # modules' own __init__, under the same default dtype as transformers' from_pretrained uses.
    with empty_weights():
        if not hasattr(model_class, "from_config"):
            return model_class._from_config(config, dtype=dtype)
        try:  # an Auto class
            return model_class.from_config(config, dtype=dtype)
        except ValueError as err:
            if "Unrecognized configuration class" not in str(err):
                raise
            raise ValueError(_auto_class_hint(model_class, config)) from None


def _auto_class_hint(model_class: type, config: Any) -> str:
    # transformers' own message lists every model type the Auto class knows (thousands of characters): name the
    # Auto classes that do know this config instead.
    import transformers

    fitting = [
        name
        for name in ("AutoModelForSeq2SeqLM", "AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel")
        if type(config) in getattr(transformers, name)._model_mapping
    ]
    architectures = getattr(config, "architectures", None) or []
    hint = f"pass model_class=transformers.{fitting[0]}" if fitting else "pass its model class as model_class="
    if architectures:
        hint += f" (its config.json names {architectures})"
    return (
        f"{model_class.__name__} cannot build a {type(config).__name__} (model_type={config.model_type!r}): {hint}, "
        f"e.g. hf_prefetch.from_pretrained(path, model_class=transformers.{fitting[0] if fitting else 'AutoModel'})."
    )


def _auto_dtype(dtype: Any, config: Any, checkpoint: Checkpoint) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            floating = [
                e.dtype for e in checkpoint.entries.values() if e.dtype.is_floating_point and e.dtype not in FLOAT8
            ]
            dtype = floating[0] if floating else torch.get_default_dtype()
    given = dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in FLOAT8:
        raise ValueError(
            f"dtype={given!r} must be a floating-point torch.dtype to compute in, such as torch.bfloat16 (or its "
            "name, 'bfloat16'), 'auto' or None."
        )
    return dtype


def set_dtypes(model: nn.Module, dtype: torch.dtype | None, cast: bool, journal: Journal) -> None:
    # transformers keeps some modules in float32 (`_keep_in_fp32_modules`) whatever the requested dtype.
    from transformers.core_model_loading import build_glob_alternation

    dtype_plan = model._get_dtype_plan(dtype) if dtype is not None and hasattr(model, "_get_dtype_plan") else {}
    if dtype_plan:
        alternation, glob_of_group, _ = build_glob_alternation(list(dtype_plan))
    packed = _packed_parameters(model)
    for name, param in model.named_parameters():
        castable = cast and dtype is not None and param.is_floating_point() and name not in packed
        target = dtype if castable else param.dtype
        if dtype_plan and (match := alternation.search(name)):
            target = dtype_plan[glob_of_group[match.lastgroup]]
        if target != param.dtype:
            journal.point(Phase.PLACE, param, param.data.to(target), f"{name} as {target}")


def _packed_parameters(model: nn.Module) -> set[str]:
    # Quantized storage keeps its dtype under a requested one: float8 weights, and the other parameters of their
    # modules (transformers' FP8Linear keeps its `weight_scale_inv` in float32), as transformers' quantizers do.
    names = set()
    for path, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if any(param.dtype in FLOAT8 for _, param in own):
            names.update(f"{path}.{name}" if path else name for name, _ in own)
    return names
