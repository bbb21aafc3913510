"""diffusers transformers and pipelines (an optional dependency: skipped without diffusers): layer lists found, outputs
bitwise equal to the unmodified model, and diffusers' or accelerate's own offloading refused with the fix."""

import copy

import pytest
import torch

import hf_prefetch

diffusers = pytest.importorskip("diffusers")

CONFIG = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)


def _inputs(spec: dict, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, value in spec.items():
        kind, shape = value[0], value[1]
        if kind == "randn":
            inputs[name] = torch.randn(*shape, generator=generator)
        elif kind == "randint":
            inputs[name] = torch.randint(0, 1000, shape, generator=generator)
        else:
            inputs[name] = value[1]
    return inputs


# Tiny configurations from diffusers' own tests, with four blocks per list: two stream, through one slot.
MODELS = {
    "FluxTransformer2DModel": (  # two lists: transformer_blocks, single_transformer_blocks
        dict(
            patch_size=1,
            in_channels=4,
            num_layers=4,
            num_single_layers=4,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
        ),
        dict(
            hidden_states=("randn", (1, 16, 4)),
            encoder_hidden_states=("randn", (1, 48, 32)),
            pooled_projections=("randn", (1, 32)),
            img_ids=("randn", (16, 3)),
            txt_ids=("randn", (48, 3)),
            timestep=("randn", (1,)),
        ),
        ["transformer_blocks", "single_transformer_blocks"],
    ),
    "WanTransformer3DModel": (
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            text_dim=16,
            freq_dim=256,
            ffn_dim=32,
            num_layers=4,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
        dict(
            hidden_states=("randn", (1, 4, 2, 16, 16)),
            encoder_hidden_states=("randn", (1, 12, 16)),
            timestep=("randint", (1,)),
        ),
        ["blocks"],
    ),
    "SD3Transformer2DModel": (
        dict(
            sample_size=32,
            patch_size=1,
            in_channels=4,
            num_layers=4,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
            pos_embed_max_size=96,
            dual_attention_layers=(),
            qk_norm=None,
        ),
        dict(
            hidden_states=("randn", (2, 4, 32, 32)),
            encoder_hidden_states=("randn", (2, 154, 32)),
            pooled_projections=("randn", (2, 64)),
            timestep=("randint", (2,)),
        ),
        ["transformer_blocks"],
    ),
    "LTXVideoTransformer3DModel": (  # no _no_split_modules: the list of blocks is found by its weight
        dict(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            num_layers=4,
            qk_norm="rms_norm_across_heads",
            caption_channels=16,
        ),
        dict(
            hidden_states=("randn", (2, 512, 4)),
            encoder_hidden_states=("randn", (2, 16, 16)),
            timestep=("randint", (2,)),
            encoder_attention_mask=("value", torch.ones(2, 16, dtype=torch.bool)),
            num_frames=("value", 2),
            height=("value", 16),
            width=("value", 16),
        ),
        ["transformer_blocks"],
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_transformers_stream_their_block_lists_bitwise(name):
    kwargs, spec, lists = MODELS[name]
    torch.manual_seed(0)
    model = getattr(diffusers, name)(**kwargs).eval()
    reference = copy.deepcopy(model)
    inputs = _inputs(spec)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)[0]
    assert hf_prefetch.find_layer_lists(model) == lists
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    try:
        plan = hf_prefetch.get_state(model).plan
        assert [ring.path for ring in plan.rings] == lists and all(ring.streamed for ring in plan.rings)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(**inputs, return_dict=False)[0], expected)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs, return_dict=False)[0], expected)


def _tokenizer(max_length: int):
    """A word-level tokenizer built in memory (no download), as Flux's CLIP and T5 tokenizers are called."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<eos>", "a", "cat", "on", "the", "mat", "photo", "of"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token="<eos>",
        pad_token="<pad>",
        model_max_length=max_length,
    )


def _text_encoders() -> dict:
    """Tiny random CLIP and T5 encoders in the places of Flux's (pooled 32, sequence 32: the tiny transformer's)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    clip = CLIPTextModel(
        CLIPTextConfig(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=4,
            num_attention_heads=4,
            vocab_size=10,
            max_position_embeddings=16,
            eos_token_id=2,
        )
    ).eval()
    t5 = T5EncoderModel(
        T5Config(
            d_model=32, d_kv=8, d_ff=37, num_layers=4, num_heads=4, vocab_size=10, relative_attention_num_buckets=8
        )
    ).eval()
    return dict(text_encoder=clip, text_encoder_2=t5, tokenizer=_tokenizer(16), tokenizer_2=_tokenizer(48))


def _flux_pipeline(text_encoders: bool = False):
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(**MODELS["FluxTransformer2DModel"][0]).eval()
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    encoders = (
        _text_encoders()
        if text_encoders
        else dict.fromkeys(("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"))
    )
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), transformer=transformer, vae=vae, **encoders
    )


def _call(pipe) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    embeds, pooled = torch.randn(1, 48, 32, generator=generator), torch.randn(1, 32, generator=generator)
    return pipe(
        prompt_embeds=embeds,
        pooled_prompt_embeds=pooled,
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=2,
        guidance_scale=5.0,
        height=8,
        width=8,
        output_type="pt",
    ).images


def _call_with_prompt(pipe) -> torch.Tensor:
    return pipe(
        prompt="a photo of a cat on the mat",
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=2,
        guidance_scale=5.0,
        height=8,
        width=8,
        max_sequence_length=48,
        output_type="pt",
    ).images


def _dispatch_pipeline(pipe, device: str) -> list:
    """The transformer and both text encoders dispatched (every 2nd block streamed), the VAE moved."""
    parts = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    for part in parts:
        hf_prefetch.dispatch_model(part, CONFIG, device=device)
    pipe.vae.to(device)
    return parts


def test_a_pipeline_runs_unchanged_with_its_text_encoders_and_transformer_dispatched():
    expected = _call_with_prompt(_flux_pipeline(text_encoders=True))
    pipe = _flux_pipeline(text_encoders=True)
    parts = _dispatch_pipeline(pipe, "cpu")
    try:
        lists = [[ring.path for ring in hf_prefetch.get_state(part).plan.rings] for part in parts[1:]]
        assert [len(paths) for paths in lists] == [1, 1]  # CLIP's (text_model.)encoder.layers, T5's encoder.block
        assert lists[0][0].endswith("encoder.layers") and lists[1][0] == "encoder.block"
        for _ in range(2):
            assert torch.equal(_call_with_prompt(pipe), expected)
        assert all(hf_prefetch.stats(part).misses == 0 for part in parts)
    finally:
        for part in parts:
            hf_prefetch.remove_offload(part)
    assert torch.equal(_call_with_prompt(pipe), expected)


@pytest.mark.gpu
def test_a_pipeline_on_cuda_is_bitwise_with_its_text_encoders_and_transformer_dispatched():
    expected = _call_with_prompt(_flux_pipeline(text_encoders=True).to("cuda"))
    pipe = _flux_pipeline(text_encoders=True)
    parts = _dispatch_pipeline(pipe, "cuda")
    try:
        for _ in range(2):
            assert torch.equal(_call_with_prompt(pipe), expected)
        assert all(hf_prefetch.stats(part).misses == 0 for part in parts)
    finally:
        for part in parts:
            hf_prefetch.remove_offload(part)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_diffusers_transformers_on_cuda_are_bitwise(name):
    kwargs, spec, _ = MODELS[name]
    torch.manual_seed(0)
    model = getattr(diffusers, name)(**kwargs).eval()
    inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in _inputs(spec).items()}
    with torch.no_grad():
        expected = copy.deepcopy(model).to("cuda")(**inputs, return_dict=False)[0]
    hf_prefetch.dispatch_model(model, CONFIG, device="cuda")
    try:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(**inputs, return_dict=False)[0], expected)
        assert hf_prefetch.stats(model).misses == 0
    finally:
        hf_prefetch.remove_offload(model)


def test_a_pipeline_runs_unchanged_with_its_transformer_dispatched():
    expected = _call(_flux_pipeline())
    pipe = _flux_pipeline()
    hf_prefetch.dispatch_model(pipe.transformer, CONFIG, device="cpu")
    try:
        for _ in range(2):
            assert torch.equal(_call(pipe), expected)
        # A pipeline's own conversion would detach the streamed weights: refused, and the pipeline still works.
        with pytest.raises(RuntimeError, match="dispatched by hf_prefetch"):
            pipe.to(torch.float16)
        assert torch.equal(_call(pipe), expected)
    finally:
        hf_prefetch.remove_offload(pipe.transformer)
    assert torch.equal(_call(pipe), expected)


def test_group_offloading_is_refused_before_anything_changes():
    from diffusers.hooks import apply_group_offloading

    pipe = _flux_pipeline()
    apply_group_offloading(
        pipe.transformer,
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
    )
    with pytest.raises(
        ValueError, match=r"diffusers hook that moves or casts its weights \(group_offloading on .*build or load"
    ):
        hf_prefetch.dispatch_model(pipe.transformer, CONFIG, device="cpu")
    assert hf_prefetch.get_state(pipe.transformer) is None
    assert not any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules())


@pytest.mark.parametrize("offload", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
def test_accelerate_cpu_offload_is_refused_with_the_fix(offload):
    pipe = _flux_pipeline()
    getattr(pipe, offload)(device="cpu")
    with pytest.raises(ValueError, match=r"managed by accelerate's CPU offloading .*pipe.remove_all_hooks\(\)"):
        hf_prefetch.dispatch_model(pipe.transformer, CONFIG, device="cpu")
    assert hf_prefetch.get_state(pipe.transformer) is None


def test_remove_offload_refuses_weights_another_offload_took_and_undoes_nothing():
    pipe = _flux_pipeline()
    hf_prefetch.dispatch_model(pipe.transformer, CONFIG, device="cpu")
    pipe.enable_sequential_cpu_offload(device="cpu")  # moves resident weights to the meta device, behind our back
    with pytest.raises(ValueError, match=r"is on the meta device: another offloading mechanism .*Nothing was undone"):
        hf_prefetch.remove_offload(pipe.transformer)
    state = hf_prefetch.get_state(pipe.transformer)
    assert state is not None and state.lifecycle is hf_prefetch.lifecycle.state.Lifecycle.ATTACHED


def test_layerwise_casting_is_refused_before_anything_changes():
    pipe = _flux_pipeline()
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"moves or casts its weights \(layerwise_casting on"):
        hf_prefetch.dispatch_model(pipe.transformer, CONFIG, device="cpu")
    assert hf_prefetch.get_state(pipe.transformer) is None


def test_a_budget_plans_both_block_lists_of_flux_and_measured_block_times_are_accepted():
    kwargs, spec, lists = MODELS["FluxTransformer2DModel"]
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**kwargs).eval()
    inputs = _inputs(spec)
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)[0]
    seconds = hf_prefetch.time_layers(model, **inputs)
    assert sorted(seconds) == sorted(f"{path}.{i}" for path in lists for i in range(4))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    config = hf_prefetch.PrefetchConfig(prefetch_step=1, compute_seconds=seconds)
    budget = {0: int(total * 0.8)}
    plan = hf_prefetch.plan(model, config, max_memory=budget, reserve_bytes=0, device="cpu")
    assert [ring.path for ring in plan.rings] == lists and plan.device_bytes <= budget[0]
    hf_prefetch.dispatch_model(model, config, device="cpu", max_memory=budget, reserve_bytes=0)
    try:
        assert hf_prefetch.get_state(model).plan.rings == plan.rings
        assert any(ring.streamed for ring in plan.rings)
        with torch.no_grad():
            assert torch.equal(model(**inputs, return_dict=False)[0], expected)
    finally:
        hf_prefetch.remove_offload(model)


def _transformer(name: str):
    kwargs, spec, _ = MODELS[name]
    torch.manual_seed(0)
    return getattr(diffusers, name)(**kwargs).eval(), _inputs(spec)


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("name", ["FluxTransformer2DModel", "SD3Transformer2DModel"])
def test_fuse_qkv_projections_of_a_dispatched_transformer_fuses_each_blocks_own_weights(name):
    model, inputs = _transformer(name)
    reference = copy.deepcopy(model)
    reference.fuse_qkv_projections()
    expected, expected_state = _run(reference, inputs), reference.state_dict()
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    _run(model, inputs)  # each slot holds the first of its blocks now
    try:
        model.fuse_qkv_projections()  # one attention module at a time, its weights in place
        for _ in range(2):
            assert torch.equal(_run(model, inputs), expected)
        state = model.state_dict()
        assert state.keys() == expected_state.keys()
        assert all(torch.equal(state[key], value) for key, value in expected_state.items())
    finally:
        hf_prefetch.remove_offload(model)
    assert torch.equal(_run(model, inputs), expected)


def _first_block_cache(model):
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=1e9))  # every call after the first reuses


def _layer_skip(model):
    from diffusers.hooks import LayerSkipConfig, apply_layer_skip

    apply_layer_skip(model, LayerSkipConfig(indices=[1], fqn="transformer_blocks"))  # block 1 streams


@pytest.mark.parametrize("apply", [_first_block_cache, _layer_skip], ids=["first_block_cache", "layer_skip"])
def test_a_forward_set_on_streamed_blocks_after_the_dispatch_stays_after_remove_offload(apply):
    model, inputs = _transformer("FluxTransformer2DModel")
    other = _inputs(MODELS["FluxTransformer2DModel"][1], seed=1)
    reference = copy.deepcopy(model)
    apply(reference)

    def calls(target):
        outputs = []
        for values in (inputs, other):
            with target.cache_context("cond"):
                outputs.append(_run(target, values))
        return outputs

    expected = calls(reference) + calls(reference)
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")
    try:
        apply(model)
        got = calls(model)
    finally:
        hf_prefetch.remove_offload(model)
    got += calls(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    hf_prefetch.dispatch_model(model, CONFIG, device="cpu")  # again, under the forwards set on top
    try:
        assert all(torch.equal(a, b) for a, b in zip(calls(model), calls(reference), strict=True))
    finally:
        hf_prefetch.remove_offload(model)
