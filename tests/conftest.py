from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.models import llama_and_logits


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_reference():
    """A tiny 8-layer Llama, never dispatched and never changed (copy it before changing it), with its prompt, its
    logits and a copy of its state dict: `.model`, `.ids`, `.logits`, `.state`."""
    model, ids, logits = llama_and_logits(8)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return SimpleNamespace(model=model, ids=ids, logits=logits, state=state)
