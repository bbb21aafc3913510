"""MXFP4 checkpoints (gpt-oss, `quant_method: "mxfp4"`). transformers without its hub kernels dequantizes the experts
to bf16 at load (`convert_moe_packed_tensors`); `from_pretrained` keeps their blocks and scales packed in host
storage, streams (and routes) the packed bytes, and dequantizes them inside the experts module's forward on the
device: bitwise what transformers' dequantized model computes."""

import json
import pickle

import pytest
import torch
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import hf_prefetch
from hf_prefetch import PrefetchConfig
from hf_prefetch.formats import mxfp4
from tests.models import assert_same_generation, bytes_of, generate_with_logits, rewrite_checkpoint
from tests.moe_models import VOCAB, mxfp4_checkpoint

ROUTED = dict(group_size=2, num_in_group=1, prefetch_step=1, routed_max_tokens=4)
EXPERTS = "model.layers.1.mlp.experts"


def _ids(batch: int = 1, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def transformers_dequantized(folder, implementation: str = "eager", **kwargs):
    """transformers' own load of the checkpoint with its experts dequantized to bf16 (its CPU default too)."""
    model = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True), **kwargs)
    model.set_experts_implementation(implementation)
    return model.eval()


def every_byte_and_scale(experts: int = 2, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales in which every row has one of the 256 scales and, across its 16 groups, all 256 bytes."""
    grid = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    rows = torch.stack([torch.stack([grid[(r - g) % 16] for g in range(16)]) for r in range(256)])
    blocks = rows[None].repeat(experts, 1, 1, 1)
    scales = torch.arange(256, dtype=torch.uint8)[None, :, None].repeat(experts, 1, 16)
    blocks[1:] = torch.randint(0, 256, blocks[1:].shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return blocks.to(device), scales.to(device)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def test_the_torch_dequantization_is_transformers_for_every_byte_and_scale_and_for_picked_experts():
    assert mxfp4.FP4_VALUES == tuple(FP4_VALUES)
    blocks, scales = every_byte_and_scale(experts=3)
    want = convert_moe_packed_tensors(blocks, scales)
    got = mxfp4.dense_weight(blocks, scales)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == (3, 512, 256)
    assert torch.equal(_bits(got), _bits(want))
    # A decode's picks (repeated, and an out-of-range sentinel read as the last expert): their rows only.
    picked = mxfp4.dense_weight(blocks, scales, torch.tensor([[2, 0], [2, 7]]))
    for expert in (0, 2):
        assert torch.equal(_bits(picked[expert]), _bits(want[expert]))


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_from_pretrained_streams_routed_packed_experts_and_computes_what_transformers_dequantized_load_does(
    tmp_path, implementation
):
    folder = mxfp4_checkpoint(tmp_path)
    reference = transformers_dequantized(folder, implementation)
    dense = reference.get_submodule(EXPERTS)
    assert type(dense) is GptOssExperts and dense.gate_up_proj.dtype == torch.bfloat16
    want = generate_with_logits(reference, _ids())
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED), device="cpu")
    try:
        model.set_experts_implementation(implementation)
        experts = model.get_submodule(EXPERTS)
        assert mxfp4.dequantizes(experts) and "gate_up_proj" not in dict(experts.named_parameters())
        for proj in mxfp4.PROJECTIONS:
            blocks, scales = getattr(experts, f"{proj}_blocks"), getattr(experts, f"{proj}_scales")
            assert blocks.dtype == scales.dtype == torch.uint8
            # 4.25 bits a weight: half a byte, and a byte per 32 weights.
            assert 8 * (blocks.nbytes + scales.nbytes) == 4.25 * getattr(dense, proj).numel()
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, _ids()), want)
        stats = hf_prefetch.stats(model)
        row_bytes = sum(p.nbytes for p in experts.parameters()) // experts.num_experts
        assert stats.routed_rows > 0 and stats.routed_bytes == stats.routed_rows * row_bytes and stats.misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_the_plan_and_a_decode_count_packed_bytes_and_host_storage_holds_the_checkpoint_bytes(tmp_path):
    folder = mxfp4_checkpoint(tmp_path)
    config = PrefetchConfig(
        group_size=1, prefetch_step=1, offload_params=frozenset({"experts"}), recent_experts=False, routed_max_tokens=4
    )
    plan = hf_prefetch.plan(folder, config, device="cpu")
    model = hf_prefetch.from_pretrained(folder, config, device="cpu")
    try:
        experts = [layer.mlp.experts for layer in model.model.layers]
        packed = sum(p.nbytes for module in experts for p in module.parameters())
        assert plan.streamed_bytes_per_forward == hf_prefetch.get_state(model).plan.streamed_bytes_per_forward
        assert plan.streamed_bytes_per_forward == packed  # every experts module, packed, once a forward
        assert plan.streamed_bytes_per_token * 8 == plan.streamed_bytes_per_forward * 2  # 2 of 8 experts a token
        # The host storage is the checkpoint's bytes: never dequantized on the host.
        from safetensors.torch import load_file

        stored = load_file(folder / "model.safetensors")
        hosts = {o.full_name: o.host for o in hf_prefetch.get_state(model).offloaded}
        assert {name for name in hosts if name.endswith(("_blocks", "_scales"))} == {
            key for key in stored if key.endswith(("_blocks", "_scales"))
        }
        for name, host in hosts.items():
            assert host.dtype == stored[name].dtype and torch.equal(bytes_of(host), bytes_of(stored[name])), name
        state = model.state_dict()
        assert set(state) == set(stored)
        assert all(torch.equal(bytes_of(state[key]), bytes_of(value)) for key, value in stored.items())
        # One decode step: the rows of the experts each layer picked, packed, and nothing else.
        with torch.no_grad():
            out = model(_ids(), use_cache=True)
            hf_prefetch.reset_stats(model)
            model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        stats = hf_prefetch.stats(model)
        row_bytes = packed // len(experts) // experts[0].num_experts
        # The first layer was copied whole at the end of the prefill (the next forward's first copy); each of the
        # three others copies its token's two experts.
        assert stats.routed_rows == 2 * (len(experts) - 1)
        assert stats.copied_bytes == stats.routed_bytes == stats.routed_rows * row_bytes
    finally:
        hf_prefetch.remove_offload(model)


def test_after_removal_the_model_stays_packed_pickles_and_dispatches_again(tmp_path):
    folder = mxfp4_checkpoint(tmp_path)
    want = generate_with_logits(transformers_dequantized(folder), _ids(batch=2))
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED), device="cpu")
    hf_prefetch.remove_offload(model)
    assert model.get_submodule(EXPERTS).gate_up_proj_blocks.dtype == torch.uint8
    assert_same_generation(generate_with_logits(model, _ids(batch=2)), want)
    assert_same_generation(generate_with_logits(pickle.loads(pickle.dumps(model)), _ids(batch=2)), want)
    hf_prefetch.dispatch_model(model, PrefetchConfig(**ROUTED), device="cpu")
    try:
        assert_same_generation(generate_with_logits(model, _ids(batch=2)), want)
        assert hf_prefetch.stats(model).routed_rows > 0
    finally:
        hf_prefetch.remove_offload(model)


def test_save_pretrained_of_a_dispatched_model_writes_the_mxfp4_checkpoint_back(tmp_path):
    from safetensors.torch import load_file

    folder = mxfp4_checkpoint(tmp_path / "stored")
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED), device="cpu")
    try:
        model.save_pretrained(tmp_path / "saved")
    finally:
        hf_prefetch.remove_offload(model)
    stored, saved = load_file(folder / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) == set(stored)
    assert all(torch.equal(bytes_of(saved[key]), bytes_of(value)) for key, value in stored.items())
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"

def test_compiled_forwards_match_transformers_compiled_dequantized_model(tmp_path):
    # Under torch.compile the dequantization is traced with the experts' forward (routed and whole forwards).
    folder = mxfp4_checkpoint(tmp_path)
    reference = torch.compile(transformers_dequantized(folder), mode="default")
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED), device="cpu")
    try:
        model.set_experts_implementation("eager")
        compiled = torch.compile(model, mode="default")
        with torch.no_grad():
            for length in (6, 1):
                ids = _ids(length=length)
                assert torch.equal(compiled(ids).logits, reference(ids).logits)
        assert hf_prefetch.stats(model).routed_rows > 0
    finally:
        hf_prefetch.remove_offload(model)

def _drop(*keys):
    def change(tensors):
        for key in keys:
            del tensors[key]

    return change


def _replace(key, shape, dtype=torch.uint8):
    def change(tensors):
        tensors[key] = torch.zeros(shape, dtype=dtype)

    return change


@pytest.mark.parametrize(
    "change, named",
    [
        (
            _drop(f"{EXPERTS}.down_proj_scales"),
            rf"holds '{EXPERTS}.down_proj_blocks' but not {EXPERTS}.down_proj_scales \(uint8 \[8, 64, 1\]\)",
        ),
        (
            _drop(f"{EXPERTS}.gate_up_proj_blocks"),
            rf"holds '{EXPERTS}.gate_up_proj_scales' but not {EXPERTS}.gate_up_proj_blocks \(uint8 \[8, 64, 2, 16\]\)",
        ),
        (
            _replace(f"{EXPERTS}.gate_up_proj_blocks", (8, 64, 1, 16)),
            rf"'{EXPERTS}.gate_up_proj_blocks' is torch.uint8 \[8, 64, 1, 16\], but GptOssForCausalLM.{EXPERTS}"
            r".gate_up_proj of shape \[8, 64, 64\] stored as MXFP4 needs uint8 \[8, 64, 2, 16\]",
        ),
        (
            _replace(f"{EXPERTS}.down_proj_scales", (8, 64, 1), torch.int8),
            rf"'{EXPERTS}.down_proj_scales' is torch.int8 \[8, 64, 1\], but .* needs uint8 \[8, 64, 1\]",
        ),
        (
            _drop(f"{EXPERTS}.down_proj_blocks", f"{EXPERTS}.down_proj_scales"),
            rf"has neither {EXPERTS}.down_proj_blocks and {EXPERTS}.down_proj_scales nor a dense {EXPERTS}.down_proj",
        ),
    ],
)
def test_a_damaged_mxfp4_checkpoint_is_refused_naming_the_key_before_anything_is_allocated(
    tmp_path, monkeypatch, change, named
):
    from hf_prefetch.loading import filling

    folder = mxfp4_checkpoint(tmp_path)
    rewrite_checkpoint(folder, change)

    def refuse(*args, **kwargs):
        raise AssertionError("a host arena was allocated")

    monkeypatch.setattr(filling, "HostArena", refuse)
    for call in (hf_prefetch.plan, hf_prefetch.from_pretrained):
        with pytest.raises(ValueError, match=named):
            call(folder, PrefetchConfig(**ROUTED), device="cpu")


@pytest.mark.filterwarnings("ignore:This dispatch saves no device memory")
def test_experts_stored_dense_beside_mxfp4_ones_load_as_stored(tmp_path):
    # transformers' modules_to_not_convert: a projection stored in bf16 stays a dense parameter.
    folder = mxfp4_checkpoint(tmp_path)
    dense = transformers_dequantized(folder).get_submodule(EXPERTS).down_proj.detach().clone()

    def change(tensors):
        del tensors[f"{EXPERTS}.down_proj_blocks"], tensors[f"{EXPERTS}.down_proj_scales"]
        tensors[f"{EXPERTS}.down_proj"] = dense

    rewrite_checkpoint(folder, change)
    want = generate_with_logits(transformers_dequantized(folder), _ids())
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED), device="cpu")
    try:
        experts = model.get_submodule(EXPERTS)
        assert experts.down_proj.dtype == torch.bfloat16 and experts.gate_up_proj_blocks.dtype == torch.uint8
        assert_same_generation(generate_with_logits(model, _ids()), want)
    finally:
        hf_prefetch.remove_offload(model)


def test_dequantize_true_in_config_json_is_refused(tmp_path):
    folder = mxfp4_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["dequantize"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config\.dequantize = True asks for the weights dequantized"):
        hf_prefetch.plan(folder, PrefetchConfig(**ROUTED), device="cpu")


@pytest.mark.gpu
def test_on_cuda_the_kernel_equals_transformers_for_every_byte_and_scale_and_for_picked_experts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert mxfp4._dequantize_kernel() is not None
    blocks, scales = every_byte_and_scale(experts=3, device="cuda")
    want = convert_moe_packed_tensors(blocks, scales)
    assert torch.equal(_bits(want.cpu()), _bits(convert_moe_packed_tensors(blocks.cpu(), scales.cpu())))
    assert torch.equal(_bits(mxfp4.dense_weight(blocks, scales)), _bits(want))
    picked = mxfp4.dense_weight(blocks, scales, torch.tensor([[2, 0], [2, 7]], device="cuda"))
    for expert in (0, 2):
        assert torch.equal(_bits(picked[expert]), _bits(want[expert]))
    # gpt-oss-20b's down projection: rows and columns that are not multiples of the kernel's blocks.
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks = torch.randint(0, 256, (4, 2880, 90, 16), generator=generator, device="cuda").to(torch.uint8)
    scales = torch.randint(110, 135, (4, 2880, 90), generator=generator, device="cuda").to(torch.uint8)
    assert torch.equal(_bits(mxfp4.dense_weight(blocks, scales)), _bits(convert_moe_packed_tensors(blocks, scales)))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_on_cuda_a_routed_decode_of_an_mxfp4_checkpoint_computes_what_transformers_dequantized_load_does(
    tmp_path, implementation
):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = mxfp4_checkpoint(tmp_path)
    ids = _ids().cuda()
    want = generate_with_logits(transformers_dequantized(folder, implementation, device_map="cuda"), ids)
    model = hf_prefetch.from_pretrained(folder, PrefetchConfig(**ROUTED), device="cuda")
    try:
        model.set_experts_implementation(implementation)
        for _ in range(2):
            assert_same_generation(generate_with_logits(model, ids), want)
        stats = hf_prefetch.stats(model)
        assert stats.routed_rows > 0 and stats.misses == 0
    finally:
        hf_prefetch.remove_offload(model)
