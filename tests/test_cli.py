"""The command line (`hf-prefetch plan|generate|bench`, `python -m hf_prefetch`) on tiny local checkpoints."""

import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import hf_prefetch
from hf_prefetch.cli import flags, main
from tests.models import tiny_llama

WORDS = "the a cat dog sat on mat and ran to house tree big small red blue green one two three".split()
WORDS += [f"w{i}" for i in range(128 - 3 - len(WORDS))]  # the tiny model's 128 ids


def _save_tokenizer(folder) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_checkpoint")
    model = tiny_llama(6, eos_token_id=None)
    model.save_pretrained(folder, max_shard_size="200KB")
    _save_tokenizer(folder)
    return folder, model


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_table_of_a_folder_without_loading(checkpoint, capsys):
    folder, model = checkpoint
    code, out, err = _run(
        capsys, "plan", folder, "--max-memory", "0=700KiB,cpu=1GiB", "--reserve", "0", "--device", "cpu"
    )
    assert code == 0, err
    expected = hf_prefetch.plan(folder, max_memory={0: "700KiB", "cpu": "1GiB"}, reserve_bytes=0, device="cpu")
    assert out.strip() == str(expected).strip()
    assert "to fit the budget" in out and "700.0 KiB (max_memory[0])" in out


def test_plan_takes_the_group_pattern_and_segments(checkpoint, capsys):
    folder, _ = checkpoint
    argv = ["plan", folder, "--group-size", "3", "--num-in-group", "2", "--prefetch-step", "2", "--device", "cpu"]
    code, out, err = _run(capsys, *argv, "--offload-params", "mlp,self_attn.o_proj")
    assert code == 0, err
    config = hf_prefetch.PrefetchConfig(
        group_size=3, num_in_group=2, prefetch_step=2, offload_params={"mlp", "self_attn.o_proj"}
    )
    assert out.strip() == str(hf_prefetch.plan(folder, config, device="cpu")).strip()


def test_generate_streams_the_same_tokens_as_transformers(checkpoint, capsys):
    folder, model = checkpoint
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    ids = tokenizer("the cat sat on", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True)
    argv = ["generate", folder, "--prompt", "the cat sat on", "--max-new-tokens", "8", "--device", "cpu"]
    code, out, err = _run(capsys, *argv, "--group-size", "2")
    assert code == 0, err
    assert out.strip() == expected.strip()
    assert "8 tokens" in err and "s/token" in err and "CPU execution: copies are synchronous" in err


def test_bench_prints_seconds_per_token(checkpoint, capsys):
    folder, _ = checkpoint
    code, out, err = _run(capsys, "bench", folder, "--rounds", "1", "--tokens", "4", "--device", "cpu")
    assert code == 0, err
    lines = out.splitlines()
    assert "GB streamed per decoded token on cpu" in lines[0]
    assert "CPU execution" in lines[1]
    header, row = lines[2].split(), lines[3].split()
    assert header == ["s/token", "bound", "x", "bound", "misses"]
    assert float(row[0]) > 0 and row[1] == "-" and row[-1] == "0"


def test_module_entry_point_and_help(checkpoint, capsys):
    entry = [sys.executable, "-m", "hf_prefetch", "--help"]
    result = subprocess.run(entry, capture_output=True, text=True, check=True)
    assert "usage: hf-prefetch" in result.stdout
    for command in (["plan"], ["generate"], ["bench"]):  # the same parser, in this process
        assert main([*command, "--help"]) == 0
        assert f"usage: hf-prefetch {command[0]}" in capsys.readouterr().out
    folder, _ = checkpoint
    result = subprocess.run(
        [sys.executable, "-m", "hf_prefetch", "plan", str(folder), "--device", "cpu"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "streamed layers" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "{missing}"], "no such folder, and not a Hub id (org/name)"),
        (["plan", "{file}"], "not a folder"),
        (["plan", "{empty}"], "no config.json in this folder"),
        (["plan", "{config_only}"], "no *.safetensors weights"),
        (["plan", "{folder}", "--max-memory", "0:10GiB"], "'0:10GiB' is not DEVICE=SIZE"),
        (["plan", "{folder}", "--max-memory", "gpu=10GiB"], "'gpu' is not a device"),
        (["plan", "{folder}", "--max-memory", "0=ten GiB", "--device", "cpu"], "ten GiB"),
        (["plan", "{folder}", "--offload-params", "nothing", "--device", "cpu"], "matched no parameter"),
        (
            ["plan", "{folder}", "--dtype", "foo", "--device", "cpu"],
            "--dtype foo must be a floating-point torch.dtype",
        ),
        (["plan", "{folder}", "--device", "tpu"], "--device tpu is not a device"),
        (["plan", "{folder}", "--reserve", "1GiB"], "--reserve 1GiB is only used with a memory budget; pass --max"),
        (["plan", "{folder}", "--max-memory", "0=1GiB", "--group-size", "3"], "--max-memory chooses the streamed"),
        (["plan", "{folder}", "--revision", "v1"], "--revision v1 reads a Hub id, but"),
        (["plan", "{folder}", "--model-class", "Nope"], "--model-class 'Nope' is not a transformers model class"),
        (["plan", "{folder}", "--model-class", "os"], "an Auto class such as AutoModelForCausalLM"),
        (
            ["generate", "{folder}", "--prompt", "x", "--model-class", "LlamaModel"],
            "LlamaModel (from --model-class) does not generate text",
        ),
        (["plan", "{bad_json}"], "config.json is not valid JSON"),
        (["plan", "{json_list}"], "config.json holds a JSON list"),
        (["plan", ""], "empty string"),
        (["plan", "~no_such_user_hf_prefetch/x"], "no such folder"),
        (["plan", "{folder}", "--max-memory", "0=10GiB,0=5GiB"], "names '0' twice"),
        (["plan", "{folder}", "--max-memory", "\u00b2=1GiB"], "is not a device"),
        (["plan", "{folder}", "--offload-params", ",,,"], "names no segment"),
        (["generate", "{bad_json}", "--prompt", "x"], "config.json is not valid JSON"),
        (["generate", "{no_tokenizer}", "--prompt", "x"], "no tokenizer could be loaded"),
        (["generate", "{folder}", "--prompt", "", "--device", "cpu"], "--prompt '' gives no tokens"),
    ],
)
def test_bad_input_is_a_clear_error_with_status_2(checkpoint, tmp_path, capsys, argv, message):
    folder, _ = checkpoint
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((folder / "config.json").read_text())
    for name, text in (("bad_json", "{not json"), ("json_list", "[1, 2]"), ("no_tokenizer", None)):
        (tmp_path / name).mkdir()
        config = (folder / "config.json").read_text() if text is None else text
        (tmp_path / name / "config.json").write_text(config)
        for weights in folder.glob("*.safetensors*"):
            (tmp_path / name / weights.name).write_bytes(weights.read_bytes())
    paths = dict(
        bad_json=tmp_path / "bad_json",
        json_list=tmp_path / "json_list",
        no_tokenizer=tmp_path / "no_tokenizer",
        missing=tmp_path / "missing",
        file=tmp_path / "file",
        empty=tmp_path / "empty",
        config_only=tmp_path / "config_only",
        folder=folder,
    )
    code, out, err = _run(capsys, *[a.format(**paths) for a in argv])
    assert code == 2 and out == ""
    assert err.startswith(f"hf-prefetch {argv[0]}: error: ") and message in err
    assert "Traceback" not in err


def test_a_gpu_index_is_an_int_device(checkpoint, capsys, monkeypatch):
    import hf_prefetch.cli as cli

    seen = {}
    monkeypatch.setattr(hf_prefetch, "plan", lambda path, config, **options: seen.update(options) or "plan")
    code, out, _ = _run(capsys, "plan", checkpoint[0], "--device", "0")
    assert code == 0 and seen["device"] == 0 and out.strip() == "plan"
    assert cli.parse_budget("0=1GiB, cpu = 2GiB") == {0: "1GiB", "cpu": "2GiB"}


def test_argument_errors_return_argparse_status(capsys):
    assert main(["bench", "somewhere", "--rounds", "0"]) == 2
    assert "--rounds: 0 must be at least 1" in capsys.readouterr().err
    assert main(["plan"]) == 2  # a missing argument
    assert "the following arguments are required: path" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "usage: hf-prefetch" in capsys.readouterr().out


def test_links_reach_the_library_and_wrong_ones_are_errors(checkpoint, capsys, monkeypatch):
    import hf_prefetch.cli as cli

    seen = {}
    monkeypatch.setattr(hf_prefetch, "plan", lambda path, config, **options: seen.update(options) or "plan")
    for given, passed in (("all", "all"), ("0,1", [0, 1]), (" 1 , 0 ", [1, 0])):
        code, _, err = _run(capsys, "plan", checkpoint[0], "--links", given)
        assert code == 0 and seen["links"] == passed, err
    assert cli.parse_links(None) is None
    code, out, err = _run(capsys, "plan", checkpoint[0], "--links", "0,cuda")
    assert code == 2 and out == "" and "--links '0,cuda': give 'all' or GPU indices" in err
    monkeypatch.undo()
    code, out, err = _run(capsys, "plan", checkpoint[0], "--links", "0,1", "--device", "cpu")
    assert code == 2 and "--links 0,1 spreads copies over several GPUs' host links" in err
    assert "Traceback" not in err


def test_compress_reaches_the_plan_and_the_tokens(tmp_path, capsys):
    # Projections of 16384 elements and more: large enough to be compressed (codec.MIN_NUMEL).
    model = tiny_llama(4, hidden_size=128, intermediate_size=256, eos_token_id=None, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    options = ["--group-size", "2", "--prefetch-step", "1", "--device", "cpu"]
    code, out, err = _run(capsys, "plan", tmp_path, *options, "--compress")
    assert code == 0, err
    config = hf_prefetch.PrefetchConfig(group_size=2, prefetch_step=1, compress=True)
    expected = hf_prefetch.plan(tmp_path, config, device="cpu")
    assert expected.compressed_bytes[0] > 0 and out.strip() == str(expected).strip()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    ids = tokenizer("the cat sat on", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    argv = ["generate", tmp_path, "--prompt", "the cat sat on", "--max-new-tokens", "6", *options, "--compress"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert out.strip() == tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_cpu_experts_reaches_the_plan_and_its_errors_name_the_flag(tmp_path, capsys):
    from tests.moe_models import moe_model

    moe_model("qwen3_moe").save_pretrained(tmp_path)
    options = ["--group-size", "2", "--prefetch-step", "1", "--device", "cpu"]
    code, out, err = _run(capsys, "plan", tmp_path, *options, "--cpu-experts", "true")
    assert code == 0, err
    expected = hf_prefetch.plan(tmp_path, hf_prefetch.PrefetchConfig(group_size=2, prefetch_step=1, cpu_experts=True))
    assert "experts on host" in out and out.strip() == str(expected).strip()
    code, out, err = _run(capsys, "plan", tmp_path, *options, "--cpu-experts", "maybe")
    assert code == 2 and "invalid choice: 'maybe'" in err
    llama = tmp_path / "llama"
    tiny_llama(2).save_pretrained(llama)
    code, out, err = _run(capsys, "plan", llama, "--device", "cpu", "--cpu-experts", "auto")
    assert code == 2 and "PrefetchConfig(--cpu-experts auto): the model has no routed experts" in err, err


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_prequantized_bitsandbytes_checkpoint_plans_and_generates_what_transformers_loads(tmp_path, capsys):
    # The command line reads a checkpoint saved from an 8-bit model as stored, like from_pretrained.
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama(6, eos_token_id=None, dtype=torch.bfloat16).save_pretrained(tmp_path / "plain")
    quantized = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=quantized, device_map="cpu")
    model.save_pretrained(tmp_path / "8bit")
    tokenizer = _save_tokenizer(tmp_path / "8bit")
    resident = AutoModelForCausalLM.from_pretrained(tmp_path / "8bit", device_map="cpu").eval()
    ids = tokenizer("the cat sat on", return_tensors="pt").input_ids
    with torch.no_grad():
        want = resident.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    options = ["--group-size", "2", "--device", "cpu"]
    code, out, err = _run(capsys, "plan", tmp_path / "8bit", *options)
    assert code == 0, err
    config = hf_prefetch.PrefetchConfig(group_size=2)
    assert out.strip() == str(hf_prefetch.plan(tmp_path / "8bit", config, device="cpu")).strip()
    argv = ["generate", tmp_path / "8bit", "--prompt", "the cat sat on", "--max-new-tokens", "6", *options]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert out.strip() == tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_library_messages_name_the_flags():
    assert flags("reserve_bytes='1x' is not a size; pass max_memory too, e.g. max_memory={0: '10GiB', 'cpu': "
                 "'64GiB'} or max_memory='auto'.") == (
        "--reserve 1x is not a size; pass --max-memory too, e.g. --max-memory 0=10GiB,cpu=64GiB or --max-memory auto."
    )  # fmt: skip
    assert flags("max_memory['cpu']='ten GiB' is not a size") == "--max-memory cpu=ten GiB is not a size"
    assert flags("max_memory[0] = 1.00 GiB leaves nothing after reserve_bytes = 1.00 GiB") == (
        "--max-memory 0 = 1.00 GiB leaves nothing after --reserve = 1.00 GiB"
    )
    assert flags("Stream more layers than prefetch_step (or lower prefetch_step)") == (
        "Stream more layers than --prefetch-step (or lower --prefetch-step)"
    )
    assert flags("pass model_class=transformers.AutoModelForSeq2SeqLM") == "pass --model-class AutoModelForSeq2SeqLM"
    assert flags("with routed_experts=False, or compress=True") == "with --no-routed-experts, or --compress"
    assert flags("config.group_size and hf_prefetch.dispatch_model(model, links=[0, 1])") == (
        "config.group_size and hf_prefetch.dispatch_model(model, --links 0,1)"
    )  # a name in code is left alone, an argument in it is named as its flag


def test_warnings_are_the_commands_own_lines(tmp_path, capsys):
    # Two layers, one streamed through one slot: the library warns that the pool saves nothing.
    tiny_llama(2, eos_token_id=None).save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    argv = ["generate", tmp_path, "--prompt", "the cat", "--max-new-tokens", "2", "--device", "cpu"]
    code, out, err = _run(capsys, *argv, "--group-size", "2")
    assert code == 0, err
    warning = [line for line in err.splitlines() if "saves no device memory" in line]
    assert warning and warning[0].startswith("hf-prefetch generate: warning: This dispatch saves no device memory")
    assert "--prefetch-step" in warning[0] and "UserWarning" not in err and ".py:" not in err
    result = subprocess.run(
        [sys.executable, "-m", "hf_prefetch", *map(str, argv), "--group-size", "2"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "hf-prefetch generate: warning: This dispatch" in result.stderr
    assert "UserWarning" not in result.stderr and "__main__.py" not in result.stderr, result.stderr


def test_bench_says_what_it_measured_in_words(checkpoint, capsys):
    code, out, err = _run(capsys, "bench", checkpoint[0], "--rounds", "1", "--tokens", "8", "--device", "cpu")
    assert code == 0, err
    assert out.splitlines()[-1] == (
        "(s/token: the median of 1 round, each the time of decoding 8 tokens less decoding 2, per token between "
        "them; greedy)"
    )
    code, out, err = _run(capsys, "bench", checkpoint[0], "--rounds", "2", "--tokens", "1", "--device", "cpu")
    assert code == 0 and out.splitlines()[-1].startswith("(s/token: the median of 2 rounds, each the time of "
                                                         "decoding 1 token, the prompt included")  # fmt: skip


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("cli_t5")
    torch.manual_seed(0)
    config = T5Config(
        d_model=32, d_ff=64, num_layers=4, num_heads=2, d_kv=16, vocab_size=128, eos_token_id=None,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)  # transformers' initialisation makes a tiny T5 repeat token 0
    model.save_pretrained(folder)
    return folder, model, _save_tokenizer(folder)


def test_a_seq2seq_checkpoint_plans_and_generates_with_the_class_its_config_names(t5, capsys):
    from transformers import AutoModelForSeq2SeqLM

    folder, model, tokenizer = t5
    code, out, err = _run(capsys, "plan", folder, "--group-size", "2", "--device", "cpu")
    assert code == 0, err
    config = hf_prefetch.PrefetchConfig(group_size=2)
    expected = hf_prefetch.plan(folder, config, device="cpu", model_class=AutoModelForSeq2SeqLM)
    assert out.strip() == str(expected).strip()
    ids = tokenizer("the cat sat on", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    argv = ["generate", folder, "--prompt", "the cat sat on", "--max-new-tokens", "8", "--device", "cpu"]
    code, out, err = _run(capsys, *argv, "--group-size", "2")
    assert code == 0, err
    assert out.strip() == tokenizer.decode(want[0], skip_special_tokens=True).strip()
    code, out, err = _run(capsys, *argv, "--model-class", "AutoModelForCausalLM")
    assert code == 2 and "pass --model-class AutoModelForSeq2SeqLM" in err, err
    code, out, err = _run(capsys, *argv, "--group-size", "2", "--model-class", "T5ForConditionalGeneration")
    assert code == 0 and out.strip() == tokenizer.decode(want[0], skip_special_tokens=True).strip(), err


def test_a_hub_id_plans_and_generates_from_the_cache(checkpoint, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    from tests.loading.test_hub import COMMIT, cache_repo

    folder, model = checkpoint
    cache = tmp_path / "hf_cache"
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setenv(name, str(value) if name == "HF_HUB_CACHE" else "1")
        monkeypatch.setattr(constants, name, value)
    code, out, err = _run(capsys, "plan", "tiny-org/cli-llama", "--device", "cpu")
    assert code == 2 and out == "" and "'tiny-org/cli-llama' is not a local folder" in err, err
    assert "hf download tiny-org/cli-llama" in err and "Traceback" not in err
    cache_repo(cache, "tiny-org/cli-llama", folder)
    options = ["--group-size", "2", "--device", "cpu"]
    code, out, err = _run(capsys, "plan", "tiny-org/cli-llama", "--revision", COMMIT, *options)
    assert code == 0, err
    assert out.strip() == out_plan_of(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    ids = tokenizer("the cat sat on", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    argv = ["generate", "tiny-org/cli-llama", "--prompt", "the cat sat on", "--max-new-tokens", "6", *options]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert out.strip() == tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True).strip()
    code, out, err = _run(capsys, "plan", "tiny-org/cli-llama", "--revision", "v2", *options)
    assert code == 2 and "revision 'v2' of the Hub model 'tiny-org/cli-llama' is not in the Hugging Face cache" in err
    result = subprocess.run(  # a fresh process: huggingface_hub reads the environment as it is imported
        [sys.executable, "-m", "hf_prefetch", "plan", "tiny-org/cli-llama", *options],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0 and result.stdout.strip() == out_plan_of(folder), result.stderr


def out_plan_of(folder) -> str:
    return str(hf_prefetch.plan(folder, hf_prefetch.PrefetchConfig(group_size=2), device="cpu")).strip()
