from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch._inductor.config as inductor_config

from tests.models import llama_and_logits

# Tests compare a dispatched model compiled by inductor with a reference compiled separately, logit for logit.
# Inductor benchmarks candidate kernel configurations on the device and keeps the fastest; two configurations of one
# reduction sum in different orders, so two compiles of the same model can differ in their last bits when the timings
# are noisy (a GPU shared with other test processes). Its deterministic mode picks without timing
# (TORCHINDUCTOR_DETERMINISTIC=0 shows the difference), and each test process keeps its own cache of the choices:
# with one cache shared by the processes, a second compile could take a choice another process had timed since.
inductor_config.deterministic = os.environ.get("TORCHINDUCTOR_DETERMINISTIC", "1") != "0"
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor-{os.environ['PYTEST_XDIST_WORKER']}-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


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
