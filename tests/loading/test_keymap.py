"""Checkpoint keys -> model tensors (hf_prefetch/loading/keymap.py) on tiny checkpoints written by `save_pretrained`:
every model tensor is filled once, by the right bytes in the right place, with transformers' renames and expert merges;
tied tensors stored twice are recorded; bad checkpoints are refused with the key and the fix.

Loading end to end is tests/loading/test_loader.py's; here the map itself is checked, byte for byte, against
transformers."""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    LlamaModel,
    MixtralConfig,
    Qwen2MoeConfig,
)
from transformers.core_model_loading import WeightConverter

from hf_prefetch.loading.checkpoint import Checkpoint
from hf_prefetch.loading.keymap import filled_names, map_keys, region_view
from tests.models import ATTENTION

CONFIGS = {
    "llama": lambda: LlamaConfig(intermediate_size=128, num_hidden_layers=2, **ATTENTION),
    "llama-tied": lambda: LlamaConfig(
        intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True, **ATTENTION
    ),
    "gpt2-tied": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2),
    "mixtral": lambda: MixtralConfig(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, **ATTENTION
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, **ATTENTION,
    ),
}  # fmt: skip
# checkpoint name -> (config, how it is saved)
CHECKPOINTS = {
    "llama-sharded": ("llama", "sharded"),
    "gpt2-tied": ("gpt2-tied", "single"),
    "llama-base-model": ("llama-tied", "base"),  # LlamaModel's keys: "layers.0..." without the "model." prefix
    "llama-tied-stored-twice": ("llama-tied", "twice"),  # lm_head.weight stored next to embed_tokens.weight
    "mixtral": ("mixtral", "single"),
    "qwen2_moe-sharded": ("qwen2_moe", "sharded"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folders = {}

    def get(name: str):
        if name not in folders:
            config_name, how = CHECKPOINTS[name]
            config = CONFIGS[config_name]()
            torch.manual_seed(0)
            folder = tmp_path_factory.mktemp(name)
            if how == "base":
                LlamaModel(config).save_pretrained(folder)
            else:
                model = AutoModelForCausalLM.from_config(config)
                model.save_pretrained(folder, **({"max_shard_size": "100KB"} if how == "sharded" else {}))
                assert (folder / "model.safetensors.index.json").is_file() is (how == "sharded")
                if how == "twice":
                    state = {key: value.clone() for key, value in model.state_dict().items()}
                    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
            folders[name] = folder
        return folders[name]

    return get


def empty_model(folder) -> nn.Module:
    """The model as the loader builds it: parameters on the meta device, buffers computed, tied again."""
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.tie_weights()
    return model


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_every_model_tensor_is_filled_once_with_transformers_values(saved, name):
    folder = saved(name)
    model = empty_model(folder)
    with Checkpoint.open(folder) as checkpoint:
        keymap = map_keys(model, checkpoint)
        keys = checkpoint.keys()
    # One canonical name per tensor (a tied tensor is one tensor), and each filled by exactly one source.
    filled = filled_names(keymap)
    assert len(filled) == len(set(filled))
    assert set(filled) == set(keymap.model_tensors)
    assert len({id(t) for t in keymap.model_tensors.values()}) == len(keymap.model_tensors)
    assert keymap.converted == []  # renames and stacked experts stream; nothing goes through transformers here
    used = [entry.key for pieces in keymap.streamed.values() for entry, _ in pieces]
    used += [entry.key for entry, _ in keymap.duplicates]
    assert sorted(used) == sorted(keys)  # every checkpoint tensor is used once

    # Put each checkpoint tensor's bytes where the map says: the result is transformers' own load, bit for bit, and
    # no byte of any model tensor is left out (NaN) or written twice by different pieces.
    source = checkpoint_tensors(folder)
    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for tensor_name, pieces in keymap.streamed.items():
        meta = keymap.model_tensors[tensor_name]
        dest = torch.full(meta.shape, float("nan"), dtype=meta.dtype)
        written = torch.zeros(meta.shape, dtype=torch.int32)
        for entry, region in pieces:
            assert entry.shape == tuple(region_view(dest, region).shape)
            region_view(dest, region).copy_(source[entry.key])
            region_view(written, region).add_(1)
        assert bool((written == 1).all()), tensor_name
        assert torch.equal(dest, expected[tensor_name]), tensor_name


def test_tied_tensors_have_one_name_and_a_second_copy_is_a_recorded_duplicate(saved):
    folder = saved("llama-tied-stored-twice")
    model = empty_model(folder)
    with Checkpoint.open(folder) as checkpoint:
        keymap = map_keys(model, checkpoint)
    assert "lm_head.weight" not in keymap.model_tensors and "model.embed_tokens.weight" in keymap.model_tensors
    [(entry, tensor_name)] = keymap.duplicates
    [(first, region)] = keymap.streamed["model.embed_tokens.weight"]
    assert tensor_name == "model.embed_tokens.weight" and region is None
    assert {entry.key, first.key} == {"lm_head.weight", "model.embed_tokens.weight"}

    folder = saved("gpt2-tied")  # save_pretrained stores the tied tensor once: nothing to record
    with Checkpoint.open(folder) as checkpoint:
        keymap = map_keys(empty_model(folder), checkpoint)
    assert keymap.duplicates == [] and "lm_head.weight" not in keymap.model_tensors
    assert [e.key for e, _ in keymap.streamed["transformer.wte.weight"]] == ["transformer.wte.weight"]


def test_a_base_model_checkpoint_fills_the_prefixed_names(saved):
    folder = saved("llama-base-model")
    with Checkpoint.open(folder) as checkpoint:
        assert not any(key.startswith("model.") for key in checkpoint.keys())
        keymap = map_keys(empty_model(folder), checkpoint)
    for tensor_name, [(entry, region)] in keymap.streamed.items():
        assert tensor_name == f"model.{entry.key}" and region is None
    assert keymap.used_conversions == []


# model tensor -> [(checkpoint key, region)] for layer 1's experts; the conversions transformers reports as used.
MOE = {
    "mixtral": (
        {
            "model.layers.1.mlp.experts.down_proj": [
                (f"model.layers.1.block_sparse_moe.experts.{i}.w2.weight", (i, None, None)) for i in range(4)
            ],
            "model.layers.1.mlp.experts.gate_up_proj": [
                *[(f"model.layers.1.block_sparse_moe.experts.{i}.w1.weight", (i, 0, 96)) for i in range(4)],
                *[(f"model.layers.1.block_sparse_moe.experts.{i}.w3.weight", (i, 96, 96)) for i in range(4)],
            ],
            "model.layers.1.mlp.gate.weight": [("model.layers.1.block_sparse_moe.gate.weight", None)],
        },
        3,  # the rename block_sparse_moe -> mlp, and the two expert merges
    ),
    "qwen2_moe-sharded": (
        {
            "model.layers.1.mlp.experts.down_proj": [
                (f"model.layers.1.mlp.experts.{i}.down_proj.weight", (i, None, None)) for i in range(4)
            ],
            "model.layers.1.mlp.experts.gate_up_proj": [
                *[(f"model.layers.1.mlp.experts.{i}.gate_proj.weight", (i, 0, 32)) for i in range(4)],
                *[(f"model.layers.1.mlp.experts.{i}.up_proj.weight", (i, 32, 32)) for i in range(4)],
            ],
        },
        2,
    ),
}


@pytest.mark.parametrize("name", MOE)
def test_experts_that_transformers_merges_map_to_regions_of_the_merged_tensor(saved, name):
    folder = saved(name)
    with Checkpoint.open(folder) as checkpoint:
        keymap = map_keys(empty_model(folder), checkpoint)
    expected, num_conversions = MOE[name]
    for tensor_name, pieces in expected.items():
        assert [(entry.key, region) for entry, region in keymap.streamed[tensor_name]] == pieces, tensor_name
    assert len(keymap.used_conversions) == num_conversions
    assert sum(isinstance(c, WeightConverter) for c in keymap.used_conversions) == 2


def test_non_moe_checkpoints_use_no_conversion(saved):
    for name in ("llama-sharded", "gpt2-tied"):
        folder = saved(name)
        with Checkpoint.open(folder) as checkpoint:
            assert map_keys(empty_model(folder), checkpoint).used_conversions == []


# --- bad checkpoints -------------------------------------------------------------------------------------------------


class Tiny(nn.Module):
    """Not a transformers model: keys are taken as they are."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.register_buffer("scale", torch.full((width,), 2.0))
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def tiny_checkpoint(tmp_path, edit=None):
    torch.manual_seed(0)
    state = {key: value.clone() for key, value in Tiny().state_dict().items()}
    if edit is not None:
        edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    return Checkpoint.open(tmp_path)


def meta_tiny(**kwargs) -> Tiny:
    with init_empty_weights():  # buffers stay real
        return Tiny(**kwargs)


def test_a_complete_checkpoint_of_a_plain_module(tmp_path):
    keymap = map_keys(meta_tiny(), tiny_checkpoint(tmp_path))
    assert sorted(filled_names(keymap)) == sorted(["layers.0.weight", "layers.0.bias", "layers.1.weight",
                                                    "layers.1.bias", "scale"])  # fmt: skip
    assert keymap.duplicates == [] and keymap.used_conversions == []


def test_keys_transformers_ignores_are_ignored(tmp_path):
    def add(state):
        state["model.rotary_emb.inv_freq"] = torch.ones(2)
        state["embeddings.position_ids"] = torch.arange(4)

    keymap = map_keys(meta_tiny(), tiny_checkpoint(tmp_path, add))
    assert "model.rotary_emb.inv_freq" not in filled_names(keymap) and len(filled_names(keymap)) == 5


def test_a_built_buffer_missing_from_the_checkpoint_keeps_its_value(tmp_path, caplog):
    def drop(state):
        del state["scale"]

    with caplog.at_level(logging.INFO, logger="hf_prefetch.loading.keymap"):
        keymap = map_keys(meta_tiny(), tiny_checkpoint(tmp_path, drop))
    assert "scale" not in filled_names(keymap)
    assert "keeping the values the model computed: ['scale']" in caplog.text


def _pop(key):
    return lambda state: state.pop(key)


BAD = [
    ("unexpected", lambda s: s.update({"layers.2.weight": torch.ones(4, 4)}), {},
     r"model\.safetensors: tensor 'layers\.2\.weight' \(as 'layers\.2\.weight'\) matches no parameter or buffer of "
     r"Tiny \(1 unexpected key\(s\): \['layers\.2\.weight'\]\)"),
    ("missing", _pop("layers.1.weight"), {},
     r"has no tensor for Tiny\.layers\.1\.weight \(1 missing: \['layers\.1\.weight'\]\)"),
    ("missing-two", lambda s: [s.pop("layers.1.weight"), s.pop("layers.0.bias")], {}, r"\(2 missing: "),
    ("shape", None, {"width": 5},
     r"tensor 'layers\.0\.bias' has shape \[4\] but Tiny\.layers\.0\.bias has shape \[5\]\. The checkpoint was "
     r"saved for another configuration"),
]  # fmt: skip


@pytest.mark.parametrize("name, edit, kwargs, match", BAD, ids=[b[0] for b in BAD])
def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path, name, edit, kwargs, match):
    with pytest.raises(ValueError, match=match):
        map_keys(meta_tiny(**kwargs), tiny_checkpoint(tmp_path, edit))


def test_a_built_parameter_missing_from_the_checkpoint_is_refused(tmp_path):
    model = Tiny()  # not on the meta device: its values exist, but a parameter must come from the checkpoint
    with pytest.raises(ValueError, match=r"has no tensor for Tiny\.layers\.1\.bias \(a parameter\)"):
        map_keys(model, tiny_checkpoint(tmp_path, _pop("layers.1.bias")))


def test_a_meta_buffer_that_no_checkpoint_holds_is_refused(tmp_path):
    with init_empty_weights(include_buffers=True):
        model = Tiny()
    with pytest.raises(ValueError, match=r"Buffer table of Tiny is on the meta device and not in the checkpoint"):
        map_keys(model, tiny_checkpoint(tmp_path))


def test_an_expert_given_twice_is_refused(saved, tmp_path):
    folder = saved("mixtral")
    state = checkpoint_tensors(folder)
    merged = torch.stack([state[f"model.layers.0.block_sparse_moe.experts.{i}.w2.weight"] for i in range(4)])
    state["model.layers.0.mlp.experts.down_proj"] = merged  # the merged tensor next to the experts it merges
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"Two checkpoint tensors fill model\.layers\.0\.mlp\.experts\.down_proj"):
        map_keys(empty_model(folder), Checkpoint.open(tmp_path))
