"""Graphcore's ``LlamaPipeline`` (graphcore/examples ``nlp/llama/popxl/api/pipeline.py``) run
as published, greedily, at a small random configuration, next to Hugging Face's greedy
decoding of the same ``LlamaForCausalLM``. Run from ``nlp/llama/popxl`` on the emulator:

    python -m popxl_flash.emulator.run <this file> [--use-cache] [--flash] [--tp N]

``--flash`` swaps flash attention into their attention layer first (``flash_llama.py``).
Prints one line ``RESULT {json}``: the prompts, the pipeline's and Hugging Face's decoded
continuations, the number of session runs and the runs' counts of unspecified behaviour
(``RunProfile.unspecified_by_kind``) with the messages warned.
"""
import argparse
import json
import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # flash_llama

PROMPTS = ["the cat sat on", "a dog ran"]
WORDS = ("the a cat dog sat ran on in to and of mat red big small fast slow up down it is "
         "was saw went home far near old new").split()


def tokenizer():
    """A word-level Hugging Face tokenizer built in code (no download): ids 0-3 are
    ``<pad> <s> </s> <unk>``, then :data:`WORDS`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def configs(args, vocab):
    """Graphcore's ``LlamaConfig`` and Hugging Face's for one small random model."""
    import popxl
    from transformers import LlamaConfig as HFConfig
    from config import LlamaConfig
    cfg = LlamaConfig()
    cfg.model.layers, cfg.model.hidden_size, cfg.model.intermediate_size = 2, 64, 128
    cfg.model.sequence_length, cfg.model.embedding.vocab_size = 16, vocab
    cfg.model.attention.heads, cfg.model.attention.kv_heads = 4, 2
    cfg.model.dtype = popxl.float32
    cfg.execution.micro_batch_size, cfg.execution.tensor_parallel = 1, args.tp
    cfg.execution.data_parallel, cfg.execution.use_cache = 1, args.use_cache
    hf = HFConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=16, rms_norm_eps=cfg.model.eps)
    return cfg, hf


def record_unspecified(session):
    """Count ``session``'s runs and keep each run's ``profile.unspecified_by_kind`` that is
    not empty, as ``{"runs": n, "by_run": {run index: counts}}`` (wraps the instance's
    ``run``, which the pipeline calls; instrumentation only)."""
    counts, run = {"runs": 0, "by_run": {}}, session.run

    def counting(*args, **kwargs):
        out = run(*args, **kwargs)
        if session.profile.unspecified_by_kind:
            counts["by_run"][counts["runs"]] = dict(session.profile.unspecified_by_kind)
        counts["runs"] += 1
        return out
    session.run = counting
    return counts


def hf_greedy(model, tok, prompt, n):
    """Hugging Face's greedy continuation of ``prompt`` (up to ``n`` tokens, stopping at EOS
    as the pipeline does), decoded."""
    import torch
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        new = new[:new.index(tok.eos_token_id)]
    return tok.decode(new)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--use-cache", action="store_true")
    parser.add_argument("--flash", action="store_true")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    import torch
    from transformers import LlamaForCausalLM
    if args.flash:
        import flash_llama
        flash_llama.swap()
    from api.pipeline import LlamaPipeline
    tok = tokenizer()
    cfg, hf_cfg = configs(args, len(tok))
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = LlamaPipeline(cfg, hf_llama_checkpoint=model, tokenizer=tok,
                             prompt_format="{prompt}")
        counts = record_unspecified(pipe.session)
        ours = [pipe(p, temperature=0.0, k=0, output_length=args.tokens, print_live=False,
                     print_final=False)[0] for p in PROMPTS]
    theirs = [hf_greedy(model, tok, p, args.tokens) for p in PROMPTS]
    print("RESULT " + json.dumps({
        "prompts": PROMPTS, "pipeline": ours, "hf": theirs,
        "runs": counts["runs"], "unspecified_by_run": counts["by_run"],
        "warned": sorted({str(w.message).split(" -- ")[0] for w in caught
                          if type(w.message).__name__ == "UnspecifiedBehaviourWarning"})}))


if __name__ == "__main__":
    main()
