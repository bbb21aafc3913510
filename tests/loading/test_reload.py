"""Weight updates on a dispatched model: reload_weights, load_state_dict write-through, sync_from_device.

Every check compares against a model that was never dispatched, bitwise, and checks that the dispatch kept its
tensors, its host storage and its pool.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MixtralConfig, Qwen2MoeConfig

import hf_prefetch
from hf_prefetch.loading import reader as reader_module
from tests.models import ATTENTION, logits, prompt, tiny_llama

CONFIGS = {
    "llama": lambda: LlamaConfig(intermediate_size=128, num_hidden_layers=4, **ATTENTION),
    "gpt2-tied": lambda: GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2),
    "mixtral": lambda: MixtralConfig(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=4, **ATTENTION
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=4, **ATTENTION,
    ),
}  # fmt: skip
SHARDED = {"llama": True, "gpt2-tied": True, "mixtral": False, "qwen2_moe": True}
PATTERNS = {
    "every-second": dict(group_size=2, num_in_group=1, prefetch_step=1),
    "all-streamed": dict(group_size=1, num_in_group=1, prefetch_step=3),
    "experts-only": dict(group_size=1, num_in_group=1, prefetch_step=2, offload_params={"experts"}),
}
CASES = [(name, pattern) for name in CONFIGS for pattern in ("every-second", "all-streamed")]
CASES += [("mixtral", "experts-only"), ("qwen2_moe", "experts-only")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(name, seed)`: a checkpoint of CONFIGS[name] with random weights from `seed`, written once."""
    folders = {}

    def get(name: str, seed: int):
        if (name, seed) not in folders:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(CONFIGS[name]())
            folder = tmp_path_factory.mktemp(f"{name}-{seed}")
            model.save_pretrained(folder, **({"max_shard_size": "200KB"} if SHARDED[name] else {}))
            folders[name, seed] = folder
        return folders[name, seed]

    return get


def identities(model: nn.Module) -> tuple:
    """What must survive a weight update: tensor objects and addresses, host storage, the engine and its pools."""
    state = hf_prefetch.get_state(model)
    tensors = [(name, id(t), t.data_ptr()) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    hosts = [(o.full_name, id(o.param), o.host.data_ptr()) for o in state.offloaded]
    return tensors, hosts, id(state.engine), [id(ring.pool) for ring in state.engine.rings]


def dispatched(seed: int = 0, **pattern) -> nn.Module:
    return hf_prefetch.dispatch_model(
        tiny_llama(8, seed=seed), offload=hf_prefetch.PrefetchConfig(**pattern), device="cpu"
    )


def loaded(folder, pattern: str) -> nn.Module:
    return hf_prefetch.from_pretrained(folder, offload=hf_prefetch.PrefetchConfig(**PATTERNS[pattern]), device="cpu")


# reload_weights


@pytest.mark.parametrize("name, pattern", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_reload_from_a_checkpoint_matches_a_fresh_load(saved, name, pattern):
    model = loaded(saved(name, 0), pattern)
    logits(model)  # the slots now hold whatever the forward left in them
    before = identities(model)
    assert hf_prefetch.reload_weights(model, saved(name, 1)) is model
    expected = AutoModelForCausalLM.from_pretrained(saved(name, 1)).eval()
    for _ in range(2):
        assert torch.equal(logits(model), logits(expected))
    assert identities(model) == before
    assert hf_prefetch.stats(model).misses == 0
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("prefetch_step", [1, 2, 4])
def test_reload_from_a_state_dict_matches_the_other_model(prefetch_step):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=prefetch_step)
    logits(model)
    before = identities(model)
    other = tiny_llama(8, seed=1)
    hf_prefetch.reload_weights(model, other.state_dict())
    assert torch.equal(logits(model), logits(other))
    ids = prompt()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, **kwargs), other.generate(ids, **kwargs))
    assert identities(model) == before and hf_prefetch.stats(model).misses == 0


def test_reload_casts_between_floating_point_dtypes_like_load_state_dict():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    state_dict = {k: v.to(torch.bfloat16) for k, v in tiny_llama(8, seed=1).state_dict().items()}
    hf_prefetch.reload_weights(model, state_dict)
    expected = tiny_llama(8, seed=3)
    expected.load_state_dict(state_dict)
    assert torch.equal(logits(model), logits(expected))


def test_partial_state_dict_with_strict_false():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    partial = {
        k: v
        for k, v in tiny_llama(8, seed=1).state_dict().items()
        if k.startswith(("model.layers.2.", "model.layers.3."))
    }
    with pytest.raises(ValueError, match=r"has no value for model.embed_tokens.weight .*strict=False"):
        hf_prefetch.reload_weights(model, partial)
    hf_prefetch.reload_weights(model, partial, strict=False)
    expected = tiny_llama(8, seed=0)
    expected.load_state_dict(partial, strict=False)
    assert torch.equal(logits(model), logits(expected))


def _reload_warnings(model, source, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_prefetch.reload_weights(model, source, **kwargs)
    assert all(w.filename == __file__ for w in caught)  # at the caller's line
    return [str(w.message) for w in caught]


def test_strict_false_says_which_keys_named_nothing_and_when_nothing_was_written(caplog):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    other = tiny_llama(8, seed=1).state_dict()
    before = _snapshot(model)
    # Keys of a wrapped model ("module." + the names): none names a tensor, so the call changes nothing.
    wrapped = {f"module.{key}": value for key, value in other.items()}
    (message,) = _reload_warnings(model, wrapped, strict=False)
    assert message.startswith(
        f"reload_weights(strict=False) wrote nothing: the state dict's {len(wrapped)} keys name no parameter or "
        "persistent buffer of LlamaForCausalLM (['module.model.embed_tokens.weight', "
    )
    assert "the model's look like ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight'" in message
    assert message.endswith(
        "Keys are the model's own state_dict() names: 'module.model.embed_tokens.weight' is "
        "'model.embed_tokens.weight' with the prefix 'module.'."
    )
    _assert_unchanged(model, before)
    # A layer's keys without the "model." prefix: the same, and the hint names the prefix they lack.
    bare = {key.removeprefix("model."): value for key, value in other.items() if key.startswith("model.layers.2.")}
    (message,) = _reload_warnings(model, bare, strict=False)
    assert "wrote nothing" in message and message.endswith(
        "'layers.2.self_attn.q_proj.weight' lacks the prefix 'model.' of 'model.layers.2.self_attn.q_proj.weight'."
    )
    empty = "reload_weights(strict=False) wrote nothing: the state dict is empty."
    assert _reload_warnings(model, {}, strict=False) == [empty]
    _assert_unchanged(model, before)
    # Some keys write, one names nothing (a non-persistent buffer): written, and the one left out is named.
    partial = {key: value for key, value in other.items() if key.startswith("model.layers.3.")}
    num_tensors = len(model.state_dict())
    with caplog.at_level(logging.INFO, logger="hf_prefetch.loading.reload"):
        (message,) = _reload_warnings(model, {**partial, "model.rotary_emb.inv_freq": torch.ones(8)}, strict=False)
    assert message == (
        f"reload_weights(strict=False) wrote {len(partial)} tensors and ignored 1 key that names no parameter or "
        f"persistent buffer of LlamaForCausalLM: ['model.rotary_emb.inv_freq']; {num_tensors - len(partial)} other "
        "tensors keep their values. Keys are the model's own state_dict() names."
    )
    assert f"{num_tensors - len(partial)} tensors kept their values (strict=False)" in caplog.text
    assert all(torch.equal(model.state_dict()[key], value) for key, value in partial.items())
    # Every key names a tensor: nothing to say, whether the state dict is partial or whole.
    assert _reload_warnings(model, partial, strict=False) == []
    assert _reload_warnings(model, other) == []


def test_strict_false_with_a_checkpoint_says_that_it_changes_nothing(saved):
    model = loaded(saved("llama", 0), "every-second")
    (message,) = _reload_warnings(model, saved("llama", 1), strict=False)
    assert message.startswith(
        "reload_weights(strict=False) applies to a state dict only: a checkpoint must fill every parameter"
    )
    assert _reload_warnings(model, saved("llama", 1)) == []


def _other_state(change):
    state_dict = tiny_llama(8, seed=1).state_dict()
    change(state_dict)
    return state_dict


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda sd: sd.update({"model.layers.3.mlp.up_proj.weight": torch.zeros(64, 128)}),
            r"'model.layers.3.mlp.up_proj.weight' has shape \[64, 128\] but .* has shape \[128, 64\].*remove_offload",
        ),
        (
            lambda sd: sd.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.int8)}),
            r"holds torch.int8 values but model.layers.1.mlp.up_proj.weight is torch.float32.*remove_offload",
        ),
        (
            lambda sd: sd.update({"model.layers.1.mlp.scale": torch.ones(1)}),
            r"'model.layers.1.mlp.scale'.*1 unexpected",
        ),
        (lambda sd: sd.pop("model.layers.5.input_layernorm.weight"), r"no value for model.layers.5.input_layernorm"),
        (lambda sd: sd.update({"lm_head.weight": [0.0]}), r"state_dict\['lm_head.weight'\] is a list, not a tensor"),
    ],
    ids=["shape", "dtype", "unexpected", "missing", "not-a-tensor"],
)
def test_a_source_that_does_not_fit_writes_nothing(change, match):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    expected = logits(model)
    with pytest.raises(ValueError, match=match):
        hf_prefetch.reload_weights(model, _other_state(change))
    assert torch.equal(logits(model), expected)


def test_a_checkpoint_of_another_shape_writes_nothing(saved, tmp_path):
    model = loaded(saved("llama", 0), "every-second")
    expected = logits(model)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(
        LlamaConfig(intermediate_size=96, num_hidden_layers=4, **ATTENTION)
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight' has shape \[64, 96\] .* has shape \[64, 128\]"):
        hf_prefetch.reload_weights(model, tmp_path)
    assert torch.equal(logits(model), expected)


def _snapshot(model: nn.Module) -> tuple:
    """What a refused reload must leave as it was: every state-dict value, the logits, the dispatch's identities."""
    with torch.no_grad():
        return {k: v.clone() for k, v in model.state_dict().items()}, logits(model), identities(model)


def _assert_unchanged(model: nn.Module, snapshot: tuple) -> None:
    values, expected, before = snapshot
    now = model.state_dict()
    assert now.keys() == values.keys()
    for key, value in values.items():
        assert torch.equal(now[key], value), key
    assert torch.equal(logits(model), expected)
    assert identities(model) == before


def _save(folder, name: str, seed: int, change=lambda tensors: None):
    """A single-file checkpoint of CONFIGS[name] with random weights from `seed`, its tensors edited by `change`."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(CONFIGS[name]()).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    "dropped",
    [
        ["model.layers.1.mlp.up_proj.weight"],
        ["model.layers.3.self_attn.o_proj.weight", "model.layers.0.mlp.up_proj.weight"],
    ],
    ids=["streamed", "streamed-and-resident"],
)
def test_a_checkpoint_without_a_parameter_writes_nothing(saved, tmp_path, dropped):
    # Layers 1 and 3 stream: their parameters' state-dict values are host tensors, not parameters.
    model = loaded(saved("llama", 0), "every-second")
    before = _snapshot(model)
    _save(tmp_path, "llama", 1, lambda tensors: [tensors.pop(key) for key in dropped])
    with pytest.raises(ValueError, match=rf"has no tensor for {len(dropped)} parameter.*Nothing was written") as error:
        hf_prefetch.reload_weights(model, tmp_path)
    assert all(key in str(error.value) for key in dropped)
    _assert_unchanged(model, before)


def test_a_shard_missing_from_the_index_is_named_with_every_tensor_it_fills(saved, tmp_path):
    model = loaded(saved("llama", 0), "every-second")
    before = _snapshot(model)
    folder = tmp_path / "checkpoint"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(folder, max_shard_size="200KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = {}
    for key, shard in index["weight_map"].items():
        shards.setdefault(shard, []).append(key)
    # A shard with tensors of a streamed layer (1, 3) and of a resident one (0, 2).
    shard, lost = next(
        (shard, keys)
        for shard, keys in shards.items()
        if any(k.startswith(("model.layers.1.", "model.layers.3.")) for k in keys)
        and any(k.startswith(("model.layers.0.", "model.layers.2.")) for k in keys)
    )
    (folder / shard).unlink()
    index["weight_map"] = {key: name for key, name in index["weight_map"].items() if name != shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"has no tensor for {len(lost)} parameters") as error:
        hf_prefetch.reload_weights(model, folder)
    message = str(error.value)
    assert shard in message and "Nothing was written" in message
    assert [key for key in lost if key not in message] == []
    _assert_unchanged(model, before)


def _tie_differently(tensors):
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1


def _tie_as_int8(tensors):
    # Keys sort "lm_head.weight" first: the int8 copy is the second of the two, which a reload must read too.
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"].to(torch.int8)


TIED = r"'(lm_head|transformer.wte).weight' and '(transformer.wte|lm_head).weight' fill one tensor .*different values"


@pytest.mark.parametrize(
    "change, match",
    [
        (_tie_differently, TIED),
        (_tie_as_int8, r"'transformer.wte.weight' holds torch.int8 values but transformer.wte.weight is torch.float"),
    ],
    ids=["different-values", "int8"],
)
def test_tied_tensors_stored_twice_must_agree_as_for_from_pretrained(saved, tmp_path, change, match):
    model = loaded(saved("gpt2-tied", 0), "every-second")
    before = _snapshot(model)
    _save(tmp_path / "bad", "gpt2-tied", 1, change)
    with pytest.raises(ValueError, match=TIED):  # the int8 copy holds other values once cast
        loaded(tmp_path / "bad", "every-second")
    with pytest.raises(ValueError, match=match):
        hf_prefetch.reload_weights(model, tmp_path / "bad")
    _assert_unchanged(model, before)
    # Stored twice with one value: accepted.
    same = lambda tensors: tensors.update({"lm_head.weight": tensors["transformer.wte.weight"].clone()})  # noqa: E731
    _save(tmp_path / "good", "gpt2-tied", 1, same)
    hf_prefetch.reload_weights(model, tmp_path / "good")
    assert torch.equal(logits(model), logits(AutoModelForCausalLM.from_pretrained(tmp_path / "good").eval()))


def test_tied_tensors_given_two_values_in_a_state_dict_are_refused():
    torch.manual_seed(0)
    model = hf_prefetch.dispatch_model(
        AutoModelForCausalLM.from_config(CONFIGS["gpt2-tied"]()).eval(),
        offload=hf_prefetch.PrefetchConfig(**PATTERNS["every-second"]),
        device="cpu",
    )
    before = _snapshot(model)
    torch.manual_seed(1)
    state_dict = AutoModelForCausalLM.from_config(CONFIGS["gpt2-tied"]()).state_dict()
    state_dict["lm_head.weight"] = state_dict["lm_head.weight"] + 1
    match = r"state_dict\['transformer.wte.weight'\] and state_dict\['lm_head.weight'\] fill one tensor"
    with pytest.raises(ValueError, match=match):
        hf_prefetch.reload_weights(model, state_dict)
    _assert_unchanged(model, before)


class _Wrapped(torch.Tensor):
    """A tensor subclass that runs its own ops (as DTensor or a quantized tensor does): copy_ cannot read it."""

    @staticmethod
    def __new__(cls, value: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, value.shape, dtype=value.dtype, device=value.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_Wrapped does not implement {func}")


BAD_VALUES = {
    "meta": (lambda v: v.to("meta"), r"is on the meta device"),
    "sparse": (lambda v: v.to_sparse(), r"has layout torch.sparse_coo.*to_dense\(\)"),
    "sparse-csr": (lambda v: v.to_sparse_csr(), r"has layout torch.sparse_csr.*to_dense\(\)"),
    "nested": (lambda v: torch.nested.nested_tensor(list(v)), r"is a nested tensor"),
    "subclass": (_Wrapped, r"is a _Wrapped, a tensor subclass"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR and nested tensors are in beta
@pytest.mark.parametrize("key", ["model.layers.5.mlp.up_proj.weight", "lm_head.weight"], ids=["streamed", "resident"])
@pytest.mark.parametrize("kind", list(BAD_VALUES))
def test_a_state_dict_value_that_cannot_be_copied_writes_nothing(kind, key):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    before = _snapshot(model)
    make, match = BAD_VALUES[kind]
    state_dict = tiny_llama(8, seed=1).state_dict()
    state_dict[key] = make(state_dict[key])
    with pytest.raises(ValueError, match=rf"state_dict\['{key}'\] {match}"):
        hf_prefetch.reload_weights(model, state_dict)
    _assert_unchanged(model, before)


def _parameters(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}  # streamed ones point at slots


def _swapped(model):
    current = model.state_dict()
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight"
    return {a: current[b], b: current[a]}


def _transposed(model):
    state_dict = tiny_llama(8, seed=1).state_dict()
    key = "model.layers.4.self_attn.o_proj.weight"  # square
    state_dict[key] = model.state_dict()[key].t()
    return state_dict


@pytest.mark.parametrize(
    "make, match",
    [
        (_parameters, r"'model.layers.1.self_attn.q_proj.weight'\] shares memory with the buffer slot"),
        (_swapped, r"'model.layers.0.mlp.up_proj.weight'\] shares memory with model.layers.2.mlp.up_proj.weight"),
        (_transposed, r"'model.layers.4.self_attn.o_proj.weight'\] shares memory with model.layers.4"),
    ],
    ids=["slots", "swapped", "transposed"],
)
def test_a_state_dict_value_that_shares_memory_with_what_is_written_writes_nothing(make, match):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=1)
    logits(model)  # slot 0 now holds layer 1, not layer 3
    before = _snapshot(model)
    with pytest.raises(ValueError, match=rf"state_dict\[{match}.*clone\(\)"):
        hf_prefetch.reload_weights(model, make(model), strict=False)
    _assert_unchanged(model, before)
    hf_prefetch.reload_weights(model, model.state_dict())  # each value is its own destination: nothing to do
    _assert_unchanged(model, before)


def test_a_model_dispatched_under_inference_mode_is_reloaded_inside_it():
    with torch.inference_mode():
        model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
        before = _snapshot(model)
    new = tiny_llama(8, seed=1)
    with pytest.raises(ValueError, match=r"inference tensor.*under torch.inference_mode\(\)"):
        hf_prefetch.reload_weights(model, new.state_dict())
    with torch.inference_mode():
        _assert_unchanged(model, before)
        hf_prefetch.reload_weights(model, new.state_dict())
        assert torch.equal(logits(model), logits(new))
        hf_prefetch.remove_offload(model)  # its tensors are inference tensors: undone inside inference_mode too


def test_reload_needs_a_dispatched_model_and_a_source():
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is not dispatched by hf_prefetch.*load_state_dict"):
        hf_prefetch.reload_weights(tiny_llama(2), {})
    with pytest.raises(ValueError, match=r"source=int is neither a checkpoint path nor a state dict"):
        hf_prefetch.reload_weights(dispatched(), 3)


def _scale(style: str, calls: list):
    def process(layer: nn.Module) -> None:
        calls.append(layer)
        for linear in (layer.mlp.up_proj, layer.self_attn.o_proj):
            if style == "in-place":
                linear.weight.mul_(2)
            elif style == "data":
                linear.weight.data = linear.weight.data * 2
            else:
                linear.weight = nn.Parameter(linear.weight * 2)
        layer.post_attention_layernorm.weight.add_(0.5)

    return process


@pytest.mark.parametrize("style", ["in-place", "data", "new-parameter"])
@pytest.mark.parametrize("pattern", ["every-second", "all-streamed"])
def test_process_runs_once_per_layer_and_its_result_is_stored(style, pattern):
    model = dispatched(**PATTERNS[pattern])
    logits(model)
    before = identities(model)
    calls = []
    hf_prefetch.reload_weights(model, tiny_llama(8, seed=1).state_dict(), process=_scale(style, calls))
    assert [id(layer) for layer in calls] == [id(layer) for layer in model.model.layers]
    expected = tiny_llama(8, seed=1)
    for layer in expected.model.layers:
        with torch.no_grad():
            _scale(style, [])(layer)
    for _ in range(2):
        assert torch.equal(logits(model), logits(expected))
    assert identities(model) == before
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_process_sees_each_layers_new_weights_on_the_execution_device(saved):
    model = loaded(saved("llama", 0), "all-streamed")
    seen = []
    hf_prefetch.reload_weights(model, saved("llama", 1), process=lambda layer: seen.append(_weights(layer)))
    expected = AutoModelForCausalLM.from_pretrained(saved("llama", 1))
    assert len(seen) == 4
    for got, layer in zip(seen, expected.model.layers, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, _weights(layer), strict=True))


def _weights(layer: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in layer.parameters()]


def _replace_linear(layer):
    layer.mlp.up_proj = nn.Linear(64, 128, bias=False)


@pytest.mark.parametrize(
    "process, match",
    [
        (lambda layer: setattr(layer.mlp.up_proj.weight, "data", layer.mlp.up_proj.weight.data.half()), r"changed "
         r"mlp.up_proj.weight from \[128, 64\] torch.float32 to \[128, 64\] torch.float16"),
        (lambda layer: setattr(layer.mlp.up_proj, "weight", nn.Parameter(torch.zeros(8, 64))), r"to \[8, 64\]"),
        (lambda layer: layer.mlp.up_proj.register_buffer("scale", torch.ones(1)), r"added mlp.up_proj.scale"),
        (lambda layer: delattr(layer.mlp.up_proj, "weight"), r"removed mlp.up_proj.weight"),
        (_replace_linear, r"replaced or removed the submodule mlp.up_proj"),
    ],
    ids=["dtype", "shape", "added", "removed", "submodule"],
)  # fmt: skip
@pytest.mark.parametrize("failing_layer", [0, 1])
def test_process_that_changes_more_than_values_is_refused(process, match, failing_layer):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    before = identities(model)
    modules = [dict(layer.named_modules()) for layer in model.model.layers]

    def process_one(layer):
        if layer is model.model.layers[failing_layer]:
            process(layer)

    new = tiny_llama(8, seed=1).state_dict()
    with pytest.raises(ValueError, match=rf"process\(model.layers.{failing_layer}\) may change values only.*{match}"):
        hf_prefetch.reload_weights(model, new, process=process_one)
    assert identities(model) == before  # the layer's tensors were put back
    assert [dict(layer.named_modules()) for layer in model.model.layers] == modules
    hf_prefetch.reload_weights(model, new)
    assert torch.equal(logits(model), logits(tiny_llama(8, seed=1)))


def test_a_failing_process_leaves_a_consistent_model():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)

    def fail_at_layer_5(layer):
        if layer is model.model.layers[5]:
            raise RuntimeError("process failed")

    new = tiny_llama(8, seed=1)
    with pytest.raises(RuntimeError, match="process failed"):
        hf_prefetch.reload_weights(model, new.state_dict(), process=fail_at_layer_5)
    # Layers 0..5 hold the new weights, the rest the old ones; the slots agree with host storage.
    old = ("model.layers.6.", "model.layers.7.")
    expected = tiny_llama(8, seed=0)
    expected.load_state_dict({k: v for k, v in new.state_dict().items() if not k.startswith(old)}, strict=False)
    assert torch.equal(logits(model), logits(expected))


# load_state_dict


@pytest.mark.parametrize("prefetch_step", [1, 2, 3])
@pytest.mark.parametrize("pattern", [dict(group_size=2, num_in_group=1), dict(group_size=1, num_in_group=1)])
def test_load_state_dict_writes_through_to_host_storage(pattern, prefetch_step):
    model = dispatched(**pattern, prefetch_step=prefetch_step)
    logits(model)
    before = identities(model)
    other = tiny_llama(8, seed=1)
    result = model.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for _ in range(2):
        assert torch.equal(logits(model), logits(other))
    assert identities(model) == before and hf_prefetch.stats(model).misses == 0
    for key, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_load_state_dict_strict_false_partial_matches_an_ordinary_model():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    logits(model)
    partial = {k: v for k, v in tiny_llama(8, seed=1).state_dict().items() if ".mlp." in k or "layers.4." in k}
    partial["not.a.key"] = torch.ones(1)
    expected = tiny_llama(8, seed=0)
    assert model.load_state_dict(partial, strict=False) == expected.load_state_dict(partial, strict=False)
    assert torch.equal(logits(model), logits(expected))


@pytest.mark.parametrize("path", ["model.layers.3", "model.layers.3.mlp", "model.layers.3.mlp.up_proj", "model"])
def test_load_state_dict_on_a_submodule(path):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=1)
    logits(model)
    other = tiny_llama(8, seed=1)
    model.get_submodule(path).load_state_dict(other.get_submodule(path).state_dict())
    expected = tiny_llama(8, seed=0)
    expected.get_submodule(path).load_state_dict(other.get_submodule(path).state_dict())
    assert torch.equal(logits(model), logits(expected))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda sd: sd.pop("model.layers.3.mlp.up_proj.weight"), r"Missing key\(s\)"),
        (lambda sd: sd.update({"model.layers.3.mlp.up_proj.weight": torch.zeros(3)}), r"size mismatch"),
    ],
    ids=["missing", "size-mismatch"],
)
def test_load_state_dict_errors_are_torchs_and_leave_a_consistent_model(change, match):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    logits(model)
    before = identities(model)
    state_dict = _other_state(change)
    with pytest.raises(RuntimeError, match=match):
        model.load_state_dict(state_dict)
    expected = tiny_llama(8, seed=0)
    with pytest.raises(RuntimeError, match=match):
        expected.load_state_dict(state_dict)  # torch writes the keys that fit, then raises: so does the dispatch
    assert torch.equal(logits(model), logits(expected))
    assert identities(model) == before


@pytest.mark.parametrize("path", ["", "model.layers", "model.layers.1.mlp"])
def test_load_state_dict_with_assign_is_refused_before_anything_changes(path):
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    expected = logits(model)
    before = identities(model)
    other = tiny_llama(8, seed=1).get_submodule(path)
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace the streamed parameter .*reload_weights"):
        model.get_submodule(path).load_state_dict(other.state_dict(), assign=True)
    assert identities(model) == before
    assert torch.equal(logits(model), expected)


def test_remove_offload_removes_the_load_hooks():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=2)
    hf_prefetch.remove_offload(model)
    assert not any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules())
    other = tiny_llama(8, seed=1)
    model.load_state_dict(other.state_dict(), assign=True)
    assert torch.equal(logits(model), logits(other))


# sync_from_device


def test_sync_from_device_when_every_streamed_layer_holds_its_slot():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=4)
    expected = tiny_llama(8, seed=0)
    for m in (model, expected):
        with torch.no_grad():
            for i in (1, 5):
                m.model.layers[i].mlp.up_proj.weight.mul_(0.5)
    assert hf_prefetch.sync_from_device(model) == [f"model.layers.{i}" for i in (1, 3, 5, 7)]
    for _ in range(2):
        assert torch.equal(logits(model), logits(expected))
    for key, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_sync_from_device_only_for_the_layer_that_holds_a_slot():
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=1)
    logits(model)  # after a forward, layer 1 (the first streamed layer) holds the only slot again
    with pytest.raises(
        ValueError, match=r"model.layers.3 does not hold its buffer slot 0 now \(model.layers.1 does\)"
    ):
        hf_prefetch.sync_from_device(model, ["model.layers.3"])
    with pytest.raises(ValueError, match=r"'model.layers.2' is not a streamed layer.*need no sync"):
        hf_prefetch.sync_from_device(model, "model.layers.2")
    expected = tiny_llama(8, seed=0)
    for m in (model, expected):
        with torch.no_grad():
            m.model.layers[1].self_attn.q_proj.weight.add_(1.0)
    assert hf_prefetch.sync_from_device(model, "model.layers.1") == ["model.layers.1"]
    for _ in range(2):
        assert torch.equal(logits(model), logits(expected))


def test_writes_through_parameters_without_sync_are_lost():
    # Why reload_weights, load_state_dict write-through and sync_from_device exist.
    model = dispatched(group_size=2, num_in_group=1, prefetch_step=1)
    expected = logits(model)
    with torch.no_grad():
        model.model.layers[3].mlp.up_proj.weight.mul_(2)  # lands in slot 0, which holds layer 1's weights now
    assert not torch.equal(logits(model), expected)  # layer 1 computed with the changed slot...
    assert torch.equal(logits(model), expected)  # ...which the next copy overwrote: the write is lost


# CUDA


def _cuda_llama(seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


@pytest.mark.gpu
def test_reload_on_cuda_matches_a_fresh_load(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "_WINDOW_BYTES", 4096)  # many windows
    for seed in (0, 1):
        _cuda_llama(seed).save_pretrained(tmp_path / str(seed), max_shard_size="1MB")
    pattern = dict(group_size=2, num_in_group=1, prefetch_step=2)
    model = hf_prefetch.from_pretrained(
        tmp_path / "0", offload=hf_prefetch.PrefetchConfig(**pattern), device="cuda", dtype=torch.bfloat16
    )
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    model.generate(ids, **kwargs)
    before = identities(model)
    hf_prefetch.reload_weights(model, tmp_path / "1")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "1", dtype=torch.bfloat16, device_map="cuda").eval()
    assert torch.equal(model.generate(ids, **kwargs), expected.generate(ids, **kwargs))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)

    calls = []
    hf_prefetch.reload_weights(model, tmp_path / "1", process=_scale("data", calls))
    for layer in expected.model.layers:
        with torch.no_grad():
            _scale("data", [])(layer)
    assert len(calls) == 6
    assert torch.equal(model.generate(ids, **kwargs), expected.generate(ids, **kwargs))

    other = _cuda_llama(2)
    model.load_state_dict(other.state_dict())  # from host memory
    other.cuda()
    assert torch.equal(model.generate(ids, **kwargs), other.generate(ids, **kwargs))
    model.load_state_dict(_cuda_llama(3).cuda().state_dict())  # from device memory
    hf_prefetch.reload_weights(model, other.state_dict())
    assert torch.equal(model.generate(ids, **kwargs), other.generate(ids, **kwargs))
    assert identities(model) == before and hf_prefetch.stats(model).misses == 0
