"""torchao's quantized tensor subclasses stream their inner tensors (packed values, scales, zero points), never a
dequantized copy: the same bits as the same quantized model resident, on every path that reads or writes the weights.
The configurations here run on the CPU; torchao's GPU-only ones (Int4, float8 with dynamic activations) go through
the same code."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import hf_prefetch
from hf_prefetch import PrefetchConfig, UVAConfig
from tests.models import assert_same_generation, generate_with_logits, prompt, rewrite_checkpoint, tiny_llama

quantization = pytest.importorskip("torchao.quantization")

CONFIG = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)  # layers 1 and 5 take turns in one slot
METHODS = ["Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig", "Float8WeightOnlyConfig"]
METHODS += ["IntxWeightOnlyConfig"]


def _quantized(method: str = "Int8WeightOnlyConfig", seed: int = 0):
    model = tiny_llama(6, seed=seed, dtype=torch.bfloat16)
    quantization.quantize_(model, getattr(quantization, method)())
    return model


def _inner(tensor) -> dict[str, torch.Tensor]:
    names, _ = tensor.__tensor_flatten__()
    return {name: getattr(tensor, name) for name in names}


def _same_values(a: dict, b: dict) -> bool:
    # Equal state dicts: plain tensors bitwise, tensor subclasses of the same type with bitwise equal inner tensors.
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if type(value) is not type(other):
            return False
        pairs = zip(_inner(value).values(), _inner(other).values(), strict=True) if hasattr(value, "qdata") else None
        if pairs is None and not torch.equal(value, other):
            return False
        if pairs is not None and not all(torch.equal(x, y) for x, y in pairs):
            return False
    return True


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", METHODS)
def test_quantized_layers_stream_their_inner_tensors_and_compute_what_the_resident_model_computes(method):
    model = _quantized(method)
    resident = copy.deepcopy(model)
    values = resident.state_dict()
    ids = prompt()
    want = generate_with_logits(resident, ids)
    weight = model.model.layers[1].mlp.up_proj.weight
    inner_bytes = sum(t.numel() * t.element_size() for t in _inner(weight).values())
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    state = hf_prefetch.get_state(model)
    # The subclass reads its slots (on the CPU, reading host storage would give the same values).
    assert all(getattr(o.param, o.attr).data_ptr() != o.host.data_ptr() for o in state.offloaded)
    plan = state.plan
    layer = plan.rings[0].layers[1]
    names = [spec.name for spec in layer.offloaded]
    assert f"mlp.up_proj.weight:{next(iter(_inner(weight)))}" in names
    assert sum(s.nbytes for s in layer.offloaded if s.name.startswith("mlp.up_proj.weight:")) == inner_bytes
    # Packed bytes: a layer is well under its bf16 size.
    assert layer.offloaded_bytes < 0.7 * sum(p.numel() * 2 for p in resident.model.layers[1].parameters())
    assert_same_generation(generate_with_logits(model, ids), want)
    assert _same_values(model.state_dict(), values)
    assert type(model.model.layers[1].mlp.up_proj.weight) is type(weight)
    hf_prefetch.remove_offload(model)
    assert _same_values(model.state_dict(), values)
    assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_load_state_dict_and_sync_from_device_write_the_inner_tensors():
    model, other = _quantized(), _quantized(seed=1)
    ids = prompt()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    generate_with_logits(model, ids)  # the slots hold layers now
    model.load_state_dict(other.state_dict())
    state = hf_prefetch.get_state(model)
    # Written through host storage, and read from the slots again (on the CPU, reading host storage looks the same).
    assert all(getattr(o.param, o.attr).data_ptr() != o.host.data_ptr() for o in state.offloaded)
    assert _same_values(model.state_dict(), other.state_dict())
    want = generate_with_logits(other, ids)
    assert_same_generation(generate_with_logits(model, ids), want)
    hf_prefetch.sync_from_device(model)
    assert _same_values(model.state_dict(), other.state_dict())
    hf_prefetch.remove_offload(model)
    assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_what_cannot_write_or_map_inner_tensors_is_refused_and_changes_nothing():
    model, other = _quantized(), _quantized(seed=1)
    values = copy.deepcopy(model.state_dict())
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    refused = r"parameters stored as several tensors \(model\.layers\.1\..*Int8Tensor.*Nothing was"
    with pytest.raises(ValueError, match=refused):
        hf_prefetch.reload_weights(model, other.state_dict())
    assert _same_values(model.state_dict(), values)
    hf_prefetch.remove_offload(model)
    unmapped = r"layers\.0\..* is stored as several tensors \(Int8Tensor\), which the UVA backend"
    with pytest.raises(ValueError, match=unmapped):
        hf_prefetch.dispatch_model(model, UVAConfig(cpu_offload_gb=1), device="cpu")
    assert hf_prefetch.get_state(model) is None and _same_values(model.state_dict(), values)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compress_leaves_inner_tensors_plain():
    model = _quantized()
    want = generate_with_logits(copy.deepcopy(model), prompt())
    config = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2, compress=True)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    assert hf_prefetch.get_state(model).plan.compressed_bytes == (0, 0)
    assert_same_generation(generate_with_logits(model, prompt()), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_with_compressed_neighbours_removal_gives_inner_tensors_of_their_own():
    # The MLP quantized, attention bf16 and compressed: the inner tensors sit in the compressed arena's plain part.
    model = tiny_llama(6, seed=0, dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    quantization.quantize_(
        model,
        quantization.Int8WeightOnlyConfig(),
        filter_fn=lambda m, name: isinstance(m, nn.Linear) and "mlp" in name,
    )
    values = copy.deepcopy(model.state_dict())
    want = generate_with_logits(copy.deepcopy(model), prompt())
    config = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2, compress=True)
    hf_prefetch.dispatch_model(model, config, device="cpu")
    state = hf_prefetch.get_state(model)
    assert state.plan.compressed_bytes[1] > 0
    assert_same_generation(generate_with_logits(model, prompt()), want)
    arena = state.arena._buffer
    inside = range(arena.data_ptr(), arena.data_ptr() + arena.numel())
    hf_prefetch.remove_offload(model)
    weight = model.model.layers[1].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16 and weight.dequantize().dtype == torch.bfloat16
    tensors = [t for p in model.parameters() for t in (_inner(p).values() if hasattr(p, "qdata") else [p])]
    assert not any(t.data_ptr() in inside for t in tensors)
    del arena
    assert _same_values(model.state_dict(), values)
    assert_same_generation(generate_with_logits(copy.deepcopy(model), prompt()), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fail_at", ["_attach_prefetch", "_report_host_values"])
def test_an_interrupted_dispatch_gives_the_inner_tensors_back(monkeypatch, fail_at):
    model = _quantized()
    values = copy.deepcopy(model.state_dict())
    weight = model.model.layers[1].mlp.up_proj.weight
    before = {name: tensor for name, tensor in _inner(weight).items()}
    real = getattr(hf_prefetch.lifecycle.attach, fail_at)

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_prefetch.lifecycle.attach, fail_at, interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    assert hf_prefetch.get_state(model) is None
    assert _same_values(model.state_dict(), values)
    # The parameter reads tensors of its own again, not host storage or a slot.
    assert all(getattr(weight, name).device.type == "cpu" for name in before)
    monkeypatch.undo()
    want = generate_with_logits(_quantized(), prompt())
    assert_same_generation(generate_with_logits(model, prompt()), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_deleted_model_frees_its_inner_tensors():
    model = _quantized()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    generate_with_logits(model, prompt())
    host = weakref.ref(hf_prefetch.get_state(model).offloaded[0].host)
    gc.collect()
    del model
    gc.collect()
    assert host() is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_forwards_read_the_streamed_inner_tensors():
    model, other = _quantized(), _quantized(seed=1)
    ids = prompt()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    compiled = torch.compile(model.forward, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, _quantized()(ids).logits)
        model.load_state_dict(other.state_dict())  # new values in host storage, the same tensors in the graph
        assert torch.equal(compiled(ids).logits, other(ids).logits)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_quantized_layers_stream_on_cuda_as_the_resident_model_computes(method):
    model = _quantized(method)
    resident = copy.deepcopy(model).cuda()
    ids = prompt().cuda()
    want = generate_with_logits(resident, ids)
    hf_prefetch.dispatch_model(model, CONFIG, device="cuda")
    assert_same_generation(generate_with_logits(model, ids), want)
    hf_prefetch.remove_offload(model, device="cuda")
    assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_subclass_torch_cannot_swap_is_refused_clearly_and_nothing_is_left_dispatched():
    model = _quantized()
    values = copy.deepcopy(model.state_dict())
    weight = model.model.layers[1].mlp.up_proj.weight
    held = weakref.ref(weight)  # torch.utils.swap_tensors refuses a tensor with weak references
    with pytest.raises(ValueError, match=r"model\.layers\.1: a tensor subclass to slot 0: torch refused to swap"):
        hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    assert held() is weight and hf_prefetch.get_state(model) is None
    assert _same_values(model.state_dict(), values)
    assert not hasattr(model.model.layers[1], "_hf_hook")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_model_transformers_quantized_with_torchao_config_streams_and_saves_its_values(tmp_path):
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_llama(6, dtype=torch.bfloat16).save_pretrained(tmp_path / "plain")
    quantized = TorchAoConfig(quantization.Int8WeightOnlyConfig())
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "plain", quantization_config=quantized, dtype=torch.bfloat16
    )
    values = copy.deepcopy(model.state_dict())
    want = generate_with_logits(copy.deepcopy(model), prompt())
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    assert_same_generation(generate_with_logits(model, prompt()), want)
    model.save_pretrained(tmp_path / "saved")  # through state_dict(): the host values
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    assert _same_values(saved.state_dict(), values)


def _saved_torchao(folder, method: str = "Int8WeightOnlyConfig", **save):
    # A checkpoint saved from a model transformers quantized with TorchAoConfig (safetensors: each subclass flattened
    # into its inner tensors, its type and attributes in the files' __metadata__).
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_llama(6, dtype=torch.bfloat16).save_pretrained(folder / "plain")
    config = TorchAoConfig(getattr(quantization, method)())
    model = AutoModelForCausalLM.from_pretrained(folder / "plain", quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(folder / "quantized", **save)
    return folder / "quantized"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "method, save",
    [
        ("Int8WeightOnlyConfig", {}),
        ("Float8WeightOnlyConfig", {}),
        ("Int8WeightOnlyConfig", {"max_shard_size": "30KB"}),
    ],
    ids=["int8", "float8", "int8-sharded"],
)
def test_from_pretrained_reads_a_prequantized_torchao_checkpoint_as_stored(tmp_path, method, save):
    from transformers import AutoModelForCausalLM

    folder = _saved_torchao(tmp_path, method, **save)
    resident = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
    dispatched = copy.deepcopy(resident)
    ids = prompt()
    want = generate_with_logits(resident, ids)
    hf_prefetch.dispatch_model(dispatched, CONFIG, device="cpu")
    model = hf_prefetch.from_pretrained(folder, CONFIG, device="cpu")
    state = hf_prefetch.get_state(model)
    # The inner tensors stream, as for the same model loaded by transformers and dispatched; the plan of the folder
    # counts the same bytes.
    weight = model.model.layers[1].mlp.up_proj.weight
    assert type(weight) is type(resident.model.layers[1].mlp.up_proj.weight)
    assert {o.inner for o in state.offloaded if o.param is weight} == set(weight.__tensor_flatten__()[0])
    assert state.plan.offloaded_bytes == hf_prefetch.get_state(dispatched).plan.offloaded_bytes
    assert hf_prefetch.plan(folder, CONFIG, device="cpu").offloaded_bytes == state.plan.offloaded_bytes
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids), want)
    assert _same_values(model.state_dict(), resident.state_dict())
    hf_prefetch.remove_offload(model)
    assert_same_generation(generate_with_logits(model, ids), want)
    assert _same_values(model.state_dict(), resident.state_dict())


def _described(metadata, **changes) -> str:
    # The __metadata__ entry of up_proj's weight in layer 1, with `changes`.
    import json

    return json.dumps(json.loads(metadata["model.layers.1.mlp.up_proj.weight"]) | changes)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "change, metadata, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj._weight_scale"), None,
         r"the torchao Int8Tensor model.layers.1.mlp.up_proj.weight is stored as \['zero_point', 'qdata', 'scale'\] "
         r"\(the files' __metadata__\), but there is no tensor 'model.layers.1.mlp.up_proj._weight_scale'"),
        (lambda t: t.update({"model.layers.1.mlp.up_proj._weight_bogus": torch.zeros(3)}), None,
         r"but the files also hold \['model.layers.1.mlp.up_proj._weight_bogus'\]"),
        (lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64)}), None,
         r"tensor 'model.layers.1.mlp.up_proj.weight' is stored beside the quantized parts of the same parameter"),
        (lambda t: None, lambda m: {"format": "pt"}, r"__metadata__ does not describe torchao tensors"),
        (lambda t: None, lambda m: m | {"model.layers.1.mlp.up_proj.weight": "[1, 2]"},
         r"'model.layers.1.mlp.up_proj.weight' is '\[1, 2\]': not a tensor type torchao loads"),
        (lambda t: None, lambda m: m | {"tensor_names": '[["model.norm.weight"]]'},
         r"'tensor_names' is .*not a JSON list of tensor names"),
        (lambda t: None, lambda m: m | {"model.layers.1.mlp.up_proj.weight": _described(m, _tensor_data_names=5)},
         r"'model.layers.1.mlp.up_proj.weight' names its inner tensors 5, not a list of names"),
        (lambda t: t.update({"model.layers.1.mlp.up_proj._weight_qdata": torch.zeros(3, 64, dtype=torch.int8)}),
         None, r"the quantized model.layers.1.mlp.up_proj.weight has shape \[3, 64\] but LlamaForCausalLM's has "
         r"\[128, 64\]"),
    ],
    ids=["missing-inner-tensor", "extra-inner-tensor", "plain-tensor-beside-its-parts", "no-torchao-metadata",
         "entry-not-an-object", "names-not-strings", "inner-names-not-a-list", "wrong-shape"],
)  # fmt: skip
def test_from_pretrained_refuses_a_damaged_torchao_checkpoint_naming_the_key(tmp_path, change, metadata, message):
    folder = _saved_torchao(tmp_path)
    rewrite_checkpoint(folder, change, metadata)
    with pytest.raises(ValueError, match=message):
        hf_prefetch.from_pretrained(folder, CONFIG, device="cpu")


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_on_cuda_from_pretrained_of_a_prequantized_torchao_checkpoint_computes_what_transformers_loads(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AutoModelForCausalLM

    folder = _saved_torchao(tmp_path)
    resident = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda").eval()
    ids = prompt().cuda()
    want = generate_with_logits(resident, ids)
    model = hf_prefetch.from_pretrained(folder, CONFIG, device="cuda")
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_from_pretrained_keeps_quantized_tied_embeddings_one_parameter(tmp_path):
    # Embeddings and head tied and quantized (include_input_output_embeddings): the checkpoint holds the same inner
    # tensors under both names; the model gets one subclass parameter, resident, read once and checked equal.
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_llama(6, dtype=torch.bfloat16, tie_word_embeddings=True).save_pretrained(tmp_path / "plain")
    per_row = quantization.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=quantization.PerAxis(0))
    config = quantization.FqnToConfig(
        {"model.embed_tokens": per_row, "lm_head": per_row, "_default": quantization.Int8WeightOnlyConfig()}
    )
    settings = TorchAoConfig(config, include_input_output_embeddings=True)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=settings)
    quantized.save_pretrained(tmp_path / "quantized")
    ids = prompt()
    want = generate_with_logits(quantized, ids)
    model = hf_prefetch.from_pretrained(tmp_path / "quantized", CONFIG, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(o.param is model.lm_head.weight for o in hf_prefetch.get_state(model).offloaded)
    assert_same_generation(generate_with_logits(model, ids), want)


def test_two_quantized_parameters_whose_names_share_a_prefix_are_rebuilt_each_from_its_own_tensors(tmp_path):
    # `weight` and `weight_scale` on one module: stored as `_weight_qdata` and `_weight_scale_qdata`, which torchao's
    # own grouping by prefix would mix.
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    from hf_prefetch.formats import prequantized
    from hf_prefetch.loading.checkpoint import Checkpoint

    linears = nn.Linear(64, 32, dtype=torch.bfloat16), nn.Linear(64, 16, dtype=torch.bfloat16)
    for linear in linears:
        quantization.quantize_(linear, quantization.Int8WeightOnlyConfig())
    values = {"block.weight": linears[0].weight, "block.weight_scale": linears[1].weight}
    tensors, metadata = flatten_tensor_state_dict(values)
    save_file(tensors, tmp_path / "model.safetensors", metadata=metadata)
    model = nn.Module()
    model.block = nn.Module()
    model.block.weight = nn.Parameter(torch.empty(32, 64, device="meta"), requires_grad=False)
    model.block.weight_scale = nn.Parameter(torch.empty(16, 64, device="meta"), requires_grad=False)
    with Checkpoint.open(tmp_path) as checkpoint:
        prequantized.prepare(model, checkpoint, "torchao")
    for name, value in values.items():
        rebuilt = model.get_parameter(name)
        assert type(rebuilt) is type(value) and rebuilt.shape == value.shape
        assert {k: v.shape for k, v in _inner(rebuilt).items()} == {k: v.shape for k, v in _inner(value).items()}
