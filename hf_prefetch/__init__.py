"""hf_prefetch: run Hugging Face models larger than the GPU at close to the speed of the host-to-GPU link.

Importing this package initialises neither CUDA nor `torch._dynamo`.
"""

from .config import PrefetchConfig
from .dispatch import dispatch_model, get_state, remove_offload
from .loader import from_pretrained, load_checkpoint_and_dispatch
from .offload_config import OffloadConfig, UVAConfig
from .plan import OffloadPlan, find_layer_lists, make_plan
from .preview import plan  # after .plan: the name `hf_prefetch.plan` is this function
from .reload import reload_weights, sync_from_device
from .stats import TransferStats, reset_stats, stats

__all__ = [
    "PrefetchConfig",
    "UVAConfig",
    "OffloadConfig",
    "OffloadPlan",
    "from_pretrained",
    "load_checkpoint_and_dispatch",
    "dispatch_model",
    "remove_offload",
    "reload_weights",
    "sync_from_device",
    "get_state",
    "plan",
    "make_plan",
    "find_layer_lists",
    "stats",
    "reset_stats",
    "TransferStats",
]

__version__ = "0.1.0"
