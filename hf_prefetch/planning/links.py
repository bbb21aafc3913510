"""Several host links planned: `links=` resolved and checked against the machine, and a layer's bytes cut into one
share per link. The copies themselves are runtime/shared_links.py's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..alignment import LINK_SHARE_ALIGN_BYTES, round_up

__all__ = ["STAGES", "Pair", "resolve_links", "split_bytes", "staged_bytes"]

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source) of one copy

# Staging buffers per helper GPU: a helper copies from host memory into one while the peer link empties another.
STAGES = 2



def resolve_links(links: Any, device: torch.device) -> tuple[int, ...]:
    """The CUDA device indices whose host links carry a model's streamed bytes, the execution device's first; () when
    only the execution device's link does. `links` is None, `"all"` (every GPU the execution device can reach over a
    peer link) or a list of GPUs (indices, `"cuda:1"`, devices), which may name the execution device."""
    if links is None:
        return ()
    if device.type != "cuda":
        raise ValueError(
            f"links={links!r} spreads copies over several GPUs' host links, but the model executes on {device}. "
            "Drop links=, or execute on a GPU (device='cuda:0')."
        )
    count = torch.cuda.device_count()
    if isinstance(links, str) and links == "all":
        others = [i for i in range(count) if i != device.index and _peers(i, device.index)]
        return (device.index, *others) if others else ()
    if isinstance(links, str | int | torch.device) or not isinstance(links, Sequence):
        raise ValueError(
            f"links={links!r} must be 'all' or a list of GPUs, e.g. links=[0, 1] or links=['cuda:0', 'cuda:1']."
        )
    indices = [device.index]
    for link in links:
        index = _index_of(link, links)
        if index >= count:
            raise ValueError(
                f"links={links!r} names GPU {index}, but this machine has {count} CUDA device(s) "
                f"(0 to {count - 1}). Name only GPUs that exist."
            )
        if index not in indices:
            indices.append(index)
    for index in indices[1:]:
        for a, b in ((index, device.index), (device.index, index)):
            if not torch.cuda.can_device_access_peer(a, b):
                raise ValueError(
                    f"links={links!r}: GPU {index} has no peer access to the execution device {device} "
                    f"(torch.cuda.can_device_access_peer({a}, {b}) is False), so its share could only reach the "
                    "slots through host memory. Drop it from links=, or check `nvidia-smi topo -m`."
                )
    return tuple(indices) if len(indices) > 1 else ()


def _peers(a: int, b: int) -> bool:
    return torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a)


def _index_of(link: Any, links: Any) -> int:
    if isinstance(link, int) and not isinstance(link, bool) and link >= 0:
        return link
    try:
        resolved = torch.device(link)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type != "cuda" or resolved.index is None:
        raise ValueError(
            f"links={links!r} contains {link!r}; name each GPU by its index or as 'cuda:N', e.g. links=[0, 1]."
        )
    return resolved.index


def split_bytes(pairs: Sequence[Pair], num_links: int) -> list[list[Pair]]:
    """Cut the bytes of `pairs` (each a (destination, source) of the same shape and dtype), taken in order as one
    sequence, into `num_links` consecutive ranges of nearly equal size; return each range's (destination, source)
    pieces, as flat byte views. Cut points fall on multiples of `LINK_SHARE_ALIGN_BYTES` (rounded up: the first ranges
    take what is left over). A pair whose tensors are not both contiguous goes whole to the first range."""
    ranges: list[list[Pair]] = [[] for _ in range(num_links)]
    flat = []
    for dst, src in pairs:
        if dst.is_contiguous() and src.is_contiguous() and dst.nbytes == src.nbytes:
            flat.append((_bytes_of(dst), _bytes_of(src)))
        else:
            ranges[0].append((dst, src))
    total = sum(dst.numel() for dst, _ in flat)
    # Rounded up: what rounding leaves over goes to the earlier links, a layer smaller than LINK_SHARE_ALIGN_BYTES to
    # the first.
    cuts = [min(total, round_up(total * r // num_links, LINK_SHARE_ALIGN_BYTES)) for r in range(num_links)] + [total]
    offset = 0
    for dst, src in flat:
        begin, end = offset, offset + dst.numel()
        for r in range(num_links):
            low, high = max(begin, cuts[r]), min(end, cuts[r + 1])
            if low < high:
                ranges[r].append((dst[low - begin : high - begin], src[low - begin : high - begin]))
        offset = end
    return ranges


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def staged_bytes(pieces: Sequence[Pair]) -> int:
    """Bytes a range of pieces takes in a staging buffer, each piece starting on a multiple of
    `LINK_SHARE_ALIGN_BYTES`."""
    return sum(round_up(dst.numel(), LINK_SHARE_ALIGN_BYTES) for dst, _ in pieces)
