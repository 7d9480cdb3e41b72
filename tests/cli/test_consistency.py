"""One CLI: every command's --help ends with examples, defaults are written one way, a model
config is `--model` everywhere (`size --config` kept), dtypes are spelled alike."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from pagedkv.cli import build_parser, main

COMMANDS = [
    ["simulate"],
    ["size"],
    ["generate"],
    ["router", "serve"],
    ["events", "listen"],
]


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    for word in words:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[word]
    return parser


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_every_help_ends_with_examples_that_parse(words, capsys):
    assert main([*words, "--help"]) == 0
    out = capsys.readouterr().out
    examples = out[out.index("\nexamples:\n") :].splitlines()[2:]
    assert examples, out
    # Each example (continuation lines joined, comments dropped) parses with this parser.
    joined = " ".join(examples).replace("\\ ", " ").split("  pagedkv ")
    for example in filter(None, (line.strip().removeprefix("pagedkv ") for line in joined)):
        args = build_parser().parse_args(shlex.split(example.split("#")[0]))
        assert args.command == words[0]


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_defaults_are_written_one_way(words):
    parser = _subparser(build_parser(), words)
    for action in parser._actions:
        text = action.help or ""
        assert "default:" not in text and "defaults to" not in text, (action.dest, text)
        assert "(default)" not in text and "; default " not in text, (action.dest, text)


def test_size_takes_model_like_simulate_and_generate(capsys):
    args = ("--memory", "80GiB", "--max-model-len", "32768", "--json")
    assert main(["size", "--model", "llama-3.1-8b", *args]) == 0
    by_model = json.loads(capsys.readouterr().out)
    assert main(["size", "--config", "llama-3.1-8b", *args]) == 0  # the older name
    assert json.loads(capsys.readouterr().out) == by_model
    assert by_model["num_blocks"] == 40960


@pytest.mark.parametrize(
    ("spelling", "dtype"),
    [("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16"), ("FP32", "float32")],
)
def test_generate_takes_the_dtype_spellings_size_takes(spelling, dtype):
    argv = ["generate", "--model", "tiny-llama", "--prompt", "1 2", "--dtype", spelling]
    assert build_parser().parse_args(argv).dtype == dtype


def test_generate_refuses_an_unknown_dtype_in_one_line(capsys):
    argv = ["generate", "--model", "tiny-llama", "--prompt", "1 2", "--dtype", "int3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype: invalid choice: 'int3'" in err


def test_routing_options_have_one_name_in_simulate_and_router_serve():
    parse = build_parser().parse_args
    simulate = parse(["simulate", "--routing-policy", "prefix-aware", "--max-load-gap", "2"])
    old = parse(["simulate", "--router", "prefix-aware", "--router-max-load-gap", "2"])
    assert (simulate.router, simulate.router_max_load_gap) == (old.router, old.router_max_load_gap)
    assert (simulate.router, simulate.router_max_load_gap) == ("prefix-aware", 2.0)
    serve = parse(["router", "serve", "--routing-policy", "least-loaded", "--max-load-gap", "2"])
    assert serve.policy == parse(["router", "serve", "--policy", "least-loaded"]).policy
    assert serve.policy == "least-loaded"
