"""PEFT LoRA adapters for the fixture models, and peft's reference outputs with them.

Run through `cargo xtask fixtures` after make_fixtures.py. Each adapter is created with
`get_peft_model` on the committed fixture model, given nonzero random A and B (peft initialises
B to zero, which would hide every bug), saved with `save_pretrained`, and run unmerged in f32.

Outputs:
  tests/fixtures/adapters/<name>/                 adapter_config.json + adapter_model.safetensors
  tests/fixtures/adapters/meta_only.safetensors   a bare file whose r / lora_alpha live in the
                                                  safetensors metadata (no adapter_config.json)
  tests/fixtures/reference/adapters.safetensors
      <adapter>.ids                 [T] i64   the prompt (prompt1 of the base model's fixture)
      <adapter>.s<scale>.logits     [T, V]    logits with the adapter at that scale
      <adapter>.s<scale>.generated  [N] i64   greedy continuation (with the cache)
"""

import argparse
import json
import os
import shutil

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from make_fixtures import ALL12, greedy_with_cache, randomize_lora

ADAPTERS = {
    # All twelve projections, r = 8; the scales test the user's multiplier (negative included).
    "all12_r8": dict(base="gva_tied_f32", scales=[1.0, 0.5, 2.0, -1.0],
                     config=dict(r=8, lora_alpha=16, target_modules=ALL12)),
    # rsLoRA on the GDN and MLP projections, r = 4.
    "gdn_mlp_r4_rslora": dict(base="gva_tied_f32", scales=[1.0],
                              config=dict(r=4, lora_alpha=8, use_rslora=True,
                                          target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                          "out_proj", "gate_proj", "up_proj", "down_proj"])),
    # r = 16 by default, with rank_pattern / alpha_pattern overrides, targets as "all-linear".
    "patterns_r16": dict(base="gva_tied_f32", scales=[1.0],
                         config=dict(r=16, lora_alpha=16, target_modules="all-linear",
                                     rank_pattern={"q_proj": 4, "mlp.down_proj": 8},
                                     alpha_pattern={"in_proj_qkv": 64})),
    # Only layers 0 and 3 (a GDN and an attention layer).
    "layers_0_3": dict(base="gva_tied_f32", scales=[1.0],
                       config=dict(r=8, lora_alpha=8, layers_to_transform=[0, 3], target_modules=ALL12)),
    # Saved from the VLM class (keys ...model.language_model.layers...), weights stored as bf16,
    # on the sharded bf16 checkpoint.
    "vlm_bf16_r8": dict(base="vlm_bf16_sharded", scales=[1.0], bf16=True,
                        config=dict(r=8, lora_alpha=16, target_modules=ALL12)),
    # Widths that are not multiples of 4/16/64.
    "odd_r4": dict(base="odd_untied_f32", scales=[1.0], config=dict(r=4, lora_alpha=4, target_modules=ALL12)),
}


def load_base(root, name):
    path = os.path.join(root, "tests", "fixtures", "models", name)
    with open(os.path.join(path, "config.json")) as f:
        cls = Qwen3_5ForConditionalGeneration if json.load(f)["model_type"] == "qwen3_5" else Qwen3_5ForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.float().eval()


def set_scale(model, scale):
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.set_scale("default", scale)


@torch.no_grad()
def run(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits[0].float().contiguous()
    return logits, greedy_with_cache(model, ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    out_dir = os.path.join(args.root, "tests", "fixtures", "adapters")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    ref = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        base_ref = load_file(os.path.join(args.root, "tests", "fixtures", "reference", spec["base"] + ".safetensors"))
        ids = base_ref["prompt1.ids"].view(1, -1)
        model = load_base(args.root, spec["base"])
        peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **spec["config"]))
        randomize_lora(peft_model, 1000 + seed, b_scale=0.5, bf16=spec.get("bf16", False))
        peft_model.eval()
        ref[f"{name}.ids"] = ids[0].contiguous()
        for scale in spec["scales"]:
            set_scale(peft_model, scale)
            logits, gen = run(peft_model, ids)
            ref[f"{name}.s{scale:g}.logits"] = logits
            ref[f"{name}.s{scale:g}.generated"] = gen
            print(name, scale, gen.tolist())
        set_scale(peft_model, 1.0)
        target = os.path.join(out_dir, name)
        peft_model.save_pretrained(target)
        os.remove(os.path.join(target, "README.md"))
        if spec.get("bf16"):
            path = os.path.join(target, "adapter_model.safetensors")
            tensors = load_file(path)
            save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, path)
    # A bare .safetensors with r / lora_alpha in its metadata, no adapter_config.json beside it:
    # all12_r8's weights with alpha 32, i.e. all12_r8 at scale 2.
    tensors = load_file(os.path.join(out_dir, "all12_r8", "adapter_model.safetensors"))
    save_file(tensors, os.path.join(out_dir, "meta_only.safetensors"), metadata={"r": "8", "lora_alpha": "32"})
    save_file(ref, os.path.join(args.root, "tests", "fixtures", "reference", "adapters.safetensors"))


if __name__ == "__main__":
    main()
