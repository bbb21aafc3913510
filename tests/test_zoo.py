"""End to end over many architectures: a dispatched model gives bitwise the logits and `generate()` output of the
unmodified model, with every cache and decoding mode, and the weights come back bit for bit after `remove_offload`.

Every test computes the expected output on the unmodified model first, dispatches, compares with `torch.equal`,
removes the offload and compares again. A row is skipped only when the installed transformers lacks its classes
(the skip reason names them), or, for the CUDA-only rows, when there is no GPU.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from transformers.utils import ModelOutput

import hf_prefetch
from hf_prefetch.planning.layers import segment_matches
from tests.zoo import ARCHS, ARCHS_BY_NAME, Arch, left_padded, prompt

NEW_TOKENS = 8
# 8 layers -> layers 1, 3, 5, 7 stream through 2 slots, so every forward copies into reused slots.
CONFIG = dict(group_size=2, num_in_group=1, prefetch_step=2)
PAD_TOKEN_ID = 0
# The whole table runs on the GPU with HF_PREFETCH_ZOO_DEVICE=cuda (rows that need CUDA always run there).
ZOO_DEVICE = os.environ.get("HF_PREFETCH_ZOO_DEVICE", "cpu")
LEFT_PADDED_LENGTHS = [7, 3, 5, 1]


@dataclass(frozen=True)
class Case:
    """One row: an architecture, the `generate()` options, and whether the prompts are left-padded."""

    arch: str
    generate: dict[str, Any] = field(default_factory=dict)
    left_padded: bool = False
    device: str = "cpu"


def _case(case_id: str, arch: str, *, cuda_only: str | None = None, **kwargs: Any) -> Any:
    marks = []
    if cuda_only is not None:
        marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=cuda_only)]
    return pytest.param(Case(arch, device="cuda" if cuda_only else ZOO_DEVICE, **kwargs), id=case_id, marks=marks)


_OFFLOADED_CACHE_NEEDS_CUDA = (
    "transformers' offloaded KV cache is CUDA-only: Cache.update calls torch.cuda.default_stream, so it fails on "
    "CPU even without hf_prefetch"
)

CASES = [
    # Architectures: greedy decoding, default dynamic cache. MoE rows stream only `experts` (see Arch.offload_params).
    *[_case(arch.name, arch.name) for arch in ARCHS],
    # Caches, with weights offloaded.
    _case("cache-dynamic", "llama", generate={"cache_implementation": "dynamic"}),
    _case("cache-static", "llama", generate={"cache_implementation": "static"}),
    _case("cache-static-t5", "t5", generate={"cache_implementation": "static"}),
    _case(
        "cache-offloaded",
        "llama",
        generate={"cache_implementation": "offloaded"},
        cuda_only=_OFFLOADED_CACHE_NEEDS_CUDA,
    ),
    # With a static cache on CUDA, generate() compiles the forward (transformers' auto-compile).
    _case(
        "cache-static-cuda",
        "llama",
        generate={"cache_implementation": "static"},
        cuda_only="needs a CUDA device (auto-compile runs on CUDA only)",
    ),
    # Decoding modes.
    _case("sample", "llama", generate={"do_sample": True}),
    _case("beam", "llama", generate={"num_beams": 3}),
    _case("left-padded", "llama", left_padded=True),
    _case(
        "scores",
        "llama",
        generate={"output_scores": True, "output_logits": True, "return_dict_in_generate": True},
    ),
    _case("sample-t5", "t5", generate={"do_sample": True}),
    _case("beam-t5", "t5", generate={"num_beams": 3}),
    _case("padded-t5", "t5", left_padded=True),
    _case(
        "beam-scores-bart",
        "bart",
        generate={"num_beams": 3, "output_scores": True, "output_logits": True, "return_dict_in_generate": True},
    ),
]


def _arch(name: str) -> Arch:
    arch = ARCHS_BY_NAME[name]
    reason = arch.missing()
    if reason is not None:
        pytest.skip(reason)
    return arch


def _inputs(arch: Arch, case: Case, device: str) -> dict[str, torch.Tensor]:
    if case.left_padded:
        input_ids, attention_mask = left_padded(LEFT_PADDED_LENGTHS, PAD_TOKEN_ID)
    else:
        input_ids = prompt(batch=2, length=7)
        attention_mask = torch.ones_like(input_ids)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def _forward(model: nn.Module, arch: Arch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if arch.seq2seq:
        inputs = {**inputs, "decoder_input_ids": prompt(batch=inputs["input_ids"].shape[0], length=3, seed=5)}
        inputs["decoder_input_ids"] = inputs["decoder_input_ids"].to(inputs["input_ids"].device)
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model: nn.Module, inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> Any:
    # min_new_tokens: random weights often pick eos at once (BART does); every row decodes all NEW_TOKENS steps.
    torch.manual_seed(1234)  # sampling draws from the global generator
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD_TOKEN_ID, **options
    )


def assert_bitwise(actual: Any, expected: Any, what: str = "output") -> None:
    """`torch.equal` on every tensor of (nested) tuples and model outputs; caches are not compared."""
    from transformers.cache_utils import Cache

    if isinstance(expected, Cache):  # generate()'s `past_key_values` (named `cache` in newer transformers)
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), what
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{what} differs"
    elif isinstance(expected, ModelOutput):
        assert list(actual.keys()) == list(expected.keys()), what
        for key in expected:
            if key != "past_key_values":
                assert_bitwise(actual[key], expected[key], f"{what}.{key}")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise(a, e, f"{what}[{index}]")
    else:
        assert actual == expected, what


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_weights(model: nn.Module, expected: dict[str, torch.Tensor], device: str) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert tensor.device.type == device, name
        assert_bitwise(tensor, expected[name], name)


def _assert_plan(model: nn.Module, arch: Arch) -> None:
    plan = hf_prefetch.get_state(model).plan
    assert len(plan.rings) == (2 if arch.seq2seq else 1)  # a seq2seq model streams its encoder's and decoder's
    for ring in plan.rings:
        # More streamed layers than slots: slots are reused, so each forward copies weights.
        assert len(ring.streamed) > ring.num_slots, ring.path
        for layer in ring.streamed:
            names = [name for name, _ in model.get_submodule(layer.path).named_parameters()]
            # Exactly the parameters matching `offload_params` stream (all of them when it is empty): for MoE rows
            # the experts stream and attention, router and shared experts stay resident.
            expected = {name for name in names if segment_matches(arch.offload_params, name)}
            assert {spec.name for spec in layer.offloaded} == expected, layer.path
            if arch.offload_params:
                assert len(expected) < len(names)


def _tied(model: nn.Module) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("case", CASES)
def test_zoo(case: Case):
    arch = _arch(case.arch)
    model = arch.build().to(case.device)
    inputs = _inputs(arch, case, case.device)
    expected_logits = _forward(model, arch, inputs)
    expected = _generate(model, inputs, case.generate)
    weights = _snapshot(model)
    tied = _tied(model)

    model = hf_prefetch.dispatch_model(
        model, hf_prefetch.PrefetchConfig(offload_params=arch.offload_params, **CONFIG), device=case.device
    )
    _assert_plan(model, arch)
    assert _tied(model) == tied  # GPT-2's lm_head stays tied to its (resident) input embedding
    for _ in range(2):
        assert_bitwise(_forward(model, arch, inputs), expected_logits, "logits")
    copies = hf_prefetch.stats(model).copies
    assert_bitwise(_generate(model, inputs, case.generate), expected, "generate()")
    assert hf_prefetch.stats(model).copies > copies
    # Every layer list runs its layers in order on every pass (the encoder once per generate(), the decoder once per
    # step; beam search reorders the cache, not the layers), so each copy was started ahead of use.
    assert hf_prefetch.stats(model).misses == 0

    hf_prefetch.remove_offload(model)
    assert hf_prefetch.get_state(model) is None
    assert _tied(model) == tied
    _assert_weights(model, weights, case.device)
    assert_bitwise(_forward(model, arch, inputs), expected_logits, "logits after remove_offload")


# Moving or converting a dispatched model is refused: nn.Module._apply would replace the streamed parameters' slot
# tensors with converted copies that no prefetch ever refreshes. The error names remove_offload as the fix.
CONVERSIONS = {
    "to-float16": lambda m: m.to(torch.float16),
    "to-dtype-kwarg": lambda m: m.to(dtype=torch.bfloat16),
    "to-meta": lambda m: m.to("meta"),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "cuda": lambda m: m.cuda(),
    "inner-model-half": lambda m: m.model.half(),
    "streamed-layer-half": lambda m: m.model.layers[1].half(),
    "inside-streamed-layer-half": lambda m: m.model.layers[1].mlp.half(),
    "inside-streamed-layer-double": lambda m: m.model.layers[1].self_attn.q_proj.double(),
}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_conversion_refused(convert):
    arch = _arch("llama")
    model = arch.build()
    inputs = _inputs(arch, Case("llama"), "cpu")
    expected = _forward(model, arch, inputs)
    model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    before = [(name, p.dtype, p.device, p.data_ptr()) for name, p in model.named_parameters()]

    with pytest.raises(RuntimeError, match=r"remove_offload\(model\)"):
        convert(model)

    # Nothing was converted: every parameter keeps its dtype, device and storage (streamed ones their slots).
    assert [(name, p.dtype, p.device, p.data_ptr()) for name, p in model.named_parameters()] == before
    for _ in range(2):
        assert_bitwise(_forward(model, arch, inputs), expected, "logits after the refused conversion")
    assert hf_prefetch.stats(model).misses == 0


def test_convert_after_remove_offload():
    arch = _arch("llama")
    model = arch.build()
    inputs = _inputs(arch, Case("llama"), "cpu")
    converted = copy.deepcopy(model).half()
    expected_logits = _forward(converted, arch, inputs)
    expected = _generate(converted, inputs, {})
    model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    with pytest.raises(RuntimeError, match="remove_offload"):
        model.half()

    # The fix the error gives: remove the offload, convert, dispatch again.
    model = hf_prefetch.remove_offload(model).half()
    model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    streamed = hf_prefetch.get_state(model).plan.rings[0].streamed
    assert {spec.dtype for layer in streamed for spec in layer.offloaded} == {torch.float16}
    assert_bitwise(_forward(model, arch, inputs), expected_logits, "float16 logits")
    assert_bitwise(_generate(model, inputs, {}), expected, "float16 generate()")
    assert hf_prefetch.remove_offload(model) is model
    model.float()  # allowed again once the offload is removed
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _lora(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft")  # a test extra: pip install hf-prefetch[test]
    torch.manual_seed(7)  # the same adapter weights on both models
    # init_lora_weights=False: B is random too, so the adapter changes the output.
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def test_peft_lora_on_dispatched_model():
    pytest.importorskip("peft")
    arch = _arch("llama")
    model = arch.build()
    inputs = _inputs(arch, Case("llama"), "cpu")
    base_logits = _forward(model, arch, inputs)
    reference = _lora(copy.deepcopy(model))
    expected_logits = _forward(reference, arch, inputs)
    expected = _generate(reference, inputs, {})
    assert not torch.equal(expected_logits, base_logits)

    model = hf_prefetch.dispatch_model(model, hf_prefetch.PrefetchConfig(**CONFIG), device="cpu")
    peft_model = _lora(model)
    state = hf_prefetch.get_state(model)
    # The LoRA wrappers sit inside streamed layers; their base layers still read the pool slots.
    offloaded = {o.full_name: o.param for o in state.offloaded}
    path = f"{state.plan.rings[0].streamed[0].path}.self_attn.q_proj"
    assert model.get_submodule(path).base_layer.weight is offloaded[f"{path}.weight"]
    for _ in range(2):
        assert_bitwise(_forward(peft_model, arch, inputs), expected_logits, "LoRA logits")
    assert_bitwise(_generate(peft_model, inputs, {}), expected, "LoRA generate()")
    assert hf_prefetch.stats(model).misses == 0
    with pytest.raises(RuntimeError, match="remove_offload"):
        peft_model.half()  # the PeftModel reaches the guarded model before converting anything
    assert_bitwise(_forward(peft_model, arch, inputs), expected_logits, "LoRA logits after the refused conversion")

    hf_prefetch.remove_offload(model)  # the dispatched transformers model, inside the PeftModel
    assert_bitwise(_forward(peft_model, arch, inputs), expected_logits, "LoRA logits after remove_offload")
