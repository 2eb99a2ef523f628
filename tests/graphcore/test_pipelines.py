"""Graphcore's model pipelines end to end on the emulator, unmodified and with flash attention
swapped into their attention layer (``flash_llama.py``, ``flash_gptj.py``):

* Llama (``nlp/llama/popxl``): ``api.pipeline.LlamaPipeline`` generating greedily with a small
  random Hugging Face ``LlamaForCausalLM`` (grouped-query heads, tensor parallel 2) and a
  tokenizer built in code, without a cache and with ``use_cache`` (their ``inference.py`` as
  published: the KV-cache remote buffers are read before anything stored to them, which the
  runner's choosing mode reads as zeros, counted and warned), against Hugging Face's greedy
  ``generate`` (``llama_pipeline.py``);
* GPT-J (``nlp/gpt_j/popxl``): ``api.GPTJTrainer`` fine-tuning a small random
  ``GPTJForCausalLM`` for four AdamW steps on synthetic tokens (``gptj_finetune.py``): the
  first loss against Hugging Face's float64 loss of the same batch, flash's losses against the
  naive run's.

Each run is a script under ``python -m popxl_flash.emulator.run`` in Graphcore's folder. Needs
``GRAPHCORE_EXAMPLES_PATH``, ``POPXL_ADDONS_PATH``, ``EXAMPLES_UTILS_PATH`` (see
``graphcore_run.py``), Python below 3.11 (the models' config dataclasses), torch,
transformers (4.31 or later for Llama's grouped-query heads), tokenizers and simple-parsing;
for GPT-J NumPy below 1.24 (their data loader's ``collate_fn`` passes a generator to
``np.stack``, which 1.24 refuses). Skipped with the reason otherwise.
"""
import json
import os
import sys

import numpy as np
import pytest

from graphcore_run import HERE, require_paths, run_emulated

LLAMA_MODES = [("naive", []), ("flash", ["--flash"]), ("naive, use_cache", ["--use-cache"]),
               ("flash, use_cache", ["--use-cache", "--flash"])]


def _needs(model):
    """Skip unless the examples, popxl-addons, examples-utils and the model's Python
    requirements are there. Returns: the model's folder in the examples."""
    if sys.version_info >= (3, 11):
        pytest.skip("the models' config dataclasses have mutable defaults (Python < 3.11)")
    examples, addons, utils = require_paths("GRAPHCORE_EXAMPLES_PATH", "POPXL_ADDONS_PATH",
                                            "EXAMPLES_UTILS_PATH")
    for module in ("torch", "simple_parsing", "tokenizers"):
        pytest.importorskip(module)
    transformers = pytest.importorskip("transformers")
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if model == "llama" and version < (4, 31):
        pytest.skip("Llama's grouped-query heads need transformers 4.31 or later")
    if model == "gpt_j" and tuple(int(p) for p in np.__version__.split(".")[:2]) >= (1, 24):
        pytest.skip("GPT-J's collate_fn passes a generator to np.stack (NumPy < 1.24)")
    cwd = os.path.join(examples, "nlp", model, "popxl")
    return cwd, [cwd, os.path.join(examples, "utils"), addons, utils]


def _result(script, args, cwd, path):
    """Run ``script`` on the emulator; returns its ``RESULT`` json."""
    res = run_emulated([os.path.join(HERE, script), *args], cwd, path, timeout=1800)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mode,args", LLAMA_MODES, ids=[m for m, _ in LLAMA_MODES])
def test_llama_pipeline_generates_hugging_faces_greedy_tokens(mode, args):
    cwd, path = _needs("llama")
    out = _result("llama_pipeline.py", args, cwd, path)
    assert all(out["pipeline"]) and out["pipeline"] == out["hf"], out
    unwritten = [w for w in out["warned"] if "was never written" in w]
    if "use_cache" not in mode:
        assert not out["warned"] and out["unspecified_by_run"] == {}, out
        return
    # their inference.py loads every layer's k and v cache entry before storing it: only the
    # first run reads entries no run wrote (2 layers x k, v x 2 replicas); the first prompt's
    # rows come from zeros the mask hides, as on an IPU from whatever memory held
    assert unwritten and out["unspecified_by_run"] == {"0": {"remote_unwritten": 8}}, out


@pytest.fixture(scope="module")
def gptj_naive():
    cwd, path = _needs("gpt_j")
    return _result("gptj_finetune.py", [], cwd, path)


def _first_loss_within_rule(loss, ref, naive):
    """FlashAttention's forward rule for the first step's loss (scalar): the error against
    Hugging Face's float64 loss at most twice the naive run's plus a floor of two float32 ulps
    of the loss (both runs end in a float32 loss: one rounding each way; the naive run can
    land on the reference's nearest float32 while flash, whose softmax rounds differently,
    lands one ulp away)."""
    floor = 2 * float(np.spacing(np.float32(abs(ref))))
    return abs(loss - ref) <= 2 * abs(naive - ref) + floor


def test_gptj_finetuning_matches_hugging_face_and_learns(gptj_naive):
    losses, ref = gptj_naive["losses"], gptj_naive["hf_first_loss"]
    assert len(losses) == 5, gptj_naive  # their loop runs steps 0..4 for training.steps 4
    # a float32 forward of two layers against float64
    np.testing.assert_allclose(losses[0], ref, rtol=1e-5)
    assert losses[-1] < losses[0] - 1.0, gptj_naive  # the repeated batch is being learnt
    assert gptj_naive["unspecified_last_run"] == {}


def test_gptj_finetuning_with_flash_follows_the_naive_losses(gptj_naive):
    cwd, path = _needs("gpt_j")
    out = _result("gptj_finetune.py", ["--flash"], cwd, path)
    naive, flash = np.array(gptj_naive["losses"]), np.array(out["losses"])
    assert flash.shape == naive.shape, out
    assert _first_loss_within_rule(flash[0], out["hf_first_loss"], naive[0]), out
    # later steps: two float32 trainings whose attention rounds differently; measured
    # max |flash - naive| = 2.4e-7 (about one float32 ulp of the loss)
    np.testing.assert_allclose(flash, naive, rtol=1e-5, atol=0)
