"""Removals of a model loaded with mapped host storage on CUDA: `remove_offload` to the GPU and to the CPU, the
logits before and after compared bitwise with transformers' model on the GPU, and the pinned bytes left. GPU only.

    PYTHONPATH=. python benchmarks/experiments/mapped_removal.py
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_prefetch

config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)  # fmt: skip
cfg = hf_prefetch.PrefetchConfig(group_size=2, num_in_group=1, prefetch_step=1)
ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="1MB")
    reference = AutoModelForCausalLM.from_pretrained(folder).cuda().eval()
    with torch.no_grad():
        expected = reference(ids).logits
    for target in ("cuda", "cpu"):
        model = hf_prefetch.from_pretrained(folder, cfg, device="cuda")
        state = hf_prefetch.get_state(model)
        mapped = state.arena.file_bytes
        with torch.no_grad():
            dispatched = model(ids).logits
        hf_prefetch.remove_offload(model, target)
        model = model.cuda()
        with torch.no_grad():
            after = model(ids).logits
        before_equal, after_equal = torch.equal(dispatched, expected), torch.equal(after, expected)
        print(
            f"removal to {target}: mapped host bytes {mapped}, dispatched equal {before_equal}, "
            f"after removal equal {after_equal}, pinned now {hf_prefetch.host.arena.pinned_bytes()}"
        )
