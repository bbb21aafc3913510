"""Frozen, validated configuration: `PrefetchConfig` (the prefetch backend's knobs), `UVAConfig` (the zero-copy
backend's), `OffloadConfig` (which of the two runs), and `resolve_offload`, which turns what a verb was given into the
one backend config that runs; also `config_hash` and `warn_at_caller`.

This module knows the knobs, their rules and their hash; it knows nothing about models, devices or streams.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

__all__ = ["PrefetchConfig", "UVAConfig", "OffloadConfig", "resolve_offload", "config_hash", "warn_at_caller"]

_warned_prefetch_step: set[tuple[int, int]] = set()


@dataclass(frozen=True)
class PrefetchConfig:
    """Which layers stream from pinned host memory, and how far ahead their copies start.

    Layers are grouped `group_size` at a time; the last `num_in_group` layers of every group are offloaded:
    layer `i` (0-based) streams when `i % group_size >= group_size - num_in_group`. `group_size=8, num_in_group=2`
    streams layers 6, 7, 14, 15, ...

    Args:
        group_size (`int`, defaults to 2): Size of a layer group.
        num_in_group (`int`, defaults to 1): How many layers at the end of each group are offloaded.
        prefetch_step (`int`, defaults to 2): How many offloaded layers ahead a copy is started, and therefore
            how many copies of each offloaded parameter the GPU buffer pool holds.
        offload_params (`Iterable[str]`, defaults to all): Parameter-name segments to offload inside the selected
            layers. A segment matches whole dotted parts: `"experts"` matches `mlp.experts.w2_weight`, `"expert"`
            and `"w2"` do not, and `"w2_weight"` does not match `w2_weight_scale`. Empty offloads every parameter
            of a selected layer.
        routed_experts (`bool`, *optional*): Stream the expert tensors of a mixture-of-experts layer expert by
            expert: a forward with few tokens copies only the experts its router picks (Placement.ROUTED), one with
            many copies whole tensors. None (the default): wherever the experts module is recognised; one that is
            not is streamed whole, with a warning naming it. True: an experts module that is not recognised is an
            error. False: expert tensors stream whole in every forward.
        routed_max_tokens (`int`, *optional*): The most tokens a forward may have for its routed experts to be
            copied expert by expert. Defaults to each experts module's break-even point, `0.75 * num_experts /
            top_k` tokens rounded down (at least 1; 12 for 128 experts with 8 per token): see docs/design.md
            ("Routed experts").
        expert_cache (`int`, *optional*): How many experts of each streamed layer's routed tensors stay on the device
            in an expert cache (see docs/design.md, "The expert cache"). None (the default): with a `max_memory`
            budget, as many as the memory the chosen plan leaves spare holds, else none. 0: no cache. The cache is
            looked up on the device (no host synchronisation), inside CUDA graphs too.
        recent_experts (`bool`, *optional*): With routed experts, a layer's copy that brings everything but its
            expert tensors can also bring the rows of the experts its router picked in the layer's previous forward,
            on the copy stream, before its router runs; the copy at the router then brings only the picks that are
            neither there nor in the expert cache (see docs/design.md, "Recent experts"). Where a layer's picks repeat
            from token to token this takes their copies off the router's path; where they vary, the rows not picked
            again cross the link for nothing. None (the default): measured per layer while decoding, and fetched only
            where the rows it would waste stay under 4-5% of what the router alone copies (the decision follows the
            routing: a new prompt, sampling; `stats()` shows it per layer). On the CPU, where copies do not overlap
            compute, a fetch ahead saves no time; the policy runs the same there. True: always fetched. False: never;
            only the router's own picks are copied, once it has made them.
        cpu_experts (`bool` or `"auto"`, defaults to False): Where the routed experts of streamed layers are
            computed. False: on the device, their picked rows copied over the link. True: on the host's cores, by
            the experts module's own forward on its host storage, in every forward: their bytes never cross the link;
            only the hidden states of the tokens and the results do. `"auto"`: in forwards that route (few tokens),
            the host computes as many of the picked experts as finish soonest beside the link's copies of the others,
            from the host's times measured at planning (none where the link alone is sooner); forwards of many
            tokens copy as with False. On a CPU device both compute on the host, as False does. See docs/design.md
            ("Experts on the host").
        compress (`bool`, defaults to False): Keep the streamed bf16 and fp32 weights of layers that take turns in a
            slot losslessly compressed in host memory (about 75% of bf16's bytes, 88% of fp32's), copy the compressed
            bytes and decode them on the device into the slot, bit for bit (see docs/design.md, "Compressed
            streaming"). Encoding runs once, on the host, at dispatch or load time.
        compute_seconds (`Mapping[str, float]`, *optional*): How long each layer of the layer lists computes in the
            forward to plan for (layer path, e.g. `"transformer_blocks.3"`, to seconds; `time_layers` measures them).
            With a `max_memory` budget on a GPU, the planner then picks, of the plans that fit, the one whose
            forwards take the least time when copies and compute overlap (a simulation of the ring's schedule at
            the measured link speed; fewest bytes among equals) instead of the one that streams the fewest bytes:
            where a forward computes about as long as it copies (diffusion transformers at thousands of tokens),
            streamed layers are then spread over the parts of the forward whose compute can hide their copies.
            Every layer of every layer list needs a time. None (the default): the fewest bytes per forward, which
            is the fastest plan where copies take longer than compute (decoding) and on the CPU (where copies do
            not overlap compute, so `compute_seconds` changes nothing there).

    Example:

    ```python
    >>> from hf_prefetch import PrefetchConfig
    >>> PrefetchConfig(group_size=8, num_in_group=2, prefetch_step=2).num_in_group
    2
    >>> PrefetchConfig(offload_params=["experts"]).offload_params
    frozenset({'experts'})

    ```
    """

    group_size: int = 2
    num_in_group: int = 1
    prefetch_step: int = 2
    offload_params: frozenset[str] = field(default_factory=frozenset)
    routed_experts: bool | None = None
    routed_max_tokens: int | None = None
    expert_cache: int | None = None
    recent_experts: bool | None = None
    cpu_experts: bool | Literal["auto"] = False
    compress: bool = False
    compute_seconds: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("group_size", "num_in_group", "prefetch_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"PrefetchConfig.{name}={value!r} must be an int.")
        if self.group_size < 1:
            raise ValueError(
                f"PrefetchConfig.group_size={self.group_size} must be >= 1: layers are taken in groups of "
                "`group_size` and the last `num_in_group` of each group are offloaded."
            )
        if not 1 <= self.num_in_group <= self.group_size:
            raise ValueError(
                f"PrefetchConfig.num_in_group={self.num_in_group} must be between 1 and group_size="
                f"{self.group_size}: it counts the offloaded layers at the end of each group."
            )
        if self.prefetch_step < 1:
            raise ValueError(
                f"PrefetchConfig.prefetch_step={self.prefetch_step} must be >= 1: a layer's copy has to start "
                "at least one offloaded layer ahead (it is also the number of buffer slots)."
            )
        object.__setattr__(self, "offload_params", validate_segments(self.offload_params))
        if not isinstance(self.cpu_experts, bool) and self.cpu_experts != "auto":
            raise ValueError(
                f"PrefetchConfig.cpu_experts={self.cpu_experts!r} must be False (experts computed on the device), "
                'True (on the host\'s cores) or "auto" (split between them by measured speed).'
            )
        if not isinstance(self.compress, bool):
            raise ValueError(f"PrefetchConfig.compress={self.compress!r} must be True or False.")
        if self.routed_experts is not None and not isinstance(self.routed_experts, bool):
            raise ValueError(f"PrefetchConfig.routed_experts={self.routed_experts!r} must be None, True or False.")
        if self.recent_experts is not None and not isinstance(self.recent_experts, bool):
            raise ValueError(
                f"PrefetchConfig.recent_experts={self.recent_experts!r} must be None (measured per layer), True or "
                "False."
            )
        cache = self.expert_cache
        if cache is not None and (isinstance(cache, bool) or not isinstance(cache, int) or cache < 0):
            raise ValueError(
                f"PrefetchConfig.expert_cache={cache!r} must be None (what a max_memory budget leaves spare) or an "
                "int >= 0 (experts per routed layer kept on the device; 0: no cache)."
            )
        limit = self.routed_max_tokens
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(
                f"PrefetchConfig.routed_max_tokens={limit!r} must be None (each experts module's break-even point) "
                "or an int >= 0 (0 copies whole expert tensors in every forward)."
            )
        if self.compute_seconds is not None:
            object.__setattr__(self, "compute_seconds", _validate_seconds(self.compute_seconds))
        key = (self.prefetch_step, self.num_in_group)
        if self.prefetch_step < self.num_in_group and key not in _warned_prefetch_step:
            _warned_prefetch_step.add(key)
            warn_at_caller(
                f"PrefetchConfig(prefetch_step={self.prefetch_step}, num_in_group={self.num_in_group}): "
                "the offloaded layers of a group are consecutive, so a copy started fewer than `num_in_group` "
                "layers ahead has no compute to hide behind. Use prefetch_step >= num_in_group."
            )

    def compute_hash(self) -> str:
        """A sha256 hex digest of the fields: equal configs give equal digests in every process."""
        return config_hash(self)


def _validate_seconds(seconds: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    # A mapping of layer path -> seconds, kept as sorted pairs: hashable, and equal for equal mappings. The pairs
    # themselves are accepted too (`dataclasses.replace` validates a config's fields again).
    if isinstance(seconds, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in seconds):
        seconds = dict(seconds)
    if not isinstance(seconds, Mapping):
        raise ValueError(
            f"PrefetchConfig.compute_seconds={seconds!r} must be a mapping of layer path to seconds, e.g. "
            "compute_seconds=hf_prefetch.time_layers(model, **inputs), or None."
        )
    pairs = []
    for path, value in seconds.items():
        if not isinstance(path, str):
            raise ValueError(
                f"PrefetchConfig.compute_seconds has the key {path!r}: keys are layer paths such as 'model.layers.3'."
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"PrefetchConfig.compute_seconds[{path!r}]={value!r} must be a finite number of seconds >= 0."
            )
        pairs.append((path, float(value)))
    return tuple(sorted(pairs))


def validate_segments(segments: Iterable[str], name: str = "PrefetchConfig.offload_params") -> frozenset[str]:
    field_name = name.split(".")[-1]
    if segments is None or not isinstance(segments, Iterable):
        raise ValueError(
            f"{name}={segments!r} must be a set of parameter-name segments, e.g. {field_name}={{'mlp'}}; pass an "
            f"empty set (the default) for every parameter of a selected layer."
        )
    if isinstance(segments, str):
        raise ValueError(
            f"{name}={segments!r} is a string; pass a set of segments, e.g. {name.split('.')[-1]}={{{segments!r}}}."
        )
    result = frozenset(segments)
    for segment in result:
        if not isinstance(segment, str) or not segment or segment.startswith(".") or segment.endswith("."):
            raise ValueError(
                f"{name} contains {segment!r}; each segment must be a non-empty string of "
                "whole dotted name parts such as 'experts' or 'mlp.down_proj'."
            )
    return result


def config_hash(config: Any) -> str:
    """A sha256 hex digest of a config's canonical form: every field, nested configs included, sets sorted, floats
    exact with -0.0 as 0.0. Equal configs give equal digests in every process; changing any field changes it."""
    canonical = json.dumps(_factors(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _factors(value: Any) -> Any:
    # A JSON-able form that depends only on the values: no id(), no set order, no hash seed.
    if is_dataclass(value):
        return {"class": type(value).__name__, **{f.name: _factors(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, set | frozenset):
        return sorted(_factors(item) for item in value)
    if isinstance(value, tuple):
        return [_factors(item) for item in value]
    if isinstance(value, float):
        return repr(value + 0.0)  # round-trips exactly; 'inf'; -0.0 + 0.0 is 0.0, equal values have one form
    if value is None or isinstance(value, bool | int | str):
        return value
    raise TypeError(f"compute_hash cannot represent {type(value).__name__} {value!r}; add it to _factors.")


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type[Warning] = UserWarning, past_torch: bool = False) -> None:
    """Warn with the location of the first caller outside hf_prefetch (and outside generated dataclass code; with
    `past_torch`, outside torch too: a warning from inside a model's call)."""
    torch_dir = None
    if past_torch:
        import torch  # already imported by the caller; config.py itself needs no torch

        torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    level, frame = 1, sys._getframe(1)
    while frame is not None and (
        os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep)
        or frame.f_code.co_filename == "<string>"
        or (torch_dir is not None and os.path.abspath(frame.f_code.co_filename).startswith(torch_dir))
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warn_at_caller(message)


@dataclass(frozen=True)
class UVAConfig:
    """Which parameters stay in pinned host memory, read by the GPU over the bus with no copy (UVA zero-copy).

    Parameters of the layer lists are taken in layer order (layer 0's first, in `named_parameters` order) until
    `cpu_offload_gb` GiB are taken: the last one taken may cross the limit. Embeddings, the final norm and the head
    stay on the device.

    Args:
        cpu_offload_gb (`float`, defaults to 0): GiB (2**30 bytes) of parameters to keep in host memory. 0 keeps
            none; `float("inf")` keeps every parameter `cpu_offload_params` matches.
        cpu_offload_params (`Iterable[str]`, defaults to all): Parameter-name segments that may be taken, matched
            on whole dotted parts like `PrefetchConfig.offload_params`: `"mlp"` matches `mlp.down_proj.weight`,
            `"proj"` does not. Empty: any parameter of a layer.

    Example:

    ```python
    >>> from hf_prefetch import UVAConfig
    >>> UVAConfig(cpu_offload_gb=8, cpu_offload_params=["mlp"])
    UVAConfig(cpu_offload_gb=8.0, cpu_offload_params=frozenset({'mlp'}))

    ```
    """

    cpu_offload_gb: float = 0.0
    cpu_offload_params: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        gb = self.cpu_offload_gb
        problem = isinstance(gb, bool) or not isinstance(gb, int | float)
        if not problem:
            try:
                gb = float(gb) + 0.0  # 8 and 8.0, 0.0 and -0.0 are one config, with one hash
            except OverflowError:
                gb = math.inf  # an int too large for a float: more than any model
            problem = math.isnan(gb) or gb < 0
        if problem:
            raise ValueError(
                f"UVAConfig.cpu_offload_gb={self.cpu_offload_gb!r} must be a number of GiB >= 0, e.g. "
                "cpu_offload_gb=8 (float('inf') keeps every matching parameter in host memory)."
            )
        object.__setattr__(self, "cpu_offload_gb", gb)
        segments = validate_segments(self.cpu_offload_params, "UVAConfig.cpu_offload_params")
        object.__setattr__(self, "cpu_offload_params", segments)

    def compute_hash(self) -> str:
        """A sha256 hex digest of the fields: equal configs give equal digests in every process."""
        return config_hash(self)


@dataclass(frozen=True)
class OffloadConfig:
    """The offload backend and each backend's configuration.

    `PrefetchConfig` has no disabled state (`group_size >= 1`), so prefetch is *set* when `prefetch` is not None:
    that is what selects it, as `offload_group_size > 0` does in vLLM's config. UVA is *set* when
    `uva.cpu_offload_gb > 0`.

    Args:
        backend (`str`, defaults to `"auto"`): `"prefetch"` streams whole layers into a GPU buffer pool ahead of use;
            `"uva"` keeps parameters in pinned host memory and lets the kernels read them over the bus;
            `"auto"` picks prefetch when `prefetch` is set, else UVA when `uva.cpu_offload_gb > 0`, else nothing.
        uva (`UVAConfig`): The UVA backend's fields.
        prefetch (`PrefetchConfig`, *optional*): The prefetch backend's fields; `backend="prefetch"` without it
            means `PrefetchConfig()`.

    Errors for combinations that cannot run: `backend="uva"` with `cpu_offload_gb=0`, and `cpu_offload_params`
    without `cpu_offload_gb` where UVA is the only backend set. One warning (once per message) when the backend not
    chosen has non-default fields, which are then ignored.

    Example:

    ```python
    >>> from hf_prefetch import OffloadConfig, PrefetchConfig, UVAConfig
    >>> OffloadConfig(uva=UVAConfig(cpu_offload_gb=4)).selected
    'uva'
    >>> OffloadConfig(prefetch=PrefetchConfig(group_size=4)).selected
    'prefetch'
    >>> print(OffloadConfig().selected)
    None
    >>> OffloadConfig(uva=UVAConfig(cpu_offload_gb=4)).compute_hash() == OffloadConfig(
    ...     uva=UVAConfig(cpu_offload_gb=4.0)).compute_hash()
    True

    ```
    """

    backend: Backend = "auto"
    uva: UVAConfig = field(default_factory=UVAConfig)
    prefetch: PrefetchConfig | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"OffloadConfig.backend={self.backend!r} must be one of {list(BACKENDS)}.")
        if not isinstance(self.uva, UVAConfig):
            raise ValueError(
                f"OffloadConfig.uva={self.uva!r} must be a hf_prefetch.UVAConfig, e.g. "
                "uva=UVAConfig(cpu_offload_gb=8)."
            )
        if self.prefetch is not None and not isinstance(self.prefetch, PrefetchConfig):
            raise ValueError(
                f"OffloadConfig.prefetch={self.prefetch!r} must be a hf_prefetch.PrefetchConfig or None, e.g. "
                "prefetch=PrefetchConfig(group_size=2, num_in_group=1)."
            )
        if self.backend == "prefetch" and self.prefetch is None:
            object.__setattr__(self, "prefetch", PrefetchConfig())  # as offload="prefetch" means the default config
        uva_set = self.uva.cpu_offload_gb > 0
        uva_changed = self.uva != UVAConfig()
        if self.backend == "uva" and not uva_set:
            raise ValueError(
                "OffloadConfig(backend='uva') needs uva.cpu_offload_gb > 0: it is how many GiB of parameters stay in "
                "host memory. Pass uva=UVAConfig(cpu_offload_gb=8), for example."
            )
        if self.backend == "auto" and self.prefetch is None and uva_changed and not uva_set:
            raise ValueError(
                f"OffloadConfig.uva.cpu_offload_params={set(self.uva.cpu_offload_params)} chooses which parameters "
                "UVA may take, but cpu_offload_gb=0 takes none. Pass uva=UVAConfig(cpu_offload_gb=..., "
                "cpu_offload_params=...)."
            )
        if self.backend == "uva" and self.prefetch is not None:
            _warn_once(
                f"OffloadConfig(backend='uva') ignores prefetch={self.prefetch}. Drop it, or use backend='prefetch'."
            )
        elif self.backend == "prefetch" and uva_changed:
            _warn_once(f"OffloadConfig(backend='prefetch') ignores uva={self.uva}. Drop it, or use backend='uva'.")
        elif self.backend == "auto" and self.prefetch is not None and uva_changed:
            _warn_once(
                f"OffloadConfig(backend='auto') has both prefetch and uva={self.uva} set: it selects prefetch and "
                "ignores uva. Pass backend='prefetch' or backend='uva' to say which."
            )

    @property
    def selected(self) -> Literal["uva", "prefetch"] | None:
        """The backend that runs: `backend`, or for `"auto"` prefetch when it is set, else UVA when set, else None."""
        if self.backend != "auto":
            return self.backend
        if self.prefetch is not None:
            return "prefetch"
        return "uva" if self.uva.cpu_offload_gb > 0 else None

    def compute_hash(self) -> str:
        """A sha256 hex digest of every field, nested configs included (sets sorted, floats exact).

        The same config gives the same digest in every process; changing any field changes it. Compile caches key on
        it: the backend and its fields decide which parameters live where and which layers are hooked.
        """
        return config_hash(self)


def resolve_offload(offload: Any) -> PrefetchConfig | UVAConfig:
    """The backend config that runs, from a verb's `offload` argument: a config, or the name of a backend's default.

    Example:

    ```python
    >>> from hf_prefetch import OffloadConfig, UVAConfig
    >>> from hf_prefetch.config import resolve_offload
    >>> resolve_offload("prefetch").group_size
    2
    >>> resolve_offload(OffloadConfig(uva=UVAConfig(cpu_offload_gb=2)))
    UVAConfig(cpu_offload_gb=2.0, cpu_offload_params=frozenset())

    ```
    """
    if isinstance(offload, OffloadConfig):
        resolved = _selected(offload)
    elif isinstance(offload, PrefetchConfig | UVAConfig):
        resolved = offload
    elif offload == "prefetch":
        resolved = PrefetchConfig()
    elif offload == "uva":
        resolved = UVAConfig()
    else:
        raise ValueError(
            f"offload={offload!r} is not supported; use 'prefetch' (the default PrefetchConfig), a PrefetchConfig, "
            "a UVAConfig(cpu_offload_gb=...) or an OffloadConfig."
        )
    if isinstance(resolved, UVAConfig) and resolved.cpu_offload_gb == 0:
        raise ValueError(
            "The UVA backend with cpu_offload_gb=0 keeps nothing in host memory. Pass "
            "offload=UVAConfig(cpu_offload_gb=<GiB>), e.g. UVAConfig(cpu_offload_gb=8) (parameters are taken in "
            "layer order until that many GiB are taken)."
        )
    return resolved


def _selected(offload: OffloadConfig) -> PrefetchConfig | UVAConfig:
    if offload.selected is None:
        raise ValueError(
            "OffloadConfig() selects no backend: set prefetch=PrefetchConfig(...) or "
            "uva=UVAConfig(cpu_offload_gb=...), or pass backend='prefetch' for the default prefetch config."
        )
    return offload.prefetch if offload.selected == "prefetch" else offload.uva


Backend = Literal["auto", "uva", "prefetch"]


BACKENDS = ("auto", "uva", "prefetch")


_warned: set[str] = set()
