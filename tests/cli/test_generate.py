"""`pagedkv generate`: every mistake is one clear line and exit 2, checked before the model
loads; Ctrl-C exits 130; generation stops at the checkpoint's EOS as transformers' does."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.cli import generate as generate_cli  # noqa: E402
from pagedkv.cli import main  # noqa: E402
from pagedkv.engine.engine import LLMEngine  # noqa: E402
from tests.support.engine import hf_greedy, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch

TINY = ["generate", "--model", "tiny-llama"]


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI gets as far as loading weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("pagedkv.engine.model_runner.load_model", refuse)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prompt", "5,6,256"], "token ids [256] are outside the model's vocabulary [0, 256)"),
        (["--prompt", "5", "--block-size", "0"], "--block-size must be a positive integer, got 0"),
        (["--prompt", "5", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["--prompt", "5", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--prompt", "5", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--prompt", "5", "--num-blocks", "1"], "at least 2 (one is the null block)"),
        (["--prompt", "5,6,7", "--num-blocks", "2", "--block-size", "4"], "needs 5 blocks"),
        (["--prompt", "5", "--device", "bogus"], "--device 'bogus' is not a device"),
        (["--prompt", "5", "--device", "meta"], "runs on cpu, cuda, mps"),
        (["--prompt", "5", "--num-blocks", str(10**12)], "KV blocks need"),
        (["--prompt", "5", "--model", "no-such-model"], "neither a path nor a shipped"),
    ],
)
def test_mistakes_are_one_line_and_exit_2_before_loading(capsys, no_model_load, extra, message):
    code, out, err = run_cli(capsys, TINY + extra)
    assert code == 2 and out == ""
    assert err.startswith("pagedkv generate: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch build has CUDA")
def test_cuda_device_on_a_cpu_build_of_torch(capsys, no_model_load):
    code, _, err = run_cli(capsys, TINY + ["--prompt", "5", "--device", "cuda"])
    assert code == 2
    assert f"this torch build ({torch.__version__}) has no CUDA support" in err


def test_without_torch_the_message_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    code, _, err = run_cli(capsys, TINY + ["--prompt", "5"])
    assert code == 2 and err.count("\n") == 1
    assert "install the [torch] extra, pip install 'pagedkv[torch]'" in err


def test_ctrl_c_during_generation_exits_130_without_a_traceback(capsys, monkeypatch):
    step = LLMEngine.step
    calls = []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 2:  # a real SIGINT, delivered while the engine runs
            os.kill(os.getpid(), signal.SIGINT)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", interrupted_step)
    code, out, err = run_cli(capsys, TINY + ["--prompt", "5,6,7", "--max-tokens", "8"])
    assert code == 130 and len(calls) == 2
    assert err == "pagedkv generate: interrupted\n" and out == ""


def test_generation_stops_at_the_checkpoint_eos_like_transformers(tmp_path, capsys):
    model = tiny_model("llama", seed=4)
    prompt = [7, 8, 9, 10]
    model.generation_config.eos_token_id = None
    free_run = hf_greedy(model, prompt, 8)
    stop_at = next(i for i in range(2, 8) if free_run[i] not in free_run[:i])
    eos = free_run[stop_at]
    model.generation_config.eos_token_id = [eos, 255]  # a list, as Llama 3 checkpoints have
    model.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "7,8,9,10", "--max-tokens", "8"]
    code, out, _ = run_cli(capsys, argv + ["--json"])
    assert code == 0
    (output,) = json.loads(out)["outputs"]
    assert output["output_token_ids"] == free_run[: stop_at + 1]
    assert output["output_token_ids"] == hf_greedy(model, prompt, 8)  # transformers stops too
    assert output["finish_reason"] == "stop"
    code, out, _ = run_cli(capsys, argv + ["--json", "--ignore-eos"])
    (output,) = json.loads(out)["outputs"]
    assert output["output_token_ids"] == free_run and output["finish_reason"] == "length"


def test_device_check_accepts_the_cpu():
    assert generate_cli.check_device(torch, "cpu") == torch.device("cpu")
