"""A parameter kept in host storage (`OffloadedParam`: the model's parameter and the host tensor that holds its value)
and its value read and written through that storage, decoded or encoded where it is compressed (formats/lossless.py).
It knows nothing about plans, streams or hooks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..formats import lossless
from ..formats.lossless import Layout

__all__ = ["OffloadedParam", "host_value", "encode_for", "write_encoded", "unencodable_error"]


@dataclass
class OffloadedParam:
    """A parameter kept in host memory: the `nn.Parameter` and the host tensor that holds its value (with `layout`, its
    encoded bytes: see lifecycle/compressed_storage.py). For a tensor-subclass parameter (torchao's quantized tensors)
    there is one per inner tensor: `inner` names the attribute of `param` that holds it (`full_name` ends in
    `:inner`)."""

    full_name: str
    param: nn.Parameter
    host: torch.Tensor
    layout: Layout | None = None
    inner: str | None = None

    @property
    def attr(self) -> str:
        """The attribute of `param` through which the model reads this tensor."""
        return self.inner or "data"

    @property
    def param_name(self) -> str:
        """The parameter's name in the model (without the inner tensor's attribute)."""
        return self.full_name.partition(":")[0]


def host_value(offloaded: OffloadedParam) -> torch.Tensor:
    """The value of an offloaded parameter in host memory: its host tensor, or decoded from it (a new tensor)."""
    if offloaded.layout is None:
        return offloaded.host
    value = torch.empty(offloaded.param.shape, dtype=offloaded.layout.dtype)
    return lossless.decode(offloaded.host, offloaded.layout, value)


def encode_for(offloaded: OffloadedParam, value: torch.Tensor) -> torch.Tensor:
    """`value`'s encoded bytes for `offloaded`'s host storage; raises a ValueError naming the parameter when they do
    not fit its layout. Nothing is written."""
    try:
        return lossless.encode(value.detach().to("cpu", offloaded.layout.dtype), offloaded.layout)
    except lossless.TooManyEscapes as error:
        raise ValueError(unencodable_error(offloaded, error.found)) from None


def unencodable_error(offloaded: OffloadedParam, found: int) -> str:
    return (
        f"The new value of {offloaded.full_name} has {found} weights whose exponent is outside its 15 most common "
        f"ones; its compressed host storage holds {offloaded.layout.capacity}. Nothing was written. Dispatch again "
        "(hf_prefetch.remove_offload(model), then dispatch_model) to encode the new values afresh, or dispatch with "
        "PrefetchConfig(compress=False)."
    )


def write_encoded(offloaded: OffloadedParam, encoded: torch.Tensor) -> None:
    offloaded.host.copy_(encoded)


