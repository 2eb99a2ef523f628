"""Graphcore's ``GPTJTrainer`` (graphcore/examples ``nlp/gpt_j/popxl``, ``api.py``) fine-tuning a
small random Hugging Face ``GPTJForCausalLM`` for a few AdamW steps on synthetic tokens, as
published. Run from ``nlp/gpt_j/popxl`` on the emulator:

    python -m popxl_flash.emulator.run <this file> [--flash] [--tp N] [--steps N]

``--flash`` swaps flash attention into their attention layer first (``flash_gptj.py``).
Prints one line ``RESULT {json}``: the loss of every step (full precision; their loop logs it
rounded) and Hugging Face's float64 loss of the first step's batch on the initial weights.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # flash_gptj

VOCAB, SEQ, BATCH = 128, 16, 2


def record_losses(values):
    """Append each training run's loss (``outputs[session.outputs[0]]``, which their loop
    logs rounded to 3 decimals) to ``values``, at full precision: wraps popxl-addons'
    ``TaskSession.run`` (instrumentation only; their code is unchanged)."""
    from popxl_addons.task_session import TaskSession
    run = TaskSession.run

    def recording(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        values.append(float(np.mean(out[self.outputs[0]].astype(np.float64))))
        return out
    TaskSession.run = recording


def dataset(n):
    """``n`` samples: :data:`BATCH` rows of random tokens repeated (so the loss can fall);
    labels are the next token (the last one wraps)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64)
    return [{"input_ids": ids[i % BATCH], "labels": np.roll(ids[i % BATCH], -1)}
            for i in range(n)]


def configs(args):
    """Graphcore's ``GPTJConfig`` and Hugging Face's for one small random model."""
    import popxl
    from transformers import GPTJConfig as HFConfig
    from config import GPTJConfig
    cfg = GPTJConfig()
    cfg.model.layers, cfg.model.hidden_size, cfg.model.sequence_length = 2, 64, SEQ
    cfg.model.embedding.vocab_size, cfg.model.attention.heads = VOCAB, 4
    cfg.model.attention.rotary_dim, cfg.model.dtype = 8, popxl.float32
    cfg.training.steps, cfg.training.global_batch_size = args.steps, BATCH
    cfg.execution.micro_batch_size, cfg.execution.tensor_parallel = 1, args.tp
    cfg.execution.data_parallel, cfg.execution.io_tiles = 1, 64  # their finetuning.yml's
    hf = HFConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                  rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return cfg, hf


def hf_first_loss(model, data, cfg):
    """Hugging Face's mean token loss, in float64, of the first step's samples (their data
    loader's first batch, drawn again with the same sampler) on the initial weights."""
    import torch
    from data.data_utils import StatefulRandomSampler
    first = list(StatefulRandomSampler(data, seed=47))[:cfg.training.global_batch_size]
    ids = torch.tensor(np.stack([data[i]["input_ids"] for i in first]))
    labels = torch.tensor(np.stack([data[i]["labels"] for i in first]))
    with torch.no_grad():
        logits = model.double()(ids).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--flash", action="store_true")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    import torch
    from transformers import GPTJForCausalLM
    if args.flash:
        import flash_gptj
        flash_gptj.swap()
    from api import GPTJTrainer
    cfg, hf_cfg = configs(args)
    torch.manual_seed(0)
    model = GPTJForCausalLM(hf_cfg).eval()
    data = dataset(BATCH * (args.steps + 1))
    losses = []
    record_losses(losses)
    trainer = GPTJTrainer(cfg, model, data)
    trainer.train()
    print("RESULT " + json.dumps({"losses": losses,
                                  "hf_first_loss": hf_first_loss(model, data, cfg),
                                  "unspecified_last_run":
                                      trainer.train_session.profile.unspecified_by_kind}))


if __name__ == "__main__":
    main()
