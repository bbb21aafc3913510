"""The command line (`hf-prefetch plan|generate|bench`, `python -m hf_prefetch`) on tiny local checkpoints."""

import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import hf_prefetch
from hf_prefetch.cli import main
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


def test_module_entry_point_and_help(checkpoint):
    for command in ([], ["plan"], ["generate"], ["bench"]):
        result = subprocess.run(
            [sys.executable, "-m", "hf_prefetch", *command, "--help"], capture_output=True, text=True, check=True
        )
        assert "usage: hf-prefetch" in result.stdout
    folder, _ = checkpoint
    result = subprocess.run(
        [sys.executable, "-m", "hf_prefetch", "plan", str(folder), "--device", "cpu"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "streamed layers" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "{missing}"], "no such folder"),
        (["plan", "{file}"], "not a folder"),
        (["plan", "{empty}"], "no config.json in this folder"),
        (["plan", "{config_only}"], "no *.safetensors weights"),
        (["plan", "{folder}", "--max-memory", "0:10GiB"], "'0:10GiB' is not DEVICE=SIZE"),
        (["plan", "{folder}", "--max-memory", "gpu=10GiB"], "'gpu' is not a device"),
        (["plan", "{folder}", "--max-memory", "0=ten GiB", "--device", "cpu"], "ten GiB"),
        (["plan", "{folder}", "--offload-params", "nothing", "--device", "cpu"], "matched no parameter"),
        (
            ["plan", "{folder}", "--dtype", "foo", "--device", "cpu"],
            "dtype='foo' must be a floating-point torch.dtype",
        ),
        (["plan", "{folder}", "--device", "tpu"], "device='tpu' is not a device"),
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
    assert code == 2 and "links=[0, 1] spreads copies over several GPUs' host links" in err
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
