"""Command lines (demo, example, benchmarks): every flag has help text, and bad values are
argparse usage errors (exit code 2 and a message), not tracebacks."""
import argparse
import importlib.util
from pathlib import Path

import pytest

from benchmarks import attention as bench
from benchmarks import context_parallel as cp_bench
from benchmarks import packed as packed_bench
from popxl_flash import demo

_PATH = Path(__file__).resolve().parents[1] / "examples" / "train_causal_self_attention.py"
_spec = importlib.util.spec_from_file_location("train_example_cli", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

MAINS = {"demo": demo.main, "example": example.main, "benchmarks": bench.parse_args,
         "packed": packed_bench.parse_args, "context_parallel": cp_bench.parse_args}


def _parser_of(main, monkeypatch):
    """The ArgumentParser ``main`` builds (its parse_args is intercepted)."""
    captured = {}

    def spy(self, *args, **kwargs):
        captured["parser"] = self
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    with pytest.raises(SystemExit):
        main([])
    return captured["parser"]


@pytest.mark.parametrize("name", list(MAINS))
def test_every_flag_has_help(name, monkeypatch):
    parser = _parser_of(MAINS[name], monkeypatch)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags
    missing = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert not missing, f"{name}: flags without help text: {missing}"


BAD = [
    ("demo", ["--seq-len", "0"]), ("demo", ["--groups", "-1"]), ("demo", ["--head-dim", "x"]),
    ("demo", ["--dtype", "bfloat16"]),
    ("example", ["--steps", "0"]), ("example", ["--seq-len", "abc"]),
    ("example", ["--heads", "0"]), ("example", ["--head-dim", "-4"]),
    ("example", ["--lr", "nan"]), ("example", ["--lr", "-1"]), ("example", ["--seed", "-1"]),
    ("example", ["--seq-len", "2"]),  # the default 3 query chunks do not fit
    ("example", ["--num-chunks-kv", "30"]), ("example", ["--device", "gpu"]),
    ("example", ["--attention", "sdpa"]),
    ("benchmarks", ["--warmup", "-1"]), ("benchmarks", ["--repeats", "0"]),
    ("packed", ["--num-seqs", "0"]), ("packed", ["--seq-len", "10", "--num-seqs", "8"]),
    ("packed", ["--chunks", "0"]), ("packed", ["--dtype", "bfloat16"]),
    ("context_parallel", ["--replicas", "0,2"]), ("context_parallel", ["--replicas", "a"]),
    ("context_parallel", ["--seq-len", "100", "--replicas", "8"]),
    ("context_parallel", ["--kv-heads", "3"]), ("context_parallel", ["--gather-steps", "-1"]),
]


@pytest.mark.parametrize("name,argv", BAD, ids=[f"{n}-{' '.join(a)}" for n, a in BAD])
def test_bad_values_are_usage_errors(name, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        MAINS[name](argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_example_sizes_reach_the_layer(monkeypatch, capsys):
    """--batch/--seq-len/--heads/--head-dim/--num-chunks-* are what the example trains with."""
    seen = {}

    def fake_train(steps, **kwargs):
        seen.update(kwargs, steps=steps)
        E = kwargs["hidden"]
        w = example.initial_weights(kwargs["seed"], E)
        return [1.0] * steps, w
    monkeypatch.setattr(example, "train", fake_train)
    example.main(["--steps", "2", "--batch", "3", "--seq-len", "10", "--heads", "4",
                  "--head-dim", "5", "--num-chunks-q", "2", "--num-chunks-kv", "5"])
    assert seen["steps"] == 2
    assert {k: seen[k] for k in ("batch", "seq_len", "hidden", "heads", "num_chunks_q",
                                 "num_chunks_kv")} == dict(batch=3, seq_len=10, hidden=20,
                                                           heads=4, num_chunks_q=2,
                                                           num_chunks_kv=5)
