"""transformers' sampling distributions, for the engine's CPU-only sampler test.

For fixed random logit rows and histories, transformers' own logits processors (as `generate`
builds them for `do_sample=True`: the repetition penalty, then the temperature, top-k and top-p
warpers) give the scores a draw is made from; their softmax is the distribution. Greedy cases
(`do_sample=False`) record the argmax of the penalized scores with probability 1.

Run: `python xtask/python/make_sampling.py --root .` (no model, no GPU; a few seconds).
Output: tests/fixtures/reference/sampling.json, committed, read by tests/sampling.rs.
"""

import argparse
import json
import os

import numpy as np
import torch
import transformers
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 300

# (name, temperature, top_k, top_p, repetition_penalty, history length); top_k 0 and top_p 1 are
# off, as in GenerationConfig.
CASES = [
    ("qwen_recommended", 0.7, 20, 0.8, 1.0, 0),
    ("top_p_only", 1.0, 0, 0.95, 1.0, 0),
    ("top_k_only", 0.6, 50, 1.0, 1.0, 0),
    ("temperature_only", 1.5, 0, 1.0, 1.0, 0),
    ("penalty_with_warpers", 0.7, 20, 0.8, 1.3, 24),
    ("penalty_below_one", 0.9, 0, 0.5, 0.8, 24),
    ("top_k_one", 1.0, 1, 1.0, 1.0, 0),
    ("narrow_nucleus", 0.3, 0, 0.2, 1.0, 0),
    ("greedy_with_penalty", 0.0, 0, 1.0, 1.5, 24),
    ("penalty_full_softmax", 1.0, 0, 1.0, 1.3, 40),
]


def processors(temperature, top_k, top_p, penalty):
    """The processors `generate` builds for these settings, in its order
    (`GenerationMixin._get_logits_processor`: the repetition penalty among the processors, then,
    with `do_sample`, temperature unless 1, top-k unless 0, top-p unless 1)."""
    out = []
    if penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature > 0.0:
        if temperature != 1.0:
            out.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            out.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            out.append(TopPLogitsWarper(top_p))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    root = ap.parse_args().root
    rng = np.random.default_rng(20261204)
    cases = []
    for name, temperature, top_k, top_p, penalty, history_len in CASES:
        logits = (rng.standard_normal(VOCAB) * 3.0).astype(np.float32)
        # The best and the worst token among the history (a positive logit divided, a negative
        # one multiplied), and repeats: the penalty applies once per distinct id.
        history = rng.integers(0, VOCAB, size=history_len).tolist()
        if history:
            history += [int(np.argmax(logits)), int(np.argmin(logits))] + history[:4]
        scores = torch.from_numpy(logits.copy())[None]
        ids = torch.tensor([history], dtype=torch.long) if history else torch.zeros((1, 0), dtype=torch.long)
        for p in processors(temperature, top_k, top_p, penalty):
            scores = p(ids, scores)
        if temperature > 0.0:
            probs = torch.softmax(scores[0].double(), dim=-1).numpy()
        else:
            probs = np.zeros(VOCAB)
            probs[int(torch.argmax(scores[0]))] = 1.0
        cases.append({
            "name": name,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "repetition_penalty": penalty,
            "history": history,
            "logits": [float(v) for v in logits],
            "probs": [float(v) for v in probs],
        })
    out = os.path.join(root, "tests/fixtures/reference/sampling.json")
    with open(out, "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}, f)
        f.write("\n")
    print(f"wrote {out} ({len(cases)} cases)")


if __name__ == "__main__":
    main()
