"""`pagedkv size`, run in-process through `pagedkv.cli.main`."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.cli.size import parse_memory_bytes
from pagedkv.errors import InvalidArgumentError
from pagedkv.sizing.model_config import shipped_config_names


def run_size(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["size", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run_size(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    return json.loads(out)


@pytest.mark.parametrize("name", shipped_config_names())
def test_every_shipped_config_sizes(capsys, name):
    report = run_json(capsys, "--config", name, "--memory", "80GiB", "--max-model-len", "4096")
    assert report["model"] == name
    assert report["num_blocks"] == 80 * 2**30 // report["bytes_per_block"]
    assert report["max_concurrency"] >= 1
    layer_count = sum(group["num_layers"] for group in report["groups"])
    assert layer_count == len({n for g in report["groups"] for n in g["layer_names"]})


def test_llama_numbers(capsys):
    report = run_json(
        capsys, "--config", "llama-3.1-8b", "--memory", "80GiB", "--max-model-len", "32768"
    )
    # 2 × 16 tokens × 8 KV heads × 128 × 2 bytes = 64 KiB a layer, 32 layers a block.
    assert [
        (g["kind"], g["num_layers"], g["block_size"], g["page_size_bytes"])
        for g in report["groups"]
    ] == [("full_attention", 32, 16, 65536)]
    assert report["bytes_per_block"] == 2 * 2**20
    assert report["num_blocks"] == 40960
    assert report["blocks_per_request"] == 2048
    assert report["max_concurrency"] == 20.0
    assert report["token_capacity"] == 655360
    # 40959 usable blocks × 16 tokens, capped by the model's 131072.
    assert report["max_model_len_that_fits"] == 131072


def test_text_output(capsys):
    code, out, err = run_size(
        capsys, "--config", "llama-3.1-8b", "--memory", "80GiB", "--max-model-len", "32768"
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "model        llama-3.1-8b (llama), dtype bfloat16 (2 bytes)"
    assert (
        "    0  full_attention              32     16       65536       2048  "
        "layers.[0-31].self_attn" in lines
    )
    assert "num_blocks         40960 (block 0 is the null block)" in lines
    assert "max concurrency    20.00x for 32768-token requests" in lines


def test_gemma3_hybrid_groups(capsys):
    report = run_json(
        capsys, "--config", "gemma-3-12b-it", "--memory", "20GiB", "--max-model-len", "32768"
    )
    assert [g["kind"] for g in report["groups"]] == ["sliding_window"] * 5 + ["full_attention"]
    assert report["groups"][5]["layer_names"] == [
        f"layers.{i}.self_attn" for i in (5, 11, 17, 23, 29, 35, 41, 47)
    ]
    # 8 layers × 2 × 16 × 8 heads × 256 × 2 bytes.
    assert report["bytes_per_block"] == 8 * 131072
    assert report["num_blocks"] == 20480
    # Window 1024 with 8192 in-flight tokens: cdiv(1023 + 8192, 16) + 1 = 577 blocks a group.
    assert [g["blocks_per_request"] for g in report["groups"]] == [577] * 5 + [2048]
    assert report["max_concurrency"] == round(20480 / (5 * 577 + 2048), 4)


def test_jamba_padding_is_reported(capsys):
    report = run_json(
        capsys, "--config", "jamba-v0.1", "--memory", "40GiB", "--max-model-len", "65536"
    )
    attention = report["groups"][-1]
    assert (attention["kind"], attention["block_size"], attention["page_size_bytes"]) == (
        "full_attention",
        80,
        327680,
    )
    assert report["groups"][0]["padded_from_bytes"] == 311296
    assert report["bytes_per_block"] == 4 * 327680


def test_disable_hybrid(capsys):
    report = run_json(
        capsys,
        "--config",
        "gemma-2-9b",
        "--memory",
        "20GiB",
        "--max-model-len",
        "8192",
        "--disable-hybrid",
    )
    assert [(g["kind"], g["num_layers"]) for g in report["groups"]] == [("full_attention", 42)]


def test_defaults_come_from_the_config(capsys):
    report = run_json(capsys, "--config", "qwen3-8b", "--memory", "80GiB", "--dtype", "fp8")
    assert report["max_model_len"] == 40960
    assert report["dtype_bytes"] == 1
    assert report["groups"][0]["page_size_bytes"] == 2 * 16 * 8 * 128


def test_encoder_decoder_needs_a_length(capsys):
    code, out, err = run_size(capsys, "--config", "t5-small", "--memory", "1GiB")
    assert code == 2
    assert (
        err == "pagedkv size: error: shipped config t5-small names no max_position_embeddings: "
        "pass --max-model-len\n"
    )
    report = run_json(
        capsys,
        "--config",
        "t5-small",
        "--memory",
        "1GiB",
        "--max-model-len",
        "512",
        "--max-encoder-len",
        "1024",
    )
    assert [g["blocks_per_request"] for g in report["groups"]] == [32, 64]


def test_not_enough_memory_is_one_line(capsys):
    code, out, err = run_size(
        capsys, "--config", "llama-3.1-8b", "--memory", "1GiB", "--max-model-len", "131072"
    )
    assert (code, out) == (2, "")
    assert err == (
        "pagedkv size: error: not enough KV-cache memory: one request of max_model_len=131072 "
        "needs 17181966336 bytes (16.0 GiB, null block included), but only 1073741824 bytes "
        "(1.0 GiB) are available; the longest max_model_len that fits is 8176\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "nope", "--memory", "1GiB"], "nope: no such file and no shipped config"),
        (["--config", "qwen3-8b", "--memory", "80 parsecs"], "--memory '80 parsecs': expected"),
        (["--config", "qwen3-8b", "--memory", "0GiB"], "must be more than 0 bytes"),
        (["--config", "qwen3-8b", "--memory", "1GiB", "--block-size", "0"], "--block-size must be"),
        (["--config", "qwen3-8b", "--memory", "1GiB", "--dtype", "int4"], "unknown dtype 'int4'"),
    ],
)
def test_errors_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run_size(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("pagedkv size: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_malformed_config_file_names_the_field(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    code, out, err = run_size(capsys, "--config", str(path), "--memory", "1GiB")
    assert code == 2
    assert err == f"pagedkv size: error: {path}: field 'num_attention_heads' is missing\n"


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1073741824", 2**30),
        ("64 kib", 64 * 1024),
        ("2TB", 2 * 10**12),
    ],
)
def test_parse_memory_bytes(text, num_bytes):
    assert parse_memory_bytes(text) == num_bytes


def test_parse_memory_bytes_rejects_garbage():
    with pytest.raises(InvalidArgumentError, match="expected a number"):
        parse_memory_bytes("-5GiB")
