"""transformers' outputs of the smallest fixture model over a 1,024-token prompt, for the engine's
long-context parity test (positions far past the other references' 20: RoPE at large angles,
attention over a long KV cache, the GDN recurrence over many steps).

Run through `cargo xtask fixtures` (after make_fixtures.py, which writes the model). Float32 on
CPU with the eager / torch fallbacks, as make_fixtures.py computes its references.

Output: tests/fixtures/reference/long_context.safetensors
    ids        [T] i64       the prompt (seeded uniform ids)
    positions  [P] i64       the positions whose logits are kept (every 16th and the last 16)
    logits     [P, V] f32    logits at those positions of a full prefill
    generated  [N] i64       greedy continuation computed with the cache
"""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM

MODEL = "odd_untied_f32"
PROMPT = 1024
GREEDY_TOKENS = 16
# The smallest top-two logit gap a greedy step may have: 10x the engine's logits tolerance
# (LOGITS_MAX_ABS, 2e-3), so that rounding cannot flip a choice.
MIN_GREEDY_GAP = 2e-2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    root = ap.parse_args().root
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_fixtures import greedy_with_cache

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = Qwen3_5ForCausalLM.from_pretrained(os.path.join(root, "tests/fixtures/models", MODEL),
                                               dtype=torch.float32, attn_implementation="eager").eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, vocab, (PROMPT,), generator=gen, dtype=torch.int64)
    positions = sorted(set(range(0, PROMPT, 16)) | set(range(PROMPT - 16, PROMPT)))
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
        generated = greedy_with_cache(model, ids[None], GREEDY_TOKENS)
        if not torch.equal(generated, greedy_with_cache(model, ids[None], GREEDY_TOKENS)):
            raise SystemExit("greedy ids differ between two runs")
        # Each greedy choice clear of the runner-up (the engine must pick the same ids, fused
        # and not): the top-two gaps of the continuation's logits, from a full prefill.
        steps = model(input_ids=torch.cat([ids, generated[:-1]])[None], use_cache=False).logits[0, PROMPT - 1:]
        top2 = steps.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        if gap < MIN_GREEDY_GAP:
            raise SystemExit(f"a greedy step's top two logits are {gap} apart (< {MIN_GREEDY_GAP})")
    out = os.path.join(root, "tests/fixtures/reference/long_context.safetensors")
    save_file({
        "ids": ids,
        "positions": torch.tensor(positions, dtype=torch.int64),
        "logits": logits[positions].contiguous(),
        "generated": generated,
    }, out)
    print(f"wrote {out} ({PROMPT} prompt tokens, {len(positions)} logit rows, {GREEDY_TOKENS} generated, "
          f"smallest greedy gap {gap:.3g})")


if __name__ == "__main__":
    main()
