"""`pdserve bench serve` reads a `vllm bench serve` command line as its own flags mean."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.loadgen.cli import _check_run_args, build_parser


def parsed(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    _check_run_args(parser, args)
    return args


def test_vllms_flags_mean_what_ours_do(tmp_path):
    tokenizer = str(tmp_path)
    ours = parsed(
        "serve", "--base-url", "http://127.0.0.1:8000", "--model", "m", "--tokenizer", tokenizer,
        "--workload", "random", "--random-input-len", "256", "--random-output-len", "128",
        "--num-prompts", "64", "--max-concurrency", "16", "--request-rate", "4",
        "--result-file", str(tmp_path / "r.json"),
    )  # fmt: skip
    vllms = parsed(
        "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", "8000", "--model", "m",
        "--tokenizer", tokenizer, "--endpoint", "/v1/completions", "--dataset-name", "random",
        "--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "64",
        "--max-concurrency", "16", "--request-rate", "4", "--ignore-eos", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "r.json",
    )  # fmt: skip
    keep = ("base_url", "endpoint", "workload", "random_input_len", "random_output_len")
    keep += ("num_prompts", "max_concurrency", "request_rate", "ignore_eos", "result_file")
    assert {k: getattr(vllms, k) for k in keep} == {k: getattr(ours, k) for k in keep}


def test_save_result_without_a_name_takes_vllms_file_name(tmp_path):
    args = parsed(
        "serve", "--backend", "openai-chat", "--model", "/models/SmolLM2", "--tokenizer",
        str(tmp_path), "--max-concurrency", "16", "--save-result", "--result-dir", str(tmp_path),
    )  # fmt: skip
    assert args.endpoint == "chat" and args.base_url == "http://127.0.0.1:8000"
    assert args.result_file.parent == tmp_path
    assert args.result_file.name.startswith("openai-chat-infqps-concurrency16-SmolLM2-")
    assert parsed("serve", "--model", "m", "--tokenizer", str(tmp_path)).result_file is None


def test_vllms_custom_dataset_is_the_jsonl_workload_and_others_are_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi", "output_len": 4}\n')
    args = parsed(
        "serve", "--model", "m", "--dataset-name", "custom", "--dataset-path", str(data),
    )  # fmt: skip
    assert args.workload == "jsonl"
    with pytest.raises(SystemExit):
        parsed("serve", "--model", "m", "--tokenizer", str(tmp_path), "--dataset-name", "sonnet")
    assert Path(args.dataset_path) == data
