"""Build random-weight Qwen 3.5 checkpoints and transformers reference outputs.

Run through `cargo xtask fixtures` (which creates the venv and pins versions). Every model is made
from a fixed seed with transformers' own classes and saved with `save_pretrained`, so the files
have the exact layout of real checkpoints. References are computed in float32 on CPU with the
eager/torch fallbacks (no fla / causal-conv1d kernels).

Outputs (all small, committed):
  tests/fixtures/models/<name>/          the checkpoint directory
  tests/fixtures/reference/<name>.safetensors
      prompt{i}.ids        [T] i64        prompt token ids
      prompt{i}.logits     [T, V] f32     logits at every prompt position (full prefill)
      prompt{i}.hidden     [L+1, T, H]    residual stream: embeddings, then after each layer
      prompt{i}.generated  [N] i64        greedy continuation computed with the cache
"""

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from transformers import (
    DynamicCache,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

GREEDY_TOKENS = 8


def text_config(**kw):
    hd = kw.pop("head_dim")
    rot = int(hd * 0.25) // 2
    section = [rot - 2 * (rot // 3), rot // 3, rot // 3]
    base = dict(
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        head_dim=hd,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    base.update(kw)
    return base


MODELS = {
    # Grouped value heads (Hv = 2 Hk), tied head, 8 layers with both layer types, f32.
    "gva_tied_f32": dict(
        kind="causal",
        dtype=torch.float32,
        text=text_config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
        ),
    ),
    # Widths that are not multiples of 4/16/64, Hv = Hk, untied lm_head, f32.
    "odd_untied_f32": dict(
        kind="causal",
        dtype=torch.float32,
        text=text_config(
            vocab_size=101, hidden_size=38, intermediate_size=58, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=3, num_key_value_heads=1, head_dim=24,
            linear_num_key_heads=3, linear_num_value_heads=3,
            linear_key_head_dim=10, linear_value_head_dim=14, tie_word_embeddings=False,
        ),
    ),
    # The published layout: Qwen3_5ForConditionalGeneration (model.language_model. prefix,
    # model.visual.* present), bf16 weights, sharded, tied embeddings.
    "vlm_bf16_sharded": dict(
        kind="vlm",
        dtype=torch.bfloat16,
        shard="60KB",
        text=text_config(
            vocab_size=192, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=24, tie_word_embeddings=True,
        ),
    ),
}

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=48,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)


def build(spec, seed):
    torch.manual_seed(seed)
    text = dict(spec["text"])
    if spec["kind"] == "vlm":
        vision = dict(VISION, out_hidden_size=text["hidden_size"])
        cfg = Qwen3_5Config(text_config=text, vision_config=vision,
                            tie_word_embeddings=text["tie_word_embeddings"])
        model = Qwen3_5ForConditionalGeneration._from_config(cfg, attn_implementation="eager")
    else:
        cfg = Qwen3_5TextConfig(**text)
        model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    # Default init gives near-flat logits; scale everything up and make the norms non-trivial so
    # that (1+w) vs w conventions and greedy choices are really exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name or name.startswith("model.visual"):
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.normal_(0.0, 0.2)
            elif name.endswith("dt_bias"):
                p.normal_(1.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.4)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
        if getattr(cfg, "tie_word_embeddings", False) or text["tie_word_embeddings"]:
            model.tie_weights()
    if spec["dtype"] == torch.bfloat16:
        # Round once to bf16, then compute the reference in f32 with exactly those values.
        model = model.to(torch.bfloat16).float()
    return model, cfg


def decoder_layers(model):
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


@torch.no_grad()
def reference(model, ids):
    hidden = []
    hooks = [layer.register_forward_hook(lambda m, i, o: hidden.append(o[0] if isinstance(o, tuple) else o))
             for layer in decoder_layers(model)]
    emb = model.get_input_embeddings()(ids)
    out = model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    stack = torch.stack([emb[0]] + [h[0] for h in hidden])
    return out.logits[0].float().contiguous(), stack.float().contiguous(), greedy_with_cache(model, ids)


@torch.no_grad()
def greedy_with_cache(model, ids, n=GREEDY_TOKENS):
    """Greedy continuation through the cache (recurrent GDN path, KV cache), like generate()."""
    cache = DynamicCache(config=model.config.get_text_config())
    step = model(input_ids=ids, past_key_values=cache, use_cache=True)
    gen = []
    for _ in range(n):
        nxt = step.logits[0, -1].argmax()
        gen.append(int(nxt))
        step = model(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True)
    return torch.tensor(gen, dtype=torch.int64)


def save_model(model, spec, out_dir):
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    to_save = model.to(spec["dtype"]) if spec["dtype"] != torch.float32 else model
    kwargs = {"max_shard_size": spec["shard"]} if "shard" in spec else {}
    to_save.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    for extra in ("generation_config.json",):
        path = os.path.join(out_dir, extra)
        if os.path.exists(path):
            os.remove(path)


# The twelve LoRA-targetable projections of a Qwen 3.5 decoder layer.
ALL12 = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
         "out_proj", "gate_proj", "up_proj", "down_proj"]


def randomize_lora(model, seed, b_scale, bf16=False):
    """Nonzero random LoRA weights (peft initialises B to zero, which would hide every bug):
    A ~ N(0, 1/in), B ~ N(0, b_scale^2/r); with bf16, rounded to bf16 values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_scale / p.shape[1] ** 0.5)
            else:
                continue
            if bf16:
                p.copy_(p.to(torch.bfloat16).float())


# Qwen3.5-0.8B text dimensions (qwen35-spec.md section 1.3), for benchmarks only (not committed).
BENCH_MODEL = dict(
    kind="causal",
    dtype=torch.bfloat16,
    text=text_config(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
    ),
)


def bench_model(out_dir):
    """Random bf16 weights at the real 0.8B dimensions (~1.6 GB), built directly in bf16."""
    spec = BENCH_MODEL
    torch.manual_seed(8)
    cfg = Qwen3_5TextConfig(**spec["text"])
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    save_model(model, spec, out_dir)
    print(f"wrote {out_dir}")
    # A rank-16 PEFT adapter on all 12 projections with nonzero random A and B, beside the model.
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=ALL12))
    randomize_lora(peft_model, 9, b_scale=0.1)
    adapter_dir = out_dir.rstrip("/") + "-lora-r16"
    peft_model.save_pretrained(adapter_dir)
    print(f"wrote {adapter_dir}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="repository root")
    ap.add_argument("--bench-model", help="only write the 0.8B-dimension benchmark model to this directory")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.bench_model:
        bench_model(args.bench_model)
        return
    models_dir = os.path.join(args.root, "tests", "fixtures", "models")
    ref_dir = os.path.join(args.root, "tests", "fixtures", "reference")
    os.makedirs(models_dir, exist_ok=True)
    os.makedirs(ref_dir, exist_ok=True)
    summary = {}
    for seed, (name, spec) in enumerate(MODELS.items()):
        model, cfg = build(spec, seed + 1)
        vocab = spec["text"]["vocab_size"]
        g = torch.Generator().manual_seed(100 + seed)
        prompts = [torch.randint(0, vocab, (1, 1), generator=g), torch.randint(0, vocab, (1, 11), generator=g)]
        tensors = {}
        for i, ids in enumerate(prompts):
            logits, hidden, gen = reference(model, ids)
            tensors[f"prompt{i}.ids"] = ids[0].to(torch.int64).contiguous()
            tensors[f"prompt{i}.logits"] = logits
            tensors[f"prompt{i}.hidden"] = hidden
            tensors[f"prompt{i}.generated"] = gen
            summary[f"{name}/prompt{i}"] = gen.tolist()
        save_file(tensors, os.path.join(ref_dir, f"{name}.safetensors"))
        save_model(model, spec, os.path.join(models_dir, name))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
