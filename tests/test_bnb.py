"""bitsandbytes' 4-bit models (transformers' `BitsAndBytesConfig(load_in_4bit=True)`) stream their packed bytes and
quantization state (scales, code, the scales' own scales with double quantization), never a dequantized copy: the same
bits as the same quantized model resident, on every path that reads or writes the weights. bitsandbytes runs on the
CPU, so CI runs the real thing; the GPU test runs the same on CUDA."""

import gc
import weakref

import pytest
import torch
from models import assert_same_generation, generate_with_logits, prompt, tiny_llama

import hf_prefetch
from hf_prefetch import PrefetchConfig

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


def _load(folder, setting: str = "nf4", device: str = "cpu"):
    config = BitsAndBytesConfig(load_in_4bit=True, **SETTINGS[setting])
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device).eval()


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
    model, resident = _load(checkpoint, setting), _load(checkpoint, setting)
    ids = prompt()
    want = generate_with_logits(resident, ids)  # its first forward repacks for the CPU kernels, where they run
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
    assert all(o.host.dtype != torch.bfloat16 or o.inner != "data" for o in state.offloaded)
    # Each streamed layer's tensors (every linear's parts, the norms) arrive in one copy of one byte range.
    assert all(layer.span is not None for layer in state.engine.rings[0].layers)
    # The same bits as the resident model, twice (the second run reads every slot again).
    assert_same_generation(generate_with_logits(model, ids), want)
    assert_same_generation(generate_with_logits(model, ids), want)
    # (On the CPU, the resident model's state_dict() unpacks its weights in place, back from the CPU kernels' layout:
    # bitsandbytes' own behaviour, compared last. The streamed model's leaves its tensors as they are.)
    hf_prefetch.remove_offload(model)
    assert _same(_quantized_state(model), stored)
    assert_same_generation(generate_with_logits(model, ids), want)
    assert _same(model.state_dict(), resident.state_dict())


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
    model, resident = _load(checkpoint), _load(checkpoint)
    ids = prompt()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    with torch.no_grad():
        resident(ids)  # repacked for the CPU kernels, as the dispatch did
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
    key = "model.layers.1.mlp.up_proj.weight"  # saved in bitsandbytes' portable layout by both
    assert torch.equal(model.state_dict()[key], resident.state_dict()[key])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_interrupted_dispatch_gives_every_tensor_back(checkpoint, monkeypatch):
    from hf_prefetch import attach

    model, resident = _load(checkpoint, "nf4-double"), _load(checkpoint, "nf4-double")
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")  # packed for the CPU kernels once, as a forward would
    hf_prefetch.remove_offload(model)
    before = {k: v.clone() for k, v in _quantized_state(model).items()}
    original = attach._report_host_values

    def interrupted(*args):
        original(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(attach, "_report_host_values", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    assert hf_prefetch.get_state(model) is None
    assert _same(_quantized_state(model), before)
    assert "_save_to_state_dict" not in model.model.layers[1].mlp.up_proj.__dict__
    with torch.no_grad():  # bitsandbytes' CPU kernels: see docs/api.md ("bitsandbytes")
        ids = prompt()
        assert torch.equal(model(ids).logits, resident(ids).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_deleted_model_frees_its_host_storage(checkpoint):
    model = _load(checkpoint)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    host = weakref.ref(hf_prefetch.get_state(model).arena)
    del model
    gc.collect()
    assert host() is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_8bit_layers_are_refused_before_anything_changes(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
    )
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.self_attn\.q_proj\.weight is a quantized tensor \(Int8Params, "
        r"quantization method 'bitsandbytes'\).*not bitsandbytes' 8-bit ones",
    ):
        hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    assert hf_prefetch.get_state(model) is None
    assert all(p.data_ptr() == before[name] for name, p in model.named_parameters())


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("setting", ["nf4", "nf4-double"])
def test_on_cuda_4bit_layers_stream_and_compute_what_the_resident_model_computes(tmp_path, setting):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from models import gpu_llama

    gpu_llama(8).save_pretrained(tmp_path)
    # Quantized on the GPU both (bitsandbytes' CPU and CUDA quantizers differ in the last bits of double quantization).
    model, resident = _load(tmp_path, setting, device="cuda").to("cpu"), _load(tmp_path, setting, device="cuda")
    ids = prompt(vocab=1024).cuda()
    want = generate_with_logits(resident, ids, max_new_tokens=24)
    config = PrefetchConfig(group_size=1, num_in_group=1, prefetch_step=2)  # every layer streams through 2 slots
    hf_prefetch.dispatch_model(model, config, device="cuda")
    for _ in range(2):
        assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)
    on_host = {key: value.cpu() for key, value in resident.state_dict().items()}  # a streamed one's is on the host
    assert _same({key: value.cpu() for key, value in model.state_dict().items()}, on_host)
    hf_prefetch.remove_offload(model)
    assert_same_generation(generate_with_logits(model, ids, max_new_tokens=24), want)
    assert _same(_quantized_state(model), _quantized_state(resident))
