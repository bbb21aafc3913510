"""compressed-tensors checkpoints (LLM Compressor's format). transformers computes with packed bytes only for FP8
weights with `use_optimized_inference=True` (`CompressedTensorsFP8Linear`: float8 weights, float32 row scales, a
row-wise scaled matmul that the CPU runs too); it decompresses every other scheme to dense weights first. So
`from_pretrained` streams FP8 checkpoints as FP8, bitwise what transformers' optimized load computes, and refuses the
other schemes by name; `dispatch_model` refuses a model still compressed (its first forward would swap its weights).
"""

import json
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_prefetch
from hf_prefetch import PrefetchConfig
from tests.models import assert_same_generation, bytes_of, generate_with_logits, tiny_llama, tiny_qwen2

pytest.importorskip("compressed_tensors")
from transformers import AutoModelForCausalLM, CompressedTensorsConfig  # noqa: E402
from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear  # noqa: E402
from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer  # noqa: E402

STRIDE = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_checkpoint(folder, strategy: str = "channel", model=None, skip: str = "lm_head", static: bool = False):
    """A compressed-tensors FP8-dynamic checkpoint of a tiny Llama (or `model`), as LLM Compressor saves one: every
    decoder linear's weight but those whose key contains `skip` in float8 with a bf16 scale per output row (`channel`)
    or one per tensor (`tensor`). `static`: the FP8 scheme with static activation scales (`input_scale` per linear),
    which transformers' FP8 linears do not read (they scale each input row at every forward)."""
    (model if model is not None else tiny_llama(4, dtype=torch.bfloat16)).save_pretrained(folder)
    tensors = {}
    for key, value in load_file(folder / "model.safetensors").items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight") and skip not in key:
            weight = value.float()
            peak = weight.abs().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().amax().reshape(1)
            scale = peak / FP8_MAX
            tensors[key] = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            tensors[key.removesuffix("weight") + "weight_scale"] = scale.to(torch.bfloat16)
            if static:
                tensors[key.removesuffix("weight") + "input_scale"] = torch.tensor([0.02], dtype=torch.bfloat16)
        else:
            tensors[key] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    if static:
        activations.update(strategy="tensor", dynamic=False)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": sorted({"lm_head", f"re:.*{skip}"}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def packed_checkpoint(folder, bits: int = 4, strategy: str = "group", symmetric: bool = True):
    """A compressed-tensors `pack-quantized` checkpoint of a tiny Llama (W4A16 with a scale per 32 weights, W8A16 with
    one per row; `symmetric`, or with zero points), quantized and packed by compressed-tensors itself as LLM Compressor
    saves one."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    model = tiny_llama(4, dtype=torch.bfloat16)
    group = {"group_size": 32} if strategy == "group" else {}
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, **group)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    _calibrate(model, bits, strategy, symmetric)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return folder


def packed_moe_checkpoint(folder, family: str):
    """A W4A16 checkpoint (a scale per 16 weights) of a tiny mixture-of-experts model as LLM Compressor stores one:
    each expert's linears packed under the checkpoint's per-expert keys, the routers and lm_head dense."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import remove_dispatch
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    from tests.moe_models import moe_model

    settings = json.loads((packed_checkpoint(folder / "llama") / "config.json").read_text())["quantization_config"]
    moe_model(family).to(torch.bfloat16).save_pretrained(folder)
    linears, rest = torch.nn.Module(), {}
    for key, value in load_file(folder / "model.safetensors").items():
        if key.startswith("model.layers.") and re.search(r"(_proj|\.w[123])\.weight$", key):
            *path, leaf, _ = key.split(".")
            parent = linears
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            linear = torch.nn.Linear(value.shape[1], value.shape[0], bias=False, dtype=value.dtype)
            linear.weight.data = value
            parent.add_module(leaf, linear)
        else:
            rest[key] = value
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16)
    apply_quantization_config(
        linears, QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)})
    )
    _calibrate(linears, 4, "group", True, group=16)
    ModelCompressor.from_pretrained_model(linears, quantization_format="pack-quantized").compress_model(linears)
    remove_dispatch(linears, onload_tensors=True)
    tensors = {key: value.detach().contiguous() for key, value in linears.state_dict().items()}
    save_file({**tensors, **rest}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    settings["config_groups"]["group_0"]["weights"]["group_size"] = 16  # Mixtral's experts are 48 wide
    config["quantization_config"] = {**settings, "ignore": ["lm_head", "re:.*mlp.gate$"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _calibrate(model, bits: int, strategy: str, symmetric: bool, group: int = 32) -> None:
    # A scale (and zero point) per group of weights or per row, from the weights' range.
    top = 2 ** (bits - 1)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.float()
            groups = weight.reshape(weight.shape[0], -1, group) if strategy == "group" else weight[:, None]
            if symmetric:
                scale = groups.abs().amax(-1) / (top - 0.5)
            else:
                low, high = groups.amin(-1), groups.amax(-1)
                scale = (high - low).clamp(min=1e-6) / (2 * top - 1)
                zero = (-top - low / scale).round().clamp(-top, top - 1)
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
            module.weight_scale.data = scale.clamp(min=1e-6).to(module.weight_scale.dtype)


@pytest.fixture
def fp8_everywhere(monkeypatch):
    """transformers' optimized FP8 route on the CPU too (it checks for a GPU of compute capability 8.9; the CPU's
    scaled_mm runs the same matmul), so the reference is what transformers builds on such a GPU."""
    check = CompressedTensorsHfQuantizer.validate_environment

    def validate(self, *args, **kwargs):
        check(self, *args, **kwargs)
        self.use_fp8_kernel = self.quantization_config.use_optimized_inference

    monkeypatch.setattr(CompressedTensorsHfQuantizer, "validate_environment", validate)


def transformers_fp8(folder, **kwargs):
    settings = CompressedTensorsConfig(use_optimized_inference=True)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=settings, **kwargs).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("strategy, static", [("channel", False), ("tensor", False), ("channel", True)])
def test_from_pretrained_streams_fp8_bytes_and_computes_what_transformers_optimized_load_computes(
    tmp_path, fp8_everywhere, strategy, static
):
    folder = fp8_checkpoint(tmp_path, strategy, static=static)
    reference = transformers_fp8(folder)
    want = generate_with_logits(reference, _ids())
    layer = reference.model.layers[1]
    assert isinstance(layer.mlp.down_proj, CompressedTensorsFP8Linear)
    packed = sum(p.numel() * p.element_size() for p in layer.parameters())
    plan = hf_prefetch.plan(folder, STRIDE, device="cpu")
    assert [s.index for s in plan.rings[0].streamed] == [1, 3]
    assert plan.streamed_bytes_per_forward == 2 * packed  # one byte per weight, float32 row scales, norms
    model = hf_prefetch.from_pretrained(folder, STRIDE, device="cpu")
    try:
        projection = model.model.layers[1].mlp.down_proj
        assert isinstance(projection, CompressedTensorsFP8Linear)
        assert (projection.weight.dtype, projection.weight_scale.dtype) == (torch.float8_e4m3fn, torch.float32)
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, _ids()), want)
        assert hf_prefetch.stats(model).misses == 0 and hf_prefetch.stats(model).copied_bytes > 0
        # compressed-tensors' first-forward decompression (which would strip hf_prefetch's hooks) was never attached.
        assert not hasattr(model, "ct_decompress_hook") and hasattr(model.model.layers[1], "_hf_hook")
        assert not any(type(m._parameters).__module__.startswith("compressed_tensors") for m in model.modules())
        expected = reference.state_dict()
        got = model.state_dict()
        assert set(got) == set(expected)
        for name, value in got.items():
            assert value.dtype == expected[name].dtype and torch.equal(bytes_of(value), bytes_of(expected[name])), name
    finally:
        hf_prefetch.remove_offload(model)


def test_from_pretrained_of_a_model_with_biases_and_ignored_linears_equals_transformers(tmp_path, fp8_everywhere):
    # Qwen2's q/k/v projections have biases (kept in the model's dtype beside the float8 weight); the checkpoint leaves
    # every down_proj dense (`ignore`), which stays a plain Linear.
    folder = fp8_checkpoint(tmp_path, model=tiny_qwen2(num_layers=4), skip="down_proj")
    reference = transformers_fp8(folder)
    attention = reference.model.layers[1].self_attn
    assert isinstance(attention.q_proj, CompressedTensorsFP8Linear) and attention.q_proj.bias is not None
    assert type(reference.model.layers[1].mlp.down_proj) is torch.nn.Linear
    want = generate_with_logits(reference, _ids())
    model = hf_prefetch.from_pretrained(folder, STRIDE, device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids()), want)
        expected = reference.state_dict()
        for name, value in model.state_dict().items():
            assert value.dtype == expected[name].dtype and torch.equal(bytes_of(value), bytes_of(expected[name])), name
    finally:
        hf_prefetch.remove_offload(model)


def test_dispatch_model_streams_transformers_fp8_modules_once_the_decompression_hook_is_removed(
    tmp_path, fp8_everywhere
):
    # transformers' optimized load leaves compressed-tensors' decompression hook on the model: at the first forward
    # it would strip accelerate's hooks (hf_prefetch's) and wrap every module in compressed-tensors' offloading.
    folder = fp8_checkpoint(tmp_path)
    want = generate_with_logits(transformers_fp8(folder), _ids())
    model = transformers_fp8(folder)
    with pytest.raises(ValueError, match=r"ct_decompress_hook.*model\.ct_decompress_hook\.remove\(\)"):
        hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    assert hf_prefetch.get_state(model) is None and not any(hasattr(m, "_hf_hook") for m in model.modules())
    model.ct_decompress_hook.remove()
    del model.ct_decompress_hook
    hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids()), want)
        assert hf_prefetch.stats(model).copied_bytes > 0
    finally:
        hf_prefetch.remove_offload(model)
    assert_same_generation(generate_with_logits(model, _ids()), want)


@pytest.mark.parametrize(
    "bits, strategy, symmetric", [(4, "group", True), (8, "channel", True), (4, "group", False), (4, "channel", False)]
)
def test_from_pretrained_streams_packed_integer_bytes_and_decompresses_them_as_transformers_does(
    tmp_path, bits, strategy, symmetric
):
    # transformers decompresses a pack-quantized model once, at its first forward; hf_prefetch keeps it packed (a
    # quarter or half of bf16's bytes) and runs compressed-tensors' decompression at every forward: bitwise the same.
    from hf_prefetch.formats.compressed_tensors import decompresses

    folder = packed_checkpoint(tmp_path, bits, strategy, symmetric)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = generate_with_logits(reference, _ids())
    plan = hf_prefetch.plan(folder, PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1), device="cpu")
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1))
    try:
        projection = model.model.layers[1].mlp.down_proj
        assert decompresses(projection) and projection.weight_packed.dtype == torch.int32
        assert "weight" not in dict(projection.named_parameters())
        packed = sum(p.numel() * p.element_size() for p in model.model.layers[1].parameters())
        dense = sum(m.weight.numel() * 2 for m in reference.model.layers[1].modules() if hasattr(m, "weight"))
        assert plan.streamed_bytes_per_forward == 2 * packed and packed < (0.4 if bits == 4 else 0.7) * dense
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, _ids()), want)
        assert hf_prefetch.stats(model).misses == 0 and hf_prefetch.stats(model).copied_bytes > 0
        assert not hasattr(model, "ct_decompress_hook")
    finally:
        hf_prefetch.remove_offload(model)
    assert_same_generation(generate_with_logits(model, _ids()), want)  # still packed, still decompressing
    assert_same_generation(generate_with_logits(pickle.loads(pickle.dumps(model)), _ids()), want)
    hf_prefetch.dispatch_model(model, STRIDE, device="cpu")  # and a dispatch takes it again
    try:
        assert_same_generation(generate_with_logits(model, _ids()), want)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_from_pretrained_of_a_packed_mixture_of_experts_checkpoint_equals_transformers(tmp_path, family):
    # transformers' quantizer decompresses the experts while merging them (its DecompressExperts conversion, fed the
    # packed int32 words as stored); the attention linears stay packed and decompress at every forward.
    from hf_prefetch.formats.compressed_tensors import decompresses

    folder = packed_moe_checkpoint(tmp_path, family)
    want = generate_with_logits(AutoModelForCausalLM.from_pretrained(folder).eval(), _ids())
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(prefetch_step=1), device="cpu")
    try:
        assert decompresses(model.model.layers[0].self_attn.q_proj)
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, _ids()), want)
    finally:
        hf_prefetch.remove_offload(model)


def test_from_pretrained_refuses_packed_weights_with_quantized_activations_naming_the_group(tmp_path):
    # W4A8: transformers quantizes each input at every forward, which formats/compressed_tensors.py does not.
    folder = packed_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = activations
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        hf_prefetch.plan(folder, STRIDE, device="cpu")
    message = str(error.value)
    assert "config_groups['group_0'] stores 4-bit symmetric int (group) weights" in message
    assert "input_activations set, output_activations none" in message and message.count("config.json") == 1


@pytest.mark.parametrize(
    "weights, format",
    [
        ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}, "pack-quantized"),
        ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, "int-quantized"),
    ],
)
def test_from_pretrained_refuses_schemes_it_cannot_stream_packed_naming_the_group(tmp_path, weights, format):
    # The first keeps the FP8 checkpoint's quantized input activations (W4A8), the second is another format.
    folder = fp8_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"] = weights
    config["quantization_config"]["format"] = format
    (folder / "config.json").write_text(json.dumps(config))
    for call in (hf_prefetch.from_pretrained, hf_prefetch.plan):
        with pytest.raises(ValueError) as error:
            call(folder, STRIDE, device="cpu")
        message = str(error.value)
        assert "config.json quantization_config.config_groups['group_0']" in message
        assert f"{weights['num_bits']}-bit symmetric int" in message and repr(format) in message
        assert "dispatch_model" in message


@pytest.mark.parametrize(
    "change, named",
    [
        ({"strategy": "block", "block_structure": [32, 32]}, "strategy 'block', symmetric True"),
        ({"symmetric": False}, "strategy 'channel', symmetric False"),
    ],
)
def test_from_pretrained_refuses_fp8_layouts_transformers_fp8_matmul_does_not_take(tmp_path, change, named):
    folder = fp8_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        hf_prefetch.plan(folder, STRIDE, device="cpu")
    message = str(error.value)
    assert message.count("config.json") == 1 and "config_groups['group_0'].weights: " + named in message


def test_from_pretrained_refuses_a_checkpoint_not_stored_compressed_naming_its_status(tmp_path):
    folder = fp8_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["quantization_status"] = "frozen"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_status = 'frozen': the checkpoint's weights are not stored"):
        hf_prefetch.from_pretrained(folder, STRIDE, device="cpu")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_from_pretrained_of_an_fp8_mixture_of_experts_checkpoint_equals_transformers(tmp_path, fp8_everywhere, family):
    # The routers stay dense (`ignore`). Routed experts stream expert by expert; nothing of compressed-tensors'
    # first-forward decompression may wrap the experts module whose forward hf_prefetch replaced.
    from tests.moe_models import moe_model

    folder = fp8_checkpoint(tmp_path, model=moe_model(family).to(torch.bfloat16), skip="mlp.gate")
    want = generate_with_logits(transformers_fp8(folder), _ids())
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(prefetch_step=1), device="cpu")
    try:
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, _ids()), want)
        assert hf_prefetch.stats(model).copied_bytes > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_dispatch_model_refuses_a_model_still_compressed_and_takes_it_once_decompressed_and_unwrapped(tmp_path):
    # transformers' default load keeps the weights compressed until the first forward, which swaps them for dense
    # ones: a dispatch before it would stream tensors about to be replaced.
    folder = fp8_checkpoint(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    before = {name: bytes_of(value).clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj' \(Linear\).*still holds compressed"):
        hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    assert hf_prefetch.get_state(model) is None
    assert not any(hasattr(module, "_hf_hook") for module in model.modules())
    assert all(torch.equal(bytes_of(value), before[name]) for name, value in model.state_dict().items())
    with torch.no_grad():
        model(_ids())  # decompresses
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    want = generate_with_logits(model, _ids())
    # The decompression put compressed-tensors' offloading on every module, which moves tensors itself.
    with pytest.raises(ValueError, match=r"managed by compressed-tensors' offloading.*remove_dispatch"):
        hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    assert hf_prefetch.get_state(model) is None
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(model, onload_tensors=True)
    hf_prefetch.dispatch_model(model, STRIDE, device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids()), want)
    finally:
        hf_prefetch.remove_offload(model)


@pytest.mark.gpu
def test_on_cuda_from_pretrained_of_a_compressed_tensors_fp8_checkpoint_computes_what_transformers_loads(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9")
    folder = fp8_checkpoint(tmp_path)
    reference = transformers_fp8(folder, device_map="cuda")
    assert isinstance(reference.model.layers[1].mlp.down_proj, CompressedTensorsFP8Linear)
    _streams_on_cuda_as(folder, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, strategy, symmetric", [(4, "group", True), (8, "channel", True), (4, "group", False)])
def test_on_cuda_from_pretrained_of_a_packed_checkpoint_computes_what_transformers_decompresses(
    tmp_path, bits, strategy, symmetric
):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = packed_checkpoint(tmp_path, bits, strategy, symmetric)
    # transformers' first forward decompresses its model, on the GPU.
    _streams_on_cuda_as(folder, AutoModelForCausalLM.from_pretrained(folder, device_map="cuda").eval())


@pytest.mark.gpu
@pytest.mark.parametrize("group, dtype", [(32, torch.bfloat16), (128, torch.bfloat16), (64, torch.float16)])
def test_on_cuda_the_fused_4bit_decompression_equals_compressed_tensors_bit_for_bit(group, dtype):
    # Every nibble value at every position of random int32 words, random scales (subnormal to large).
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from hf_prefetch.formats import compressed_tensors as packed_forward

    rows, columns = 96, 4 * group
    generator = torch.Generator().manual_seed(group)
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    module = torch.nn.Linear(columns, rows, bias=False, device="meta")
    del module.weight
    module.weight_packed = torch.nn.Parameter(
        torch.randint(-(2**31), 2**31 - 1, (rows, columns // 8), generator=generator, dtype=torch.int32).cuda(),
        requires_grad=False,
    )
    scale = torch.randn(rows, columns // group, generator=generator) * torch.logspace(-30, 3, columns // group)
    module.weight_scale = torch.nn.Parameter(scale.to(dtype).cuda(), requires_grad=False)
    module.quantization_scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    module.quantization_status = "compressed"
    assert packed_forward.install(module) == 1
    parts = {"weight_packed": module.weight_packed, "weight_scale": module.weight_scale}
    want = PackedQuantizationCompressor.decompress(
        {**parts, "weight_shape": torch.Size((rows, columns))}, module.quantization_scheme
    )["weight"]
    assert packed_forward._unpack_kernel() is not None
    got = packed_forward.dense_weight(module)
    assert got.dtype == want.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


def _streams_on_cuda_as(folder, reference) -> None:
    ids = _ids().cuda()
    want = generate_with_logits(reference, ids)
    model = hf_prefetch.from_pretrained(folder, STRIDE, device="cuda")
    try:
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, ids), want)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_a_gpu_without_fp8_matmuls_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    from hf_prefetch.loading import loader
    from hf_prefetch.loading.checkpoint import Checkpoint
    from hf_prefetch.loading.skeleton import build_skeleton

    folder = fp8_checkpoint(tmp_path)
    with Checkpoint.open(folder) as checkpoint:
        model, _ = build_skeleton(folder, checkpoint, None, None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"cuda:0 has compute capability 8\.0; the FP8 matmuls .* need 8\.9"):
        loader.check_fp8_matmuls(model, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    loader.check_fp8_matmuls(model, torch.device("cuda", 0))
    loader.check_fp8_matmuls(model, torch.device("cpu"))
    # Packed integer weights need no FP8 matmul.
    folder = packed_checkpoint(tmp_path / "packed")
    with Checkpoint.open(folder) as checkpoint:
        model, _ = build_skeleton(folder, checkpoint, None, None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    loader.check_fp8_matmuls(model, torch.device("cuda", 0))


def test_reload_weights_from_another_fp8_checkpoint_writes_its_bytes_and_scales(tmp_path, fp8_everywhere):
    first = fp8_checkpoint(tmp_path / "first")
    second = fp8_checkpoint(tmp_path / "second", model=tiny_llama(4, seed=1, dtype=torch.bfloat16))
    want = generate_with_logits(transformers_fp8(second), _ids())
    model = hf_prefetch.from_pretrained(first, STRIDE, device="cpu")
    try:
        generate_with_logits(model, _ids())  # the slots hold the first checkpoint's layers
        hf_prefetch.reload_weights(model, second)
        assert_same_generation(generate_with_logits(model, _ids()), want)
    finally:
        hf_prefetch.remove_offload(model)
