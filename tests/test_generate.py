"""Tests of examples/generate.py: greedy generation with the KV cache (prefill, then an
``ops.repeat`` decode loop in one graph) against the same model recomputing the whole sequence
for every token without a cache.
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "examples" / "generate.py"
_spec = importlib.util.spec_from_file_location("generate", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _both(prompt_lens, new_tokens, *, seed=0, dtype="float32", num_splits=None, heads=4,
          kv_heads=2, layers=2):
    sizes = example.Sizes(32, heads, kv_heads, 8, layers)
    weights = example.init_weights(sizes, seed, max(prompt_lens) + new_tokens, dtype)
    prompts, lens = example.random_prompts(prompt_lens, sizes.vocab, seed)
    cached = example.generate(weights, sizes, prompts, lens, new_tokens, num_splits=num_splits)
    recomputed = example.generate_without_cache(weights, sizes, prompts, lens, new_tokens)
    return cached, recomputed


@pytest.mark.parametrize("prompt_lens,new_tokens,options", [
    ((5, 2, 7), 6, {}),
    ((1, 9, 4, 4), 5, dict(seed=3, dtype="float16", num_splits=2)),
    ((3,), 8, dict(seed=1, kv_heads=1, layers=1)),
], ids=["default", "float16-split", "multi-query"])
def test_cached_tokens_equal_full_recompute(prompt_lens, new_tokens, options):
    cached, recomputed = _both(prompt_lens, new_tokens, **options)
    assert cached.shape == (len(prompt_lens), new_tokens)
    np.testing.assert_array_equal(cached, recomputed)
    assert len(np.unique(cached)) > new_tokens // 2  # a model whose tokens depend on the input


def test_main_prints_one_line_per_row(capsys):
    tokens = example.main(["--prompt-lens", "2,3", "--new-tokens", "3", "--layers", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert tokens.shape == (2, 3) and len(lines) == 2
    assert lines[0].startswith("row 0: prompt [") and str(tokens[1].tolist()) in lines[1]


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as err:
        example.parse_args(["--help"])
    assert err.value.code == 0
    text = capsys.readouterr().out
    for option in ("--prompt-lens", "--new-tokens", "--vocab", "--heads", "--kv-heads",
                   "--head-dim", "--layers", "--dtype", "--num-splits", "--no-cache", "--seed",
                   "--device"):
        assert option in text
    parser_actions = text.count("  --")
    assert parser_actions >= 12


@pytest.mark.parametrize("argv", [["--prompt-lens", "0,2"], ["--prompt-lens", "a"],
                                  ["--heads", "3", "--kv-heads", "2"], ["--new-tokens", "0"],
                                  ["--dtype", "bfloat16"], ["--num-splits", "0"]])
def test_bad_arguments_are_argparse_errors(argv):
    with pytest.raises(SystemExit) as err:
        example.parse_args(argv)
    assert err.value.code == 2
