"""Routing under a test's control, for any mixture-of-experts family with transformers' experts modules.

`control_routing(model, regimes)` puts a forward pre-hook on every experts module (the one that takes the router's
choice, `top_k_index`) that replaces the choice by one of a regime:
- "random": every token picks experts independently of the last (as a router whose picks vary),
- "sticky": every token picks the same experts,
- "skewed": picks drawn without replacement from a Zipf-like popularity (a few hot experts, a long tail),
- "drifting": the experts of "sticky" for a while, moving to others as the hidden states change (consecutive tokens
  share most, not all, of their picks).
The choice is a deterministic function of the module's hidden states and a seed, with no state: the reference model
and a dispatched one, which compute the same hidden states, pick the same experts, and a CUDA graph replays it. A list
of regimes gives the experts modules, in order, their own (cycled): layers that differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["REGIMES", "RoutingControl", "control_routing", "experts_modules_of"]

REGIMES = ("random", "sticky", "skewed", "drifting")
_INDEX_ARGS = ("top_k_index", "router_indices", "topk_indices", "selected_experts", "routing_indices")


def experts_modules_of(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that take the router's choice as their second argument (transformers' experts)."""
    return [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(getattr(module, "num_experts", None), int)
    ]


class _Regime:
    """One experts module's picks: every regime's scores from the same hash of the hidden states, the regime chosen by
    a tensor on the device (`code`), so that `RoutingControl.set` changes it without recompiling or re-recording."""

    def __init__(self, num_experts: int, hidden: int, seed: int, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(seed)
        projection = torch.randn(hidden, num_experts, generator=generator)
        base = torch.rand(num_experts, generator=generator)  # sticky: the same scores every token
        popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32) ** 1.2
        log_popularity = popularity.log()[torch.randperm(num_experts, generator=generator)]
        self.projection, self.base, self.log_popularity = (t.to(device) for t in (projection, base, log_popularity))
        self.code = torch.zeros((), dtype=torch.long, device=device)

    def choose(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        tokens = hidden.reshape(-1, hidden.shape[-1]).float()
        # A hash of the hidden states: uniform in (0, 1), unrelated between tokens whose states differ.
        uniform = torch.frac(torch.sin(tokens @ self.projection) * 43758.5453).abs().clamp(1e-6, 1 - 1e-6)
        sticky = self.base.expand_as(uniform)
        skewed = self.log_popularity - torch.log(-torch.log(uniform))  # Gumbel top-k: draws without replacement
        drifting = self.base + 0.35 * uniform  # the sticky experts, now and then one outbid by a token's noise
        scores = torch.stack([uniform, sticky, skewed, drifting]).index_select(0, self.code.reshape(1))[0]
        picks = scores.topk(index.shape[-1], dim=-1).indices
        return picks.reshape(index.shape).to(index.dtype)


class RoutingControl:
    """The hooks of `control_routing`: `set(regimes)` changes the regimes in place (on the device: compiled code and
    CUDA graphs follow), `remove()` restores the model's own routing."""

    def __init__(self, regimes: list[_Regime], handles: list) -> None:
        self.regimes, self.handles = regimes, handles

    def set(self, regimes: str | Sequence[str]) -> None:
        names = [regimes] if isinstance(regimes, str) else list(regimes)
        for name in names:
            if name not in REGIMES:
                raise ValueError(f"regime={name!r}: one of {REGIMES}")
        for number, regime in enumerate(self.regimes):
            regime.code.fill_(REGIMES.index(names[number % len(names)]))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def control_routing(
    model: nn.Module, regimes: str | Sequence[str], seed: int = 0, device: torch.device | str | None = None
) -> RoutingControl:
    """Hook every experts module of `model` to pick by `regimes` (one for all, or one per module, cycled). `device`:
    where the model computes (default: where its first parameter is)."""
    modules = experts_modules_of(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module to control")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    hidden = model.config.hidden_size
    chosen, handles = [], []
    for number, module in enumerate(modules):
        regime = _Regime(module.num_experts, hidden, seed * 1000 + number, device)

        def replace(module, args, kwargs, regime=regime):
            if len(args) >= 2:
                return (args[0], regime.choose(args[0], args[1]), *args[2:]), kwargs
            name = next(name for name in _INDEX_ARGS if name in kwargs)
            hidden_states = args[0] if args else kwargs["hidden_states"]
            return args, {**kwargs, name: regime.choose(hidden_states, kwargs[name])}

        chosen.append(regime)
        handles.append(module.register_forward_pre_hook(replace, with_kwargs=True))
    control = RoutingControl(chosen, handles)
    control.set(regimes)
    return control
