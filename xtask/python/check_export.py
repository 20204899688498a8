"""Check that peft loads an adapter this engine exported and computes the engine's logits.

  cargo run --release --example learn_from_feedback -- --export /tmp/fb-export
  cargo run --release --example logits -- --model examples/assets/demo --ids 1,282,201,287,300,270,273,393,33,2,201,1,283,201 \
      --adapter /tmp/fb-export --out /tmp/fb-logits.safetensors
  target/fixtures-venv/bin/python xtask/python/check_export.py --model examples/assets/demo \
      --adapter /tmp/fb-export --logits /tmp/fb-logits.safetensors --ids 1,282,201,287,300,270,273,393,33,2,201,1,283,201

Loads the base model with transformers (the class its config.json names), the exported directory with `PeftModel.from_pretrained`,
and compares its logits with the engine's (per position ‖ours − peft‖ / ‖peft‖ ≤ 1e-4, the
suite's LOGITS_REL). Exits non-zero on a mismatch.
"""

import argparse
import json
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--logits", required=True, help="the engine's logits (examples/logits.rs output)")
    ap.add_argument("--ids", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ids = torch.tensor([[int(x) for x in args.ids.split(",")]])
    # The checkpoint's own class: an export from a VLM save names its modules model.language_model.
    with open(os.path.join(args.model, "config.json")) as f:
        vlm = json.load(f).get("architectures") == ["Qwen3_5ForConditionalGeneration"]
    cls = Qwen3_5ForConditionalGeneration if vlm else Qwen3_5ForCausalLM
    model = cls.from_pretrained(args.model, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(model, args.adapter).eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0]
    ours = load_file(args.logits)["logits"]
    rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"peft vs engine logits with {args.adapter}: max per-position rel {rel:.2e}, "
          f"max abs {(ours - ref).abs().max().item():.2e}")
    sys.exit(0 if rel <= 1e-4 else 1)


if __name__ == "__main__":
    main()
