"""The engine's steps for compressed layers: their encoded bytes decoded into the slot on the compute stream when the
layer waits, between forwards on the decode stream, and encoded back when a slot is stored. Part of `PrefetchEngine`
(engine.py); the codec is formats/lossless.py.

[Note: compressed streaming]
A compressed parameter (`ParamSpec.compressed`; see formats/lossless.py) keeps its encoded bytes in host memory. Its
copy is an ordinary copy of those bytes, on the copy stream like every other, into the slot's staging buffer (one per
slot, a pool buffer like the others), and the layer's `wait` decodes them into the slot buffer on the compute stream,
after the compute stream waited on `done` and before the layer's kernels. So:
- The slot buffer is written only on the compute stream, after every kernel of the layer that used the slot before
  (stream order): the same guarantee a copy gets from its fork. Between forwards (below) it is written on the decode
  stream after the layer's copy, whose fork gave that guarantee already.
- The staging buffer is rewritten only by the next copy into the slot, which forks from the compute stream after the
  layer released, so after its decode.
- The link never waits for a decode: copies keep their stream to themselves, and with two or more slots the copy of
  the next layer in a slot is queued behind the other slots' copies long before the link reaches it. Decoding costs
  compute-stream time instead (`decode_seconds`), which batch-1 decode has to spare while it waits on the link.
- `decoded` says whether the slot holds the values of its latest copy: cleared when a copy is issued, set by the
  decode. A miss and `load` decode at once, and `start` and `finish` decode every layer that holds its slot (on
  CUDA on a third stream, the decode stream, behind the layer's copy, recording `done` again after the decode; the
  next copy into the slot waits on that decode as well): between forwards a parameter shows its layer's values once
  its copy is done, as uncompressed. `store` encodes the slot's values back into host storage (`encode_slot`: every
  parameter before the first write) and the staging buffer. In a capture the decode is recorded at every wait,
  whatever `decoded` says, so each replay decodes what the copies before it brought.
Layers that own their slot are copied once and are not compressed; routed and mapped tensors are never compressed.
"""

from __future__ import annotations

import torch

from ..formats.lossless import TooManyEscapes, decode, encode
from ..interrupts import deferred_interrupts
from .ring import CopyEvent, LayerTransfer
from .timing import timing_event

__all__ = ["CompressedDecodes"]

_TOO_MANY_ESCAPES = (
    "The value of {name} in its slot has {found} weights whose exponent is outside its 15 most common ones; its "
    "compressed host storage holds {capacity}. Nothing was written. Dispatch again (hf_prefetch.remove_offload, then "
    "dispatch_model) to encode the values afresh, or dispatch with PrefetchConfig(compress=False)."
)


class CompressedDecodes:
    """`PrefetchEngine`'s steps for compressed layers ([Note: compressed streaming])."""

    def _decode(self, layer: LayerTransfer, capturing: bool) -> None:
        # On the current (compute) stream, ordered after the layer's copy by the caller. In a capture it is recorded
        # whatever `decoded` says: a replay decodes what the copies before it brought into the staging buffer.
        if layer.decoded and not capturing:
            return
        begin = self._timings.begin_blocking() if self.timing and not capturing else None
        for item in layer.decodes:
            decode(item.staged, item.layout, item.out)
        if capturing:
            return
        layer.decoded = True
        layer.counters.decodes += 1
        layer.counters.decoded_bytes += sum(item.layout.raw_bytes for item in layer.decodes)
        layer.counters.compressed_bytes += sum(item.layout.nbytes for item in layer.decodes)
        if begin is not None:
            self._timings.end_span(layer.counters, begin, "decode_seconds")

    def _decode_held(self) -> None:
        # Between forwards a layer that holds its slot shows its values, compressed or not: a parameter read or edited
        # there (sync_from_device writes such edits back) must not be its undecoded slot. On CUDA the decode is queued
        # on the decode stream behind its copy (the host, the compute stream and the other copies go on: the next
        # forward's first layers keep landing while the host prepares it) and `done` is recorded again after it, so
        # whatever waits for the copy (a forward, a miss, `torch.cuda.synchronize()`) also waits for the values, as
        # uncompressed. A replay, which runs no Python, decodes again what its copies brought.
        for transfers in self.rings:
            for position, layer in enumerate(transfers.layers):
                if layer.decoded or not transfers.holds(position):
                    continue
                if not self._cuda:
                    self._decode(layer, capturing=False)
                    continue
                if layer.event is not CopyEvent.ON_STREAM or layer.done is None:
                    continue  # copied inside a graph (whose replay decodes it) or landed for good (never compressed)
                # All or nothing under an interrupt: a layer marked decoded whose `done` did not yet follow the
                # decode would compute while the decode still writes its slot.
                with deferred_interrupts(), torch.cuda.stream(self.decode_stream):
                    self.decode_stream.wait_event(layer.done)  # the copy, through every link
                    decoded = timing_event() if self.timing else torch.cuda.Event()  # a stall is timed against it
                    self._decode(layer, capturing=False)
                    decoded.record(self.decode_stream)
                    layer.done = decoded
                    self._pending_decodes[id(transfers), layer.slot] = decoded

    def encode_slot(self, ring: int, position: int) -> dict[int, torch.Tensor]:
        """The encoded bytes of the compressed parameters of layer `position`'s slot (by id of their staging view),
        for `store`; ValueError, naming the parameter, for values that do not fit their layout. Writes nothing."""
        layer = self._owned_settled(ring, position)
        self._decode(layer, capturing=False)
        encoded = {}
        for item in layer.decodes:
            try:
                encoded[id(item.staged)] = encode(item.out.cpu(), item.layout)
            except TooManyEscapes as error:
                message = _TOO_MANY_ESCAPES.format(name=item.name, found=error.found, capacity=error.capacity)
                raise ValueError(message) from None
        return encoded
