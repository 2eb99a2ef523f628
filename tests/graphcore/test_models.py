"""The model tests of Graphcore's PopXL BERT, T5, GPT-J, Llama, Dolly, GPT-3 2.7B and BLOOM
(graphcore/examples ``nlp/<model>/popxl/tests``), run unmodified on the emulator with the
pytest plugin, each suite in its own interpreter. A suite passes here when at least the
tests the emulator README lists as passing ("Graphcore's examples") pass, so a regression in
the emulator fails it.

The models' configuration dataclasses use mutable defaults that Python 3.11 refuses, and they
import ``examples_utils`` (graphcore/examples-utils, not on PyPI), torch and transformers (GPT-3
2.7B's data loader also ``tfrecord``): the suites are skipped on Python 3.11 or later, or
without ``EXAMPLES_UTILS_PATH``.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from graphcore_run import require_paths, run_emulated

#: tests of each suite that pass on the emulator (the README says why the others do not),
#: with the transformers release they were recorded with (the HF reference side differs in
#: others)
TRANSFORMERS = {"bert": "4.25.1", "t5": "4.25.1", "gpt_j": "4.25.1", "llama": "4.31.0",
                "dolly": "4.25.1", "gpt3_2.7B": "4.25.1", "bloom": "4.25.1"}
#: modules a suite needs besides torch, transformers and simple-parsing (skipped without)
NEEDS = {"gpt3_2.7B": ("tfrecord",)}
EXPECTED = {
    "bert": {
        "tests.integration.execution.test_execution.TestPretraining::test_training_phased",
        "tests.integration.execution.test_execution.TestSquad::test_inference_phased",
        "tests.integration.execution.test_execution.TestSquad::test_training_phased",
        "tests.integration.layer.test_attention::test_attention_cmp_huggingface",
        "tests.integration.layer.test_embedding::test_embedding_cmp_huggingface",
        "tests.integration.layer.test_feed_forward::test_feed_forward_cmp_huggingface",
        "tests.integration.layer.test_pretraining::test_bert_pretraining_cmp_huggingface",
        "tests.unit.layer.test_attention_graph::test_attention_graph",
        "tests.unit.layer.test_embedding_graph::test_embedding_graph",
        "tests.unit.layer.test_feed_forward_graph::test_feed_forward_graph",
        "tests.unit.layer.test_squad_graph::test_squad_graph",
        "tests.unit.test_configuration::test_bool_arg",
        "tests.unit.test_configuration::test_defaults_from_config",
        "tests.unit.test_configuration::test_error_grad_accum",
        "tests.unit.test_configuration::test_grad_accum",
        "tests.unit.test_configuration::test_overriden_defaults_from_config",
    },
    "t5": {
        "tests.integration.execution.test_execution.TestExecution::test_finetuning",
        "tests.integration.execution.test_execution.TestExecution::test_inference",
        "tests.integration.layers.test_attention_TP::test_attention_TP_cmp_huggingface[False]",
        "tests.integration.layers.test_attention_TP::test_attention_TP_cmp_huggingface[True]",
        "tests.integration.layers.test_attention_TP::test_attention_to_hf[False]",
        "tests.integration.layers.test_attention_TP::test_attention_to_hf[True]",
        "tests.integration.layers.test_attention_TP::test_crossattention_TP_cmp_huggingface",
        "tests.integration.layers.test_attention_TP::test_crossattention_to_hf",
        "tests.integration.layers.test_embedding_TP::test_embeddings_TP_cmp_torch",
        "tests.integration.layers.test_embedding_TP::test_embeddings_to_torch",
        "tests.integration.layers.test_encoder_decoder_block_TP::test_t5_block_TP_cmp_huggingface[False]",
        "tests.integration.layers.test_encoder_decoder_block_TP::test_t5_block_TP_cmp_huggingface[True]",
        "tests.integration.layers.test_encoder_decoder_block_TP::test_t5_block_to_hf[False]",
        "tests.integration.layers.test_encoder_decoder_block_TP::test_t5_block_to_hf[True]",
        "tests.integration.layers.test_feed_forward_TP::test_feed_forward_TP_cmp_huggingface",
        "tests.integration.layers.test_feed_forward_TP::test_ff_to_hf",
        "tests.integration.layers.test_layer_norm::test_layer_norm_cmp_huggingface",
        "tests.integration.layers.test_layer_norm::test_layer_norm_to_hf",
        "tests.integration.layers.test_lm_TP::test_lm_TP_cmp_huggingface",
        "tests.integration.layers.test_lm_TP::test_lm_to_hf",
        "tests.integration.layers.test_t5_TP::test_t5_TP_cmp_huggingface",
        "tests.integration.layers.test_t5_TP::test_t5_to_hf",
    },
    "gpt_j": {
        "tests.integration.execution.test_execution.TestPretraining::test_finetuning",
        "tests.integration.execution.test_execution.TestPretraining::test_inference",
        "tests.integration.layers.test_attention_TP::test_attention_TP_cmp_huggingface",
        "tests.integration.layers.test_attention_TP::test_attention_to_hf",
        "tests.integration.layers.test_decoder_block_TP::test_decoder_block_TP_cmp_huggingface",
        "tests.integration.layers.test_decoder_block_TP::test_decoder_to_hf",
        "tests.integration.layers.test_feed_forward_TP::test_feed_forward_TP_cmp_huggingface",
        "tests.integration.layers.test_feed_forward_TP::test_ff_to_hf",
        "tests.integration.layers.test_gptj_TP::test_gptj_TP_cmp_huggingface",
        "tests.integration.layers.test_gptj_TP::test_gptj_to_hf",
        "tests.integration.layers.test_lm_TP::test_lm_TP_cmp_huggingface",
        "tests.integration.layers.test_lm_TP::test_lm_to_hf",
        "tests.unit.test_dataloder::test_dataloader_checkpoints",
        "tests.unit.test_dataloder::test_epochs",
    },
    "llama": {
        "tests.integration.layers.test_feed_forward_TP::test_feed_forward_TP_cmp_huggingface",
    },
    "dolly": {
        "tests.integration.execution.test_execution.TestExecution::test_inference",
        "tests.integration.layers.test_attention_TP::test_attention_TP_cmp_huggingface",
        "tests.integration.layers.test_decoder_block_TP::test_decoder_block_TP_cmp_huggingface",
        "tests.integration.layers.test_feed_forward_TP::test_feed_forward_TP_cmp_huggingface",
        "tests.integration.layers.test_lm_TP::test_lm_TP_cmp_huggingface",
        "tests.integration.layers.test_model_TP::test_model_TP_cmp_huggingface",
    },
    "gpt3_2.7B": {
        "tests.integration.execution.test_execution.TestPretraining::test_training_phased",
        "tests.integration.layers.test_decoder_block_TP::test_decoder_block_TP_cmp_huggingface",
        "tests.integration.layers.test_gpt_TP::test_gpt_TP_cmp_huggingface",
        "tests.integration.layers.test_lm_TP::test_lm_TP_cmp_huggingface",
    },
    "bloom": {
        "tests.integration.execution.test_execution.TestExecution::test_inference",
        "tests.integration.layers.test_attention::test_attention",
        "tests.integration.layers.test_decoder_block::test_decoder_block",
        "tests.integration.layers.test_embedding::test_embedding",
        "tests.integration.layers.test_feed_forward::test_feed_forward",
        "tests.integration.layers.test_lm::test_lm",
    },
}


def _outcomes(junit):
    """{test id: "passed" | "failed" | "skipped"} from a junit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = ("failed" if kinds & {"failure", "error"} else
                     "skipped" if "skipped" in kinds else "passed")
    return out


@pytest.mark.parametrize("model", ["bert", "t5", "gpt_j", "llama", "dolly", "gpt3_2.7B",
                                   "bloom"])
def test_model_suite(model, tmp_path):
    if sys.version_info >= (3, 11):
        pytest.skip(f"the models' config dataclasses have mutable defaults, which Python "
                    f"3.11+ refuses (running {sys.version_info.major}.{sys.version_info.minor}; "
                    "they need Python < 3.11)")
    examples, addons, utils = require_paths("GRAPHCORE_EXAMPLES_PATH", "POPXL_ADDONS_PATH",
                                            "EXAMPLES_UTILS_PATH")
    for module in ("torch", "simple_parsing", *NEEDS.get(model, ())):
        pytest.importorskip(module)
    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != TRANSFORMERS[model]:
        pytest.skip(f"{model}'s expected results were recorded with transformers "
                    f"{TRANSFORMERS[model]} (installed: {transformers.__version__})")
    cwd = os.path.join(examples, "nlp", model, "popxl")
    junit = tmp_path / "junit.xml"
    res = run_emulated(["-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}",
                        "tests"], cwd, [cwd, os.path.join(examples, "utils"), addons, utils],
                       timeout=3600)
    assert junit.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    outcomes = _outcomes(junit)
    passed = {t for t, o in outcomes.items() if o == "passed"}
    assert outcomes, res.stdout[-3000:]
    summary = re.findall(r"\d+ (?:passed|failed|error|skipped)", res.stdout)
    missing = sorted(EXPECTED.get(model, set()) - passed)
    assert not missing, f"{model}: {summary}; expected to pass but did not: {missing}"
