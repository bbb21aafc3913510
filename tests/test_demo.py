"""The demo (`python -m hf_prefetch.demo`) runs on CPU and finds hf_prefetch's tokens identical to transformers'."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_prefetch import demo

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_demo_tokens_are_identical(capsys):
    assert demo.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "identical: True" in out
    assert re.search(r"model\.layers\.7\s+streamed", out)  # the plan: every second layer of 8 streams
    assert "misses" in out and "get_state(model) is None -> True" in out


def test_demo_exits_non_zero_when_tokens_differ(capsys, monkeypatch):
    real_greedy, calls = demo.greedy, []

    def greedy(model, prompt, num_tokens):
        calls.append(model)
        tokens = real_greedy(model, prompt, num_tokens)
        return tokens + 1 if len(calls) == 2 else tokens  # the second call decodes the reference: corrupt it

    monkeypatch.setattr(demo, "greedy", greedy)
    assert demo.main(["--device", "cpu", "--layers", "2", "--tokens", "2"]) == 1
    assert "identical: False" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "1"], "--layers 1: need at least 2 layers"),
        (["--tokens", "0"], "--tokens 0: generate at least 1 token"),
    ],
)
def test_demo_rejects_bad_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_demo_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "hf_prefetch.demo", "--device", "cpu", "--layers", "4", "--tokens", "3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "identical: True" in result.stdout
