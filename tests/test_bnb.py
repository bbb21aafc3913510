"""bitsandbytes' 4-bit models (transformers' `BitsAndBytesConfig(load_in_4bit=True)`) stream their packed bytes and
quantization state (scales, code, the scales' own scales with double quantization), and 8-bit ones (`load_in_8bit`)
their int8 values and row scales, never a dequantized copy: the same bits as the same quantized model resident, on
every path that reads or writes the weights. bitsandbytes runs on the CPU, so CI runs the real thing; the GPU test runs
the same on CUDA.

On the CPU a dispatched model computes its 4-bit layers with bitsandbytes' portable kernels (its AVX512-BF16 kernels
repack the weights at the first forward, which a slot would not follow: see hf_prefetch/formats/bnb.py), so the
resident reference here is loaded with those kernels too (`portable=True`)."""

import gc
import weakref

import pytest
import torch

import hf_prefetch
from hf_prefetch import PrefetchConfig
from tests.models import (
    assert_same_generation,
    generate_with_logits,
    prompt,
    rewrite_checkpoint,
    tiny_llama,
    tiny_qwen2,
)

pytest.importorskip("bitsandbytes")
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

CONFIG = PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=2)  # layers 1 and 5 take turns in one slot
SETTINGS = {
    "nf4": dict(bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "fp4": dict(bnb_4bit_quant_type="fp4"),
    "nf4-double": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bnb")
    tiny_llama(6, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    # The GPU tests' bf16 checkpoint (hidden sizes bitsandbytes' CUDA kernels take), saved once.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.models import gpu_llama

    folder = tmp_path_factory.mktemp("bnb-gpu")
    gpu_llama(8).save_pretrained(folder)
    return folder


def _load(folder, setting: str = "nf4", device: str = "cpu", portable: bool = False, **settings):
    config = BitsAndBytesConfig(load_in_4bit=True, **{**SETTINGS[setting], **settings})
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device).eval()
    for module in model.modules():
        if portable and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def _kernels(model) -> dict[str, bool]:
    return {name: m.support_avx512bf16_for_cpu for name, m in model.named_modules() if hasattr(m, "quant_state")}


def _quantized_state(model) -> dict[str, torch.Tensor]:
    # Every tensor of the model, the quantization states' included, by name: what state_dict() would give, without it.
    found = {}
    for name, param in model.named_parameters():
        found[name] = param.data
        state = getattr(param, "quant_state", None)
        if state is not None:
            found |= {f"{name}.absmax": state.absmax, f"{name}.code": state.code}
            if state.nested:
                found |= {f"{name}.offset": state.offset, f"{name}.nested_absmax": state.state2.absmax}
                found[f"{name}.nested_code"] = state.state2.code
    return found


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]) for k in a
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_4bit_layers_stream_their_packed_bytes_and_compute_what_the_resident_model_computes(checkpoint, setting):
    model, resident = _load(checkpoint, setting), _load(checkpoint, setting, portable=True)
    kernels = _kernels(model)
    ids = prompt()
    want = generate_with_logits(resident, ids)
    stored = {name: tensor.clone() for name, tensor in _quantized_state(resident).items()}
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    state = hf_prefetch.get_state(model)
    # What streams is bitsandbytes' storage, never a dequantized copy: the uint8 packed bytes and the states' tensors.
    weight = model.model.layers[1].mlp.up_proj.weight
    parts = {o.inner: o.host for o in state.offloaded if o.param is weight}
    assert parts["data"].dtype == torch.uint8 and parts["data"].numel() == weight.numel()
    assert "absmax" in parts and "quant_map" in parts
    assert ("nested_absmax" in parts) == weight.quant_state.nested
    assert state.plan.offloaded_bytes == sum(o.host.nbytes for o in state.offloaded)
    # Each streamed layer's tensors (every linear's parts, the norms) arrive in one copy of one byte range.
    assert all(layer.span is not None for layer in state.engine.rings[0].layers)
    # The same bits as the resident model, twice (the second run reads every slot again), and the same state_dict.
    assert_same_generation(generate_with_logits(model, ids), want)
    assert_same_generation(generate_with_logits(model, ids), want)
    assert _same(model.state_dict(), resident.state_dict())
    hf_prefetch.remove_offload(model)
    assert _same(_quantized_state(model), stored) and _kernels(model) == kernels
    model.apply(lambda m: setattr(m, "support_avx512bf16_for_cpu", False) if hasattr(m, "quant_state") else None)
    assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_plan_counts_packed_bytes(checkpoint):
    model = _load(checkpoint, "nf4-double")
    layer = model.model.layers[1]
    stored = sum(t.nbytes for t in _quantized_state(layer).values())
    plan = hf_prefetch.plan(model, CONFIG, device="cpu")
    assert plan.rings[0].streamed[0].host_bytes == stored
    # Two 4-bit values per byte: the packed bytes are what the plan counts for a weight's values.
    for name, spec in ((s.name, s) for s in plan.rings[0].streamed[0].params):
        if name.endswith(":data"):
            assert spec.nbytes * 2 == layer.get_parameter(name.partition(":")[0]).quant_state.shape.numel()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_load_state_dict_writes_host_storage_and_the_next_forward_reads_it(checkpoint):
    model, resident = _load(checkpoint), _load(checkpoint, portable=True)
    ids = prompt()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    with torch.no_grad():
        model(ids)  # layer 5 holds the slot now: a load into layer 1 must not write the slot
    norms = [name for name, _ in resident.named_parameters() if name.endswith("post_attention_layernorm.weight")]
    doubled = {name: resident.get_parameter(name).data.clone() for name in norms}
    with torch.no_grad():
        for name, value in doubled.items():
            value.mul_(2)
            resident.get_parameter(name).data.copy_(value)
        # The packed bytes of one streamed weight, edited in place in the resident model and loaded into the other.
        packed = resident.model.layers[1].mlp.up_proj.weight
        packed.data.copy_(torch.flip(packed.data, [0]))
        doubled["model.layers.1.mlp.up_proj.weight"] = packed.data
    model.load_state_dict(doubled, strict=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)
    assert _same(model.state_dict(), resident.state_dict())
    # Its own state_dict loads back (bitsandbytes' portable layout on both sides), and changes nothing.
    model.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)


def _dispatch_interrupted_after(model, monkeypatch, fail_at: str) -> None:
    # A dispatch onto the CPU that a KeyboardInterrupt stops right after attach's step `fail_at` returned.
    from hf_prefetch.lifecycle import attach

    original = getattr(attach, fail_at)

    def interrupted(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(attach, fail_at, interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.dispatch_model(model, CONFIG, device="cpu")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fail_at", ["_report_host_values", "_guard_moves"])
def test_an_interrupted_dispatch_gives_every_tensor_back(checkpoint, monkeypatch, fail_at):

    model, untouched = _load(checkpoint, "nf4-double"), _load(checkpoint, "nf4-double")
    before, kernels = {k: v.clone() for k, v in _quantized_state(model).items()}, _kernels(model)
    _dispatch_interrupted_after(model, monkeypatch, fail_at)
    assert hf_prefetch.get_state(model) is None
    assert _same(_quantized_state(model), before) and _kernels(model) == kernels
    assert "_save_to_state_dict" not in model.model.layers[1].mlp.up_proj.__dict__
    ids = prompt()
    assert torch.equal(model(ids).logits, untouched(ids).logits)  # with gradients: bitsandbytes' portable kernels
    with torch.no_grad():  # without: its CPU kernels where the CPU has them, for both
        assert torch.equal(model(ids).logits, untouched(ids).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "refused",
    [
        dict(max_memory={0: "1KB", "cpu": "1GB"}, reserve_bytes=0),
        dict(offload=hf_prefetch.UVAConfig(cpu_offload_gb=1)),
    ],
)
def test_a_refused_dispatch_changes_nothing(checkpoint, refused):
    model = _load(checkpoint, "nf4-double")
    before, kernels = {k: v.clone() for k, v in _quantized_state(model).items()}, _kernels(model)
    with pytest.raises(ValueError):
        hf_prefetch.dispatch_model(model, device="cpu", **refused)
    assert hf_prefetch.get_state(model) is None
    assert _same(_quantized_state(model), before) and _kernels(model) == kernels


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_plan_is_what_the_dispatch_does(tmp_path):
    tiny_llama(8, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512).save_pretrained(tmp_path)
    for kb in range(700, 2200, 150):
        budget = dict(max_memory={0: kb * 1000, "cpu": "1GB"}, reserve_bytes=0, device="cpu")
        model = _load(tmp_path, "nf4-double")
        try:
            planned = [layer.index for layer in hf_prefetch.plan(model, **budget).rings[0].streamed]
        except ValueError:
            with pytest.raises(ValueError):
                hf_prefetch.dispatch_model(model, **budget)
            continue
        hf_prefetch.dispatch_model(model, **budget)
        assert [layer.index for layer in hf_prefetch.get_state(model).plan.rings[0].streamed] == planned, kb


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_4bit_layers_bias_stays_resident_and_edits_to_it_are_kept(tmp_path):
    # bitsandbytes casts a Linear4bit's bias to the compute dtype by assigning `bias.data`, which a slot would not see.
    tiny_qwen2(num_layers=6).save_pretrained(tmp_path)
    model = _load(tmp_path, bnb_4bit_compute_dtype=torch.float32)
    resident = _load(tmp_path, bnb_4bit_compute_dtype=torch.float32, portable=True)
    hf_prefetch.dispatch_model(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2), device="cpu")
    plan = hf_prefetch.get_state(model).plan
    names = {spec.name for layer in plan.rings[0].streamed for spec in layer.offloaded}
    assert "self_attn.q_proj.weight:data" in names and "self_attn.q_proj.bias" not in names
    ids = prompt()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)
        for m in (model, resident):
            m.model.layers[2].self_attn.q_proj.bias.add_(1.0)
        hf_prefetch.sync_from_device(model)
        assert torch.equal(model(ids).logits, resident(ids).logits)
    assert _same(model.state_dict(), resident.state_dict())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_weights_repacked_for_the_cpu_kernels_are_refused_for_a_gpu(checkpoint):
    from hf_prefetch.formats.bnb import check_layout

    model = _load(checkpoint)
    check_layout(model, torch.device("cuda"))  # as loaded: bitsandbytes' portable layout
    with torch.no_grad():
        model(prompt())  # on a CPU with AVX512-BF16, bitsandbytes repacks the weights here
    if not getattr(model.model.layers[0].mlp.up_proj.weight.quant_state, "packing_format_for_cpu", False):
        pytest.skip("bitsandbytes does not repack on this CPU (no AVX512-BF16)")
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\..*\.weight holds bitsandbytes' CPU layout.*Load the model"
    ):
        check_layout(model, torch.device("cuda"))
    check_layout(model, torch.device("cpu"))  # and streamed as it is on the CPU:
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    resident = _load(checkpoint)
    with torch.no_grad():
        resident(prompt())
        assert torch.equal(model(prompt()).logits, resident(prompt()).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_deleted_model_frees_its_host_storage(checkpoint):
    model = _load(checkpoint)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    host = weakref.ref(hf_prefetch.get_state(model).arena)
    del model
    gc.collect()
    assert host() is None


def _load_8bit(folder, device: str = "cpu", **settings):
    config = BitsAndBytesConfig(load_in_8bit=True, **settings)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device).eval()


def _int8_state(model) -> dict[str, torch.Tensor]:
    # Every 8-bit layer's values and scales, wherever bitsandbytes keeps them (the parameter before its first forward,
    # the module's matmul state after), and every other tensor.
    found = {name: param.data for name, param in model.named_parameters()}
    for name, module in model.named_modules():
        if hasattr(module, "state") and hasattr(module.weight, "SCB"):
            scales = module.weight.SCB if module.weight.SCB is not None else module.state.SCB
            found[f"{name}.SCB"] = scales
            values = module.weight.CB if module.weight.CB is not None else module.state.CB
            assert values is not None and values.data_ptr() == module.weight.data_ptr()  # one tensor, two names
    return found


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "after-a-forward"])
@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_8bit_layers_stream_their_values_and_scales_and_compute_what_the_resident_model_computes(
    checkpoint, ran_before, threshold
):
    model, resident = (_load_8bit(checkpoint, llm_int8_threshold=threshold) for _ in range(2))
    ids = prompt()
    want = generate_with_logits(resident, ids)
    if ran_before:  # bitsandbytes' first forward moves the values and scales into each module's matmul state
        with torch.no_grad():
            model(ids)
        assert model.model.layers[1].mlp.up_proj.weight.SCB is None
    stored = {name: tensor.clone() for name, tensor in _int8_state(model).items()}
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    state = hf_prefetch.get_state(model)
    # What streams is bitsandbytes' storage: the int8 values and the float32 row scales, never a dequantized copy.
    weight = model.model.layers[1].mlp.up_proj.weight
    parts = {o.inner: o.host for o in state.offloaded if o.param is weight}
    assert parts.keys() == {"data", "SCB"} and parts["data"].dtype == torch.int8
    assert parts["SCB"].dtype == torch.float32 and parts["SCB"].shape == (weight.shape[0],)
    assert state.plan.offloaded_bytes == sum(o.host.nbytes for o in state.offloaded)
    for _ in range(2):  # the second run reads every slot again
        assert_same_generation(generate_with_logits(model, ids), want)
    assert _same(model.state_dict(), resident.state_dict())
    hf_prefetch.remove_offload(model)
    # Back as bitsandbytes leaves a freshly quantized layer, with the values and scales it had.
    up = model.model.layers[1].mlp.up_proj
    assert up.state.CB is None and up.weight.CB.data_ptr() == up.weight.data_ptr()
    assert _same(_int8_state(model), stored)
    assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_8bit_load_state_dict_writes_values_and_scales_to_host_storage(checkpoint):
    model, resident = _load_8bit(checkpoint), _load_8bit(checkpoint)
    ids = prompt()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    with torch.no_grad():
        model(ids)  # layer 5 holds the slot now: a load into layer 1 must not write the slot
        up = resident.model.layers[1].mlp.up_proj
        up.weight.data.copy_(torch.flip(up.weight.data, [0]))
        up.weight.SCB.mul_(1.5)
    new = {k: v for k, v in resident.state_dict().items() if k.startswith("model.layers.1.mlp.up_proj.")}
    assert new.keys() >= {"model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.SCB"}
    model.load_state_dict(new, strict=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)
    assert _same(model.state_dict(), resident.state_dict())
    model.load_state_dict(model.state_dict(), strict=False)  # its own state_dict loads back and changes nothing
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fail_at", ["_report_host_values", "_guard_moves"])
def test_an_interrupted_8bit_dispatch_gives_every_tensor_back(checkpoint, monkeypatch, fail_at):

    model, untouched = _load_8bit(checkpoint), _load_8bit(checkpoint)
    ids = prompt()
    with torch.no_grad():
        model(ids), untouched(ids)  # scales in the modules' states: the dispatch moves them onto the parameters
    before = {k: v.clone() for k, v in _int8_state(model).items()}
    states = {name: m.state for name, m in model.named_modules() if hasattr(m, "state")}
    _dispatch_interrupted_after(model, monkeypatch, fail_at)
    assert hf_prefetch.get_state(model) is None
    assert _same(_int8_state(model), before)
    assert all(m.state is states[name] for name, m in model.named_modules() if hasattr(m, "state"))
    assert model.model.layers[1].mlp.up_proj.weight.SCB is None  # as given: in the state
    with torch.no_grad():
        assert torch.equal(model(ids).logits, untouched(ids).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dispatched_8bit_layer_refuses_new_values_in_its_matmul_state(checkpoint):
    model = _load_8bit(checkpoint)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    up = model.model.layers[1].mlp.up_proj
    assert up.state.CB.data_ptr() == up.weight.data_ptr() and up.state.SCB is up.weight.SCB
    assert up.state.threshold == 6.0 and not up.state.has_fp16_weights
    with pytest.raises(RuntimeError, match=r"set the matmul state's CB of an 8-bit layer dispatched by hf_prefetch"):
        up.state.CB = torch.zeros_like(up.weight.data)
    with pytest.raises(RuntimeError, match=r"matmul state's SCB .*after hf_prefetch.remove_offload"):
        up.state.SCB = torch.ones_like(up.weight.SCB)
    with pytest.raises(RuntimeError, match=r"matmul state's CB"):
        up.state.reset_grads()  # bitsandbytes' training path
    up.state.SCB = up.weight.SCB  # what its load_state_dict does: the tensor it reads already


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_checks_for_a_gpu_pass_8bit_layers_by(checkpoint):
    # What a dispatch onto a GPU and a removal onto one ask of a model, asked on the CPU: 8-bit layers have no CPU
    # layout (only 4-bit ones are repacked for bitsandbytes' CPU kernels), so they pass and stay as they are.
    from hf_prefetch.formats import bnb

    model, untouched = _load_8bit(checkpoint), _load_8bit(checkpoint)
    bnb.check_layout(model, torch.device("cuda"))
    bnb.unpack_for(model, torch.device("cuda"))
    assert not any(bnb.repacks_on_cpu(module) for module in model.modules())
    assert _same(_int8_state(model), _int8_state(untouched))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("setting", ["nf4", "nf4-double"])
def test_on_cuda_4bit_layers_stream_and_compute_what_the_resident_model_computes(gpu_checkpoint, setting):
    # Quantized on the GPU both (bitsandbytes' CPU and CUDA quantizers differ in the last bits of double quantization).
    model = _load(gpu_checkpoint, setting, device="cuda").to("cpu")
    resident = _load(gpu_checkpoint, setting, device="cuda")
    ids, want = _streams_on_cuda_as(resident, model)
    hf_prefetch.remove_offload(model)
    assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)
    assert _same(_quantized_state(model), _quantized_state(resident))


def _streams_on_cuda_as(resident, model):
    # `model` dispatched onto the GPU with every layer streamed through 2 slots (or, when it is dispatched already,
    # as it is) generates what `resident` does, twice, and its state_dict (a streamed one's is on the host) is equal.
    ids = prompt(vocab=1024).cuda()
    want = generate_with_logits(resident, ids, max_new_tokens=24)
    if hf_prefetch.get_state(model) is None:
        hf_prefetch.dispatch_model(model, PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2), device="cuda")
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)
    on_host = {key: value.cpu() for key, value in resident.state_dict().items()}
    assert _same({key: value.cpu() for key, value in model.state_dict().items()}, on_host)
    return ids, want


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("origin", ["moved-to-the-cpu", "on-the-gpu"])
def test_on_cuda_8bit_layers_stream_and_compute_what_the_resident_model_computes(gpu_checkpoint, origin):
    # Quantized on the GPU both; dispatched from host memory (as if loaded there) or from the GPU.
    model, resident = _load_8bit(gpu_checkpoint, device="cuda"), _load_8bit(gpu_checkpoint, device="cuda")
    if origin == "moved-to-the-cpu":
        model.to("cpu")
    stored = {name: tensor.cpu() for name, tensor in _int8_state(resident).items()}
    ids, want = _streams_on_cuda_as(resident, model)
    hf_prefetch.remove_offload(model)
    assert _same({k: v.cpu() for k, v in _int8_state(model).items()}, stored)
    assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)


def _saved_quantized(checkpoint, folder, bits: str):
    # A checkpoint saved from a bitsandbytes model (transformers' save_pretrained), and a function that loads it with
    # transformers, quantized as stored, with the kernels a dispatch onto the CPU keeps.
    quantized = _load_8bit(checkpoint) if bits == "8bit" else _load(checkpoint, bits)
    quantized.save_pretrained(folder)
    del quantized

    def reload():
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
        return model

    return reload


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("bits", ["nf4", "fp4", "nf4-double", "8bit"])
def test_from_pretrained_reads_a_prequantized_checkpoints_packed_tensors_and_computes_what_it_computes(
    checkpoint, tmp_path, bits
):
    reload = _saved_quantized(checkpoint, tmp_path, bits)
    resident, dispatched = reload(), reload()
    ids = prompt()
    want = generate_with_logits(resident, ids)
    hf_prefetch.dispatch_model(dispatched, CONFIG, device="cpu")
    model = hf_prefetch.from_pretrained(tmp_path, CONFIG, device="cpu")
    state = hf_prefetch.get_state(model)
    # What streams is what the checkpoint stores (packed bytes, scales), as for the same model loaded by transformers.
    weight = model.model.layers[1].mlp.up_proj.weight
    assert weight.dtype == (torch.int8 if bits == "8bit" else torch.uint8)
    assert {o.inner for o in state.offloaded if o.param is weight} == {
        o.inner
        for o in hf_prefetch.get_state(dispatched).offloaded
        if o.param_name == "model.layers.1.mlp.up_proj.weight"
    }
    assert state.plan.offloaded_bytes == hf_prefetch.get_state(dispatched).plan.offloaded_bytes
    assert hf_prefetch.plan(tmp_path, CONFIG, device="cpu").offloaded_bytes == state.plan.offloaded_bytes
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids), want)
    assert _same(model.state_dict(), resident.state_dict())
    assert getattr(model, "is_loaded_in_8bit" if bits == "8bit" else "is_loaded_in_4bit", False)
    hf_prefetch.remove_offload(model)
    model.apply(lambda m: setattr(m, "support_avx512bf16_for_cpu", False) if hasattr(m, "quant_state") else None)
    assert_same_generation(generate_with_logits(model, ids), want)
    assert _same(model.state_dict(), resident.state_dict())


def _garbage(tensors, key):
    tensors[key] = torch.full_like(tensors[key], 0xFF)


def _swap_settings(tensors):
    # up_proj's and down_proj's packed settings exchanged (each a different shape): every tensor still present.
    up, down = (f"model.layers.1.mlp.{name}.weight.quant_state.bitsandbytes__nf4" for name in ("up_proj", "down_proj"))
    tensors[up], tensors[down] = tensors[down], tensors[up]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "bits, change, message",
    [
        ("nf4", lambda t: t.pop("model.layers.1.mlp.up_proj.weight.absmax"), r"no tensor 'model.layers.1.mlp.up_proj."
         r"weight.absmax' for the bitsandbytes layer Linear4bit"),
        ("nf4", lambda t: _garbage(t, "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"),
         r"'model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4' is not bitsandbytes' packed"),
        ("nf4", lambda t: t.pop("model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"),
         r"the 4-bit layer model.layers.1.mlp.up_proj needs exactly one quantization-state entry"),
        ("8bit", lambda t: t.pop("model.layers.2.self_attn.o_proj.SCB"),
         r"no tensor 'model.layers.2.self_attn.o_proj.SCB'"),
        ("8bit", lambda t: t.update({"model.layers.1.mlp.up_proj.SCB": torch.ones(3)}),
         r"model.layers.1.mlp.up_proj.SCB \(torch.float32, \[3\]\) are not the 8-bit weight of "
         r"model.layers.1.mlp.up_proj, a linear of 64 inputs and 128 outputs"),
        ("8bit", lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.ones(130, 64, dtype=torch.int8),
                                     "model.layers.1.mlp.up_proj.SCB": torch.ones(130)}),
         r"model.layers.1.mlp.up_proj.weight \(torch.int8, \[130, 64\]\)"),
        ("8bit", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_format": torch.tensor(2, dtype=torch.uint8)}),
         r"'model.layers.0.mlp.up_proj.weight_format' \(torch.uint8, shape \[\], value 2\) is not bitsandbytes' "
         r"row-major format 0"),
        ("nf4", lambda t: t.update({"model.layers.1.mlp.up_proj.weight.absmax": torch.zeros(126, dtype=torch.uint8)}),
         r"'model.layers.1.mlp.up_proj.weight.absmax' gives 126 scales where model.layers.1.mlp.up_proj, a 4-bit "
         r"linear of 64 inputs and 128 outputs, needs 128"),
        ("nf4", _swap_settings, r"'model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4' gives \(64, 128\) "
         r"shape where model.layers.1.mlp.up_proj, a 4-bit linear of 64 inputs and 128 outputs, needs \(128, 64\)"),
    ],
    ids=["missing-scales", "damaged-settings", "missing-settings", "missing-8bit-scales", "wrong-8bit-scales",
         "wrong-8bit-rows", "tiled-8bit-layout", "short-4bit-scales", "another-layers-4bit-settings"],
)  # fmt: skip
def test_from_pretrained_refuses_a_damaged_prequantized_checkpoint_naming_the_key(
    checkpoint, tmp_path, bits, change, message
):
    _saved_quantized(checkpoint, tmp_path, bits)
    rewrite_checkpoint(tmp_path, change)
    with pytest.raises(ValueError, match=message):
        hf_prefetch.from_pretrained(tmp_path, CONFIG, device="cpu")


def test_from_pretrained_refuses_an_8bit_checkpoint_of_16bit_training_weights(checkpoint, tmp_path):
    import json

    _saved_quantized(checkpoint, tmp_path, "8bit")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["llm_int8_has_fp16_weight"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config.llm_int8_has_fp16_weight = True: the checkpoint keeps"):
        hf_prefetch.from_pretrained(tmp_path, CONFIG, device="cpu")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_8bit_model_dispatched_again_with_another_config_keeps_computing_the_same(checkpoint):
    model, resident = _load_8bit(checkpoint), _load_8bit(checkpoint)
    ids = prompt()
    want = generate_with_logits(resident, ids)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    assert_same_generation(generate_with_logits(model, ids), want)
    every_layer = PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2)
    hf_prefetch.dispatch_model(model, every_layer, device="cpu", replace=True)
    streamed = {o.param for o in hf_prefetch.get_state(model).offloaded}
    assert model.model.layers[0].mlp.up_proj.weight in streamed
    assert_same_generation(generate_with_logits(model, ids), want)
    assert _same(model.state_dict(), resident.state_dict())


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("bits", ["nf4-double", "8bit"])
def test_on_cuda_from_pretrained_of_a_prequantized_checkpoint_computes_what_transformers_loads(
    gpu_checkpoint, tmp_path, bits
):
    source, folder = gpu_checkpoint, tmp_path / bits
    quantized = _load_8bit(source, device="cuda") if bits == "8bit" else _load(source, bits, device="cuda")
    quantized.save_pretrained(folder)
    del quantized
    resident = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda").eval()
    config = PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2)
    _streams_on_cuda_as(resident, hf_prefetch.from_pretrained(folder, config, device="cuda"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_row_major_8bit_format_stored_in_another_integer_dtype_is_read_as_row_major(checkpoint, tmp_path):
    reload = _saved_quantized(checkpoint, tmp_path, "8bit")
    rewrite_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_format": torch.tensor(0)}))
    ids = prompt()
    want = generate_with_logits(reload(), ids)
    assert_same_generation(
        generate_with_logits(hf_prefetch.from_pretrained(tmp_path, CONFIG, device="cpu"), ids), want
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_resident_8bit_layer_of_a_dispatched_model_copies_and_pickles_as_a_module_of_its_own(checkpoint):
    import copy
    import pickle

    model, resident = _load_8bit(checkpoint), _load_8bit(checkpoint)
    ids = prompt()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    mlp = model.model.layers[0].mlp  # layer 0 stays resident
    assert not any(o.param is mlp.up_proj.weight for o in hf_prefetch.get_state(model).offloaded)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = mlp(x)
    for other in (copy.deepcopy(mlp), pickle.loads(pickle.dumps(mlp))):
        with torch.no_grad():
            assert torch.equal(other(x), want)
            for linear in (other.gate_proj, other.up_proj, other.down_proj):
                linear.weight.data.zero_()  # the copy's own values: the dispatched model keeps computing its own
            assert not torch.equal(other(x), want)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, resident(ids).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("bits", ["nf4-double", "8bit"])
def test_torch_save_of_a_dispatched_quantized_models_state_dict_saves_its_host_values(checkpoint, bits):
    # Packed values beside float32 scales in one host arena: each value of the state_dict is saved alone.
    import io

    model, resident = (_load_8bit(checkpoint) if bits == "8bit" else _load(checkpoint, bits) for _ in range(2))
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    saved.seek(0)
    assert _same(torch.load(saved, weights_only=False), resident.state_dict())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "after-a-forward"])
def test_a_dispatch_keeps_no_name_of_an_8bit_layers_original_storage(checkpoint, ran_before):
    # bitsandbytes names an 8-bit layer's values twice (weight.data and weight.CB, or state.CB after a forward) and
    # its scales on the parameter or in the state: once the values are in host storage, none of those names may keep
    # the original storage alive (on a GPU: the device memory a dispatch frees before its pool exists).
    model = _load_8bit(checkpoint)
    if ran_before:
        with torch.no_grad():
            model(prompt())
    up = model.model.layers[1].mlp.up_proj  # streamed
    names = [up.state.CB, up.state.SCB] if ran_before else [up.weight.CB, up.weight.SCB]
    originals = [weakref.ref(tensor) for tensor in names]
    del names
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    gc.collect()
    assert all(original() is None for original in originals)
    ids = prompt()
    want = generate_with_logits(_load_8bit(checkpoint), ids)
    assert_same_generation(generate_with_logits(model, ids), want)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_plan_counts_an_8bit_layers_scales_before_and_after_a_forward(checkpoint):
    # After a forward bitsandbytes keeps the scales in the module's state: the plan's model and resident bytes count
    # them there too.
    model = _load_8bit(checkpoint)
    before = hf_prefetch.plan(model, CONFIG, device="cpu")
    with torch.no_grad():
        model(prompt())
    after = hf_prefetch.plan(model, CONFIG, device="cpu")
    assert (after.offloaded_bytes, after.resident_bytes) == (before.offloaded_bytes, before.resident_bytes)
