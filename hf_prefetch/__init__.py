"""hf_prefetch: run Hugging Face models larger than the GPU at close to the speed of the host-to-GPU link.

One verb per step, each configured by one config object per backend (`PrefetchConfig`, `UVAConfig`, or the
`OffloadConfig` that picks one): `plan` shows what a dispatch would do, `dispatch_model` / `from_pretrained` /
`load_checkpoint_and_dispatch` do it (`time_layers` measures what a budget plan can weigh), `remove_offload` undoes it;
`stats`, `reload_weights`, `sync_from_device` and `weights_in_place` work on a dispatched model. Importing this
package initialises neither CUDA nor `torch._dynamo`.
"""

from .config import OffloadConfig, PrefetchConfig, UVAConfig
from .dispatch import dispatch_model, remove_offload
from .layer_times import time_layers
from .lifecycle.in_place import weights_in_place
from .lifecycle.state import get_state
from .loading.loader import from_pretrained, load_checkpoint_and_dispatch
from .loading.reload import reload_weights, sync_from_device
from .planning.layers import find_layer_lists
from .planning.offload_plan import OffloadPlan
from .planning.placements import Compute, Placement, Source, Storage
from .preview import plan
from .stats import TransferStats, reset_stats, stats

__all__ = [
    "PrefetchConfig",
    "UVAConfig",
    "OffloadConfig",
    "plan",
    "OffloadPlan",
    "Placement",
    "Source",
    "Storage",
    "Compute",
    "dispatch_model",
    "from_pretrained",
    "load_checkpoint_and_dispatch",
    "remove_offload",
    "get_state",
    "reload_weights",
    "sync_from_device",
    "weights_in_place",
    "stats",
    "reset_stats",
    "TransferStats",
    "find_layer_lists",
    "time_layers",
]

__version__ = "0.3.0"
