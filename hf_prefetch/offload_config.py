"""`OffloadConfig`: which offload backend runs, prefetch or UVA, and each backend's knobs; frozen and validated.

`resolve_offload` turns what `dispatch_model(offload=..., config=..., **fields)` was given into the one backend
config that runs. This module knows the knobs, their rules and their hash; it knows nothing about models or devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from .config import PrefetchConfig, _validate_segments, config_hash, warn_at_caller

__all__ = ["OffloadConfig", "UVAConfig", "resolve_offload"]

Backend = Literal["auto", "uva", "prefetch"]
BACKENDS = ("auto", "uva", "prefetch")

_warned: set[str] = set()


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
        segments = _validate_segments(self.cpu_offload_params, "UVAConfig.cpu_offload_params")
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
    >>> from hf_prefetch.offload_config import resolve_offload
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
