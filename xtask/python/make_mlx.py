"""Build MLX-format Qwen 3.5 checkpoints with mlx-lm and reference outputs for them.

Run through `cargo xtask fixtures`, in stages over two venvs (torch and mlx cannot share one):

  --stage source        (fixtures venv) a random bf16 Qwen3_5ForCausalLM in HF layout, made with
                        make_fixtures.build, committed as tests/fixtures/models/mlx_source_bf16
                        (the engine's load-time quantization is checked against mlx-lm's on it)
  --stage convert       (mlx venv) mlx-lm's own conversion (load_model, quantize_model, save_model,
                        save_config from mlx_lm.utils, as mlx_lm.convert does) into the committed
                        tests/fixtures/models/mlx_*
  --stage reference     (mlx venv) mlx-lm's forward logits and greedy generation on each MLX dir,
                        and an f32 HF checkpoint of exactly the weights mlx-lm holds (dequantized,
                        with its qwen3_5 sanitize undone) under target/mlx-deq/<name>/
  --stage transformers  (fixtures venv) transformers in f32 on each dequantized checkpoint
  --stage compressed    (fixtures venv) a compressed-tensors W4A16 checkpoint of the HF source made with
                        compressed-tensors' own machinery, as llm-compressor makes RedHatAI's Qwen 3.5
                        W4A16 (apply_quantization_config; int4 symmetric group 64 scales from each
                        group's min/max by calculate_qparams, llm-compressor's min-max observer;
                        ModelCompressor compress_model, save_pretrained, update_config), format
                        pack-quantized, lm_head and every GDN in_proj_a / in_proj_b ignored (bf16),
                        into tests/fixtures/models/ct_w4a16_g64; the reference is transformers loading
                        that directory itself (its compressed-tensors integration) in f32, checked to
                        hold exactly s * (u - 8) and to match the same model on our own unpacking
  --stage peft          (fixtures venv) a PEFT LoRA adapter made on the HF source (module names
                        model.layers.N...) for mlx_q4_g64, and transformers + peft references on the
                        dequantized f32 mlx_q4_g64 (needs PYTHONHASHSEED=0, as make_adapters.py)
  --stage mlx-lora      (mlx venv) an MLX LoRA adapter on mlx_q4_g64 made with mlx-lm's own tuner
                        code (linear_to_lora_layers, the trainable parameters saved as the trainer
                        saves them, adapter_config.json as mlx_lm.lora writes it), reloaded with
                        load_adapters, and mlx-lm's outputs with it (native and all-f32)
  --stage mlx-lora-reference
                        (fixtures venv) that adapter as the equivalent PEFT LoRA (lora_A = lora_a^T,
                        lora_B = lora_b^T, scaling = scale) on the dequantized f32 mlx_q4_g64
  --stage learn         (fixtures venv) LoRA gradients by PyTorch autograd (make_learn.py's loss)
                        on the dequantized f32 mlx_q4_g64, for an adapter on the last layer:
                        tests/fixtures/learn/q4_last and reference/learn_q4.safetensors
  --stage bench         (mlx venv) the 0.8B-dimension benchmark model (make_fixtures.py
                        --bench-model, target/bench/qwen35-0.8b-random) converted by mlx-lm to
                        4-bit g64 and 8-bit g64 beside it (-mlx-q4, -mlx-q8; not committed)
  --stage bench-4b      (mlx venv) a random Qwen 3.5 at the real 4B text dimensions (BENCH_4B, the
                        0.8B bench model's config with the 4B's dims), made with mlx-lm's own qwen3_5
                        model class and written straight as a 4-bit g64 MLX checkpoint to
                        target/bench/qwen35-4b-random-mlx-q4 (not committed; no bf16 source). Its bf16
                        weights (~8.4 GB) are never all in memory: the random weights and quantize_model
                        stay lazy and each layer is evaluated (generated and quantized) in turn

xtask/python/bench_mlx.py (mlx venv) measures mlx-lm itself on the CPU on these bench checkpoints, as
bench_peers.py does transformers: `bench_mlx.py --model target/bench/qwen35-0.8b-random-mlx-q4
--prompt 128 --decode 64 --repeats 5` prints one JSON line.

mlx_lm.convert itself cannot be called: it needs a tokenizer (the source has none) and mlx-lm has no
model module for the model_type "qwen3_5_text" that Qwen3_5ForCausalLM writes, so the conversion
loads the source with model_type "qwen3_5" (mlx-lm's Qwen 3.5 module, which reads flat text
configs) and that is the model_type written to the MLX config.json.

Outputs (committed):
  tests/fixtures/models/mlx_<name>/      model.safetensors + config.json, as mlx-lm wrote them
  tests/fixtures/reference/mlx_<name>.safetensors
      prompt{i}.ids            [T] i64      prompt token ids
      prompt{i}.logits         [T, V] f32   transformers f32 on the dequantized weights (full prefill)
      prompt{i}.generated      [N] i64      its greedy continuation through the cache
      prompt{i}.mlx_logits     [T, V] f32   mlx-lm's logits (bf16 compute, cast to f32)
      prompt{i}.mlx_generated  [N] i64      mlx-lm's greedy continuation (generate_step)

  tests/fixtures/models/ct_w4a16_g64/    model.safetensors + config.json, as compressed-tensors wrote
      them: each quantized Linear as <module>.weight_packed [out, in/8] i32 (eight 4-bit u = q + 8 a
      word, input 8c+j in bits 4j..4j+3), .weight_scale [out, in/64] bf16, .weight_shape [2] i64,
      w = scale * (u - 8); lm_head (tied) and in_proj_a / in_proj_b as plain bf16 .weight
  tests/fixtures/reference/ct_w4a16_g64.safetensors
      prompt{i}.ids / .logits / .generated   transformers f32 on that checkpoint (no mlx_* entries)

  tests/fixtures/adapters/mlx_q4_lora/       adapter_config.json + adapter_model.safetensors (peft)
  tests/fixtures/adapters/mlx_q4_mlx_lora/   adapter_config.json + adapters.safetensors (mlx-lm)
  tests/fixtures/reference/mlx_q4_lora.safetensors
      prompt{i}.ids / .logits / .generated   as above, transformers + peft (scale 1) on the
                                             dequantized f32 mlx_q4_g64
      prompt{i}.logits_half    [T, V] f32   the same with the adapter at scale 0.5 (set_scale)
  tests/fixtures/reference/mlx_q4_mlx_lora.safetensors
      prompt{i}.ids / .logits / .generated   transformers + the converted peft adapter, f32
      prompt{i}.mlx_logits / .mlx_generated  mlx-lm with the adapter (load_adapters), native dtypes

  tests/fixtures/reference/learn_q4.safetensors
      q4_last.e<i>.prompt / .response, .scores, .<loss>.<module>.lora_A / lora_B   as learn.safetensors

The adapters are written after make_adapters.py, which empties tests/fixtures/adapters first.

mlx-lm computes in bf16, so mlx_logits differ from logits by bf16 noise (tenths here) and its greedy
ids part from transformers' after a few tokens. The dequantized checkpoint itself is checked: mlx-lm's
model with every parameter cast to f32 must give transformers' logits to 1e-3; so must mlx-lm's
model with the MLX adapter, cast to f32, give transformers + peft's logits with the converted one.
mlx-lm's LoRALinear keeps lora_a / lora_b in f32: x (bf16) @ lora_a promotes to f32, and the scaled
delta is rounded to bf16 before it is added to the quantized layer's bf16 output.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

GREEDY_TOKENS = 8
F32_TOLERANCE = 1e-3
SEED = 21
PROMPT_SEED = 121
PROMPT_LENGTHS = (1, 11)

# The LoRA adapters on the quantized base: PEFT (r 8, alpha 16, randomize_lora's A ~ N(0, 1/in),
# B ~ N(0, 0.5^2/r)) and MLX (mlx_lm.lora's default rank 8, scale 20; lora_a ~ N(0, 1/in),
# lora_b ~ N(0, MLX_B_SCALE^2/r) / scale, so scale * lora_b has PEFT's scaling * B spread halved).
ADAPTER_BASE = "mlx_q4_g64"
PEFT_ADAPTER = "mlx_q4_lora"
MLX_ADAPTER = "mlx_q4_mlx_lora"
LORA_RANK = 8
PEFT_ALPHA = 16
PEFT_B_SCALE = 0.5
PEFT_SEED = 2100
MLX_SCALE = 20.0
MLX_B_SCALE = 0.5
MLX_LORA_SEED = 2101

# Source model dimensions; layer_types [linear x3, full] is mlx-lm's full_attention_interval 4.
SOURCE_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
)

# The 4B bench model (--stage bench-4b): the 0.8B bench model's config.json (make_fixtures.py
# BENCH_MODEL as transformers writes it) with Qwen 3.5 4B's text dimensions, model_type qwen3_5 as
# the MLX conversions write it; layer_types is [linear x3, full] x8, mlx-lm's full_attention_interval 4.
BENCH_4B_LAYERS = 32
BENCH_4B = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "dtype": "bfloat16",
    "eos_token_id": None,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(BENCH_4B_LAYERS)],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 4096,
    "model_type": "qwen3_5",
    "num_attention_heads": 16,
    "num_hidden_layers": BENCH_4B_LAYERS,
    "num_key_value_heads": 4,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [12, 10, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "rope_type": "default",
    },
    "tie_word_embeddings": True,
    "use_cache": True,
    "vocab_size": 248320,
}
BENCH_4B_SEED = 44


def affine(bits, group_size):
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def mixed_predicate(path, module):
    """Per-module recipe (recorded per path in config.json by quantize_model). Projections that read
    the same input share bits and group size within a layer; module rules beat layer rules, except
    that layer 0's down_proj stays 8-bit g64 so that one K=128 matrix uses g64."""
    if path.endswith("embed_tokens"):
        return affine(8, 64)
    if path.endswith("o_proj") or path.endswith("out_proj"):
        return affine(8, 32)
    layer = int(path.split("layers.")[1].split(".")[0])
    if layer == 0:
        return affine(8, 64)
    if path.endswith("mlp.down_proj") and module.weight.shape[-1] % 128 == 0:
        return affine(4, 128)
    return affine(4, 64)


def quality_predicate(path, module):
    """The engine's q4-quality recipe (QuantizeRecipe::Q4Quality) as an mlx-lm predicate: the GDN
    gates in_proj_a/b kept in bf16, the GDN out_proj, the attention projections and the embedding
    at 8-bit g64, the rest 4-bit g64. Projections of one input group then differ in precision."""
    if path.endswith("in_proj_a") or path.endswith("in_proj_b"):
        return False
    if any(path.endswith(s) for s in ("linear_attn.out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens")):
        return affine(8, 64)
    return affine(4, 64)


# Committed MLX checkpoints: None is unquantized bf16, else (bits, group_size, predicate).
MLX_MODELS = {
    "mlx_bf16": None,
    "mlx_q4_g64": (4, 64, None),
    "mlx_q8_g32": (8, 32, None),
    "mlx_mixed": (4, 64, mixed_predicate),
    "mlx_q4_quality": (4, 64, quality_predicate),
}

# Norm weights mlx-lm's qwen3_5 sanitize stores as 1 + w (not linear_attn.norm, which is plain w).
SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


def paths(root):
    target = os.path.join(root, "target")
    return dict(
        source=os.path.join(root, "tests", "fixtures", "models", "mlx_source_bf16"),
        deq=os.path.join(target, "mlx-deq"),
        models=os.path.join(root, "tests", "fixtures", "models"),
        reference=os.path.join(root, "tests", "fixtures", "reference"),
        adapters=os.path.join(root, "tests", "fixtures", "adapters"),
    )


def prompts():
    rng = np.random.default_rng(PROMPT_SEED)
    return [rng.integers(0, SOURCE_TEXT["vocab_size"], size=n, dtype=np.int64) for n in PROMPT_LENGTHS]


def stage_source(p):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from make_fixtures import build, save_model, text_config

    spec = dict(kind="causal", dtype=torch.bfloat16, text=text_config(**SOURCE_TEXT))
    model, _ = build(spec, SEED)
    save_model(model, spec, p["source"])
    print(f"wrote {p['source']}")


def stage_convert(p):
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    mx.set_default_device(mx.cpu)
    for name, quant in MLX_MODELS.items():
        out = Path(p["models"]) / name
        if out.exists():
            shutil.rmtree(out)
        model, config = load_model(Path(p["source"]), lazy=True, model_config={"model_type": "qwen3_5"})
        if quant is not None:
            bits, group_size, predicate = quant
            model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
        save_model(out, model)
        save_config(config, config_path=out / "config.json")
        # A single shard: the index mlx-lm writes beside it names nothing the file does not.
        os.remove(out / "model.safetensors.index.json")
        print(f"wrote {out}")


def stage_bench(p, root):
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    mx.set_default_device(mx.cpu)
    src = Path(root) / "target" / "bench" / "qwen35-0.8b-random"
    for bits in (4, 8):
        out = src.parent / f"{src.name}-mlx-q{bits}"
        if out.exists():
            shutil.rmtree(out)
        model, config = load_model(src, lazy=True, model_config={"model_type": "qwen3_5"})
        model, config = quantize_model(model, config, 64, bits)
        save_model(out, model)
        save_config(config, config_path=out / "config.json")
        print(f"wrote {out}")


def stage_bench_4b(root):
    """The 4B bench model, built by mlx-lm's qwen3_5 Model from BENCH_4B with random bf16 weights as
    make_fixtures.py bench_model draws them (matrices N(0, 1/fan_in), A_log U(-1, 1), dt_bias 1), the
    norms as mlx-lm holds them (1 + w for the shifted ones, w = 0 as bench_model has), then
    quantize_model (4-bit g64), save_model and save_config as --stage bench does."""
    import copy
    import time
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    mx.set_default_device(mx.cpu)
    start = time.perf_counter()
    out = Path(root) / "target" / "bench" / "qwen35-4b-random-mlx-q4"
    if out.exists():
        shutil.rmtree(out)
    config = copy.deepcopy(BENCH_4B)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    # Everything stays lazy until the per-layer mx.eval below: the module's own initial weights are
    # replaced before they are computed, and each bf16 matrix lives only while its layer is quantized.
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(BENCH_4B_SEED), len(params))
    weights = []
    for (name, v), key in zip(params, keys):
        bf16 = mx.bfloat16
        if name.endswith("A_log"):
            w = mx.random.uniform(-1.0, 1.0, v.shape, bf16, key=key)
        elif name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
            w = mx.ones(v.shape, bf16)
        elif name.endswith("conv1d.weight"):  # mlx [C, K, 1]: depthwise, fan_in K
            w = mx.random.normal(v.shape, bf16, scale=v.shape[1] ** -0.5, key=key)
        elif v.ndim == 2:
            w = mx.random.normal(v.shape, bf16, scale=v.shape[-1] ** -0.5, key=key)
        else:
            raise SystemExit(f"no initialization for {name} {v.shape}")
        weights.append((name, w))
    model.update(tree_unflatten(weights))
    del params, weights
    model, config = quantize_model(model, config, 64, 4)
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    built = time.perf_counter() - start
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    del model
    saved = time.perf_counter() - start
    # mlx-lm's own loader on what was written, and a forward over two tokens: finite logits.
    model, _ = load_model(out)
    logits = model(mx.array([[13, 7932]]))
    mx.eval(logits)
    if not mx.all(mx.isfinite(logits)).item():
        raise SystemExit(f"{out}: non-finite logits")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out}: {size / 2**30:.2f} GiB, built in {built:.0f} s, saved at {saved:.0f} s, "
          f"reloaded and ran 2 tokens at {time.perf_counter() - start:.0f} s (logits std "
          f"{mx.std(logits.astype(mx.float32)).item():.3f})")


def hf_weights(model):
    """The f32 HF text checkpoint of exactly the weights a loaded mlx-lm model holds: quantized
    modules dequantized in f32 (f32 scales and biases), mlx-lm's qwen3_5 sanitize undone."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    weights, quantized = {}, set()
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            quantized.add(path)
            weights[f"{path}.weight"] = mx.dequantize(
                m.weight, scales=m.scales.astype(mx.float32), biases=m.biases.astype(mx.float32),
                group_size=m.group_size, bits=m.bits, mode=m.mode)
    for k, v in tree_flatten(model.parameters()):
        if k.rsplit(".", 1)[0] not in quantized:
            weights[k] = v.astype(mx.float32)
    hf = {}
    for k, v in weights.items():
        k = k.removeprefix("language_model.")
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        if k.endswith(SHIFTED_NORMS):
            v = v - 1.0
        hf[k] = np.array(v)
    return hf


def stage_reference(p):
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model
    from safetensors.numpy import save_file

    mx.set_default_device(mx.cpu)
    with open(os.path.join(p["source"], "config.json")) as f:
        config = json.load(f)
    config["dtype"] = "float32"
    for name in MLX_MODELS:
        model, _ = load_model(Path(p["models"]) / name)
        out = {}
        for i, ids in enumerate(prompts()):
            x = mx.array(ids)
            out[f"prompt{i}.mlx_logits"] = np.array(model(x[None])[0].astype(mx.float32))
            gen = [tok for tok, _ in generate_step(x, model, max_tokens=GREEDY_TOKENS)]
            out[f"prompt{i}.mlx_generated"] = np.array(gen, dtype=np.int64)
        weights = hf_weights(model)
        # The same mlx-lm model in f32 (scales and biases too): the check on the dequantized weights.
        model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                              model.parameters()))
        for i, ids in enumerate(prompts()):
            out[f"prompt{i}.mlx_f32_logits"] = np.array(model(mx.array(ids)[None])[0])
        deq = os.path.join(p["deq"], name)
        if os.path.exists(deq):
            shutil.rmtree(deq)
        os.makedirs(deq)
        save_file(out, os.path.join(deq, "mlx.safetensors"))
        save_file(weights, os.path.join(deq, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(deq, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        print(f"wrote {deq}")


def checked_reference(model, mlx, name, i, ids, tensors):
    """Prompt i's reference by transformers on `model` (full-prefill logits, greedy ids through the
    cache, checked to repeat) into `tensors`, beside mlx-lm's outputs from `mlx`; stops if
    transformers and mlx-lm with every parameter in f32 differ by more than F32_TOLERANCE.
    Returns the logits and that f32 difference."""
    import torch
    from make_fixtures import greedy_with_cache

    ids = torch.from_numpy(ids)
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float().contiguous()
    f32_diff = float((logits - mlx[f"prompt{i}.mlx_f32_logits"]).abs().max())
    if f32_diff > F32_TOLERANCE:
        raise SystemExit(f"{name}/prompt{i}: transformers vs mlx-lm in f32 differ by {f32_diff}")
    gen = greedy_with_cache(model, ids[None])
    if not torch.equal(gen, greedy_with_cache(model, ids[None])):
        raise SystemExit(f"{name}/prompt{i}: greedy ids differ between two runs")
    tensors[f"prompt{i}.ids"] = ids
    tensors[f"prompt{i}.logits"] = logits
    tensors[f"prompt{i}.generated"] = gen
    tensors[f"prompt{i}.mlx_logits"] = mlx[f"prompt{i}.mlx_logits"]
    tensors[f"prompt{i}.mlx_generated"] = mlx[f"prompt{i}.mlx_generated"]
    return logits, f32_diff


def stage_transformers(p):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(2)
    summary = {}
    for name in MLX_MODELS:
        deq = os.path.join(p["deq"], name)
        model, info = Qwen3_5ForCausalLM.from_pretrained(
            deq, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"]:
            raise SystemExit(f"{deq}: missing {info['missing_keys']}, unexpected {info['unexpected_keys']}")
        model.eval()
        mlx = load_file(os.path.join(deq, "mlx.safetensors"))
        tensors, diffs = {}, []
        for i, ids in enumerate(prompts()):
            logits, f32_diff = checked_reference(model, mlx, name, i, ids, tensors)
            diffs.append(float((logits - mlx[f"prompt{i}.mlx_logits"]).abs().max()))
            summary[f"{name}/prompt{i}"] = dict(generated=tensors[f"prompt{i}.generated"].tolist(),
                                                mlx_generated=mlx[f"prompt{i}.mlx_generated"].tolist(),
                                                f32_diff=f32_diff)
        save_file(tensors, os.path.join(p["reference"], f"{name}.safetensors"))
        print(f"{name}: max |mlx - transformers| logits {max(diffs):.4f} (per prompt {[round(d, 4) for d in diffs]})")
    print(json.dumps(summary, indent=1))


# The compressed-tensors fixture (--stage compressed): W4A16, int4 symmetric, group 64, pack-quantized,
# as llm-compressor publishes Qwen 3.5 (RedHatAI's W4A16), with lm_head and the GDN gates in_proj_a /
# in_proj_b left in bf16 (so one projection group mixes int4 and bf16).
CT_NAME = "ct_w4a16_g64"
CT_GROUP_SIZE = 64
CT_IGNORE = ["lm_head", "re:.*in_proj_[ab]$"]


def ct_quantization_config():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=CT_GROUP_SIZE, dynamic=False)
    return QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                              ignore=CT_IGNORE)


def unpack_int4(packed, n_in):
    """Our own reading of pack-quantized 4-bit (not compressed-tensors' unpack_from_int32): int32 word c
    of a row holds inputs 8c..8c+7, input 8c+j in bits 4j..4j+3 (low bits first), each stored as the
    unsigned u = q + 8 (q in [-8, 7]). Returns u as int64 [out, n_in]."""
    import torch

    words = packed.to(torch.int64) & 0xFFFFFFFF
    u = (words[..., None] >> (4 * torch.arange(8))) & 0xF
    return u.reshape(packed.shape[0], -1)[:, :n_in]


def manual_dequant(tensors, module):
    """w = s * (u - 8) in f32 from the checkpoint's weight_packed / weight_scale / weight_shape."""
    import torch

    out_f, in_f = tensors[f"{module}.weight_shape"].tolist()
    u = unpack_int4(tensors[f"{module}.weight_packed"], in_f)
    s = tensors[f"{module}.weight_scale"].float().repeat_interleave(CT_GROUP_SIZE, dim=1)
    return s * (u.float() - 8.0)


def stage_compressed(p):
    """compressed-tensors' own machinery on the bf16 source, as llm-compressor's QuantizationModifier
    (RTN, the min-max weight observer) and its save_pretrained wrapper do it: apply_quantization_config,
    per-group scales from min/max by calculate_qparams, then ModelCompressor.from_pretrained_model /
    compress_model / save_pretrained / update_config. The reference is transformers itself loading that
    directory (its compressed-tensors integration decompressing the packed weights), in f32."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from make_fixtures import greedy_with_cache
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(2)
    out = os.path.join(p["models"], CT_NAME)
    if os.path.exists(out):
        shutil.rmtree(out)

    # 1. Quantize as llm-compressor does: the model in its own dtype (bf16), the config applied, the
    # weight qparams observed (min-max over each group of 64 inputs), then frozen.
    model = Qwen3_5ForCausalLM.from_pretrained(p["source"], dtype=torch.bfloat16)
    apply_quantization_config(model, ct_quantization_config())
    quantized = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None:
                continue
            args = scheme.weights
            groups = m.weight.unflatten(-1, (-1, args.group_size))  # [out, in / g, g]
            scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            update_offload_parameter(m, "weight_scale", scale)
            update_offload_parameter(m, "weight_zero_point", zero_point)
            m.quantization_status = QuantizationStatus.FROZEN
            quantized[name] = (m.weight.detach().clone(), scale.detach().clone())
    ignored = sorted(n for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n not in quantized)
    expected_ignored = sorted(["lm_head"] + [f"model.layers.{i}.linear_attn.in_proj_{ab}"
                                             for i, t in enumerate(SOURCE_TEXT["layer_types"])
                                             if t == "linear_attention" for ab in "ab"])
    if ignored != expected_ignored:
        raise SystemExit(f"unquantized Linear modules {ignored}, expected {expected_ignored}")
    compressor = ModelCompressor.from_pretrained_model(model)
    if compressor.quantization_config.format != "pack-quantized":
        raise SystemExit(f"inferred format {compressor.quantization_config.format}, expected pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    del model
    files = sorted(os.listdir(out))
    if files != ["config.json", "model.safetensors"]:
        raise SystemExit(f"{out}: unexpected files {files}")
    print(f"wrote {out}: {sum(os.path.getsize(os.path.join(out, f)) for f in files)} bytes")

    # 2. The files, read by our own unpacking: every quantized module has exactly weight_packed (int32
    # [out, in / 8]), weight_scale (bf16 [out, in / 64]), weight_shape (i64 [2]); u = q + 8 takes both
    # ends 0 and 15; s * (u - 8) is within about s / 2 of the source weight; and q is
    # what compressed-tensors' quantize gives (clamp(round(w / s), -8, 7) in bf16).
    tensors = load_file(os.path.join(out, "model.safetensors"))
    source = load_file(os.path.join(p["source"], "model.safetensors"))
    u_seen = torch.zeros(16, dtype=torch.bool)
    for name, (w, scale) in quantized.items():
        keys = sorted(k for k in tensors if k.startswith(f"{name}."))
        if keys != [f"{name}.{s}" for s in ("weight_packed", "weight_scale", "weight_shape")]:
            raise SystemExit(f"{name}: tensors {keys}")
        packed, s, shape = (tensors[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape"))
        if (packed.dtype, s.dtype, shape.dtype) != (torch.int32, torch.bfloat16, torch.int64) \
                or tuple(packed.shape) != (w.shape[0], w.shape[1] // 8) \
                or tuple(s.shape) != (w.shape[0], w.shape[1] // CT_GROUP_SIZE) or shape.tolist() != list(w.shape):
            raise SystemExit(f"{name}: packed {packed.dtype} {tuple(packed.shape)}, scale {s.dtype} "
                             f"{tuple(s.shape)}, shape {shape.dtype} {shape.tolist()} for weight {tuple(w.shape)}")
        if not torch.equal(s, scale):
            raise SystemExit(f"{name}: saved scales differ from the observed ones")
        u = unpack_int4(packed, w.shape[1])
        u_seen[u.unique()] = True
        q_lib = torch.clamp(w / scale.repeat_interleave(CT_GROUP_SIZE, dim=1), -8, 7).round()
        if not torch.equal(u - 8, q_lib.to(torch.int64)):
            raise SystemExit(f"{name}: unpacked values differ from compressed-tensors' quantization")
        s_full = s.float().repeat_interleave(CT_GROUP_SIZE, dim=1)
        err = ((s_full * (u.float() - 8) - w.float()).abs() / s_full).max().item()
        # half a step, and at the group's max (w / s = 7.5 clamped to 7) up to 7.5 (1 + 2^-8) - 7 with
        # the bf16 scale max / 7.5 rounded down
        if err > 0.53:
            raise SystemExit(f"{name}: |s (u - 8) - w| up to {err:.3f} s")
    if not bool(u_seen.all()):
        raise SystemExit(f"unpacked u values seen {u_seen.nonzero().flatten().tolist()}, expected all of 0..15")
    plain = sorted(k for k in tensors if not k.rsplit(".", 1)[0] in quantized)
    for k in plain:
        if not torch.equal(tensors[k], source[k]):
            raise SystemExit(f"{k}: differs from the source")
    if len(plain) + len(quantized) != len(source):
        raise SystemExit(f"{len(plain)} plain + {len(quantized)} quantized tensors, source has {len(source)}")

    # 3. transformers on the compressed checkpoint, f32: it builds the compressed modules, loads the
    # packed tensors into them and decompresses on the first forward (compressed-tensors' pre-hook).
    model, info = Qwen3_5ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise SystemExit(f"{out}: missing {info['missing_keys']}, unexpected {info['unexpected_keys']}")
    model.eval()
    modules = dict(model.named_modules())
    for name in quantized:  # it really holds the packed weights before the first forward
        m = modules[name]
        if "weight" in dict(m.named_parameters(recurse=False)) or not torch.equal(m.weight_packed, tensors[f"{name}.weight_packed"]):
            raise SystemExit(f"{name}: transformers did not load the packed weight")
    manual = {name: manual_dequant(tensors, name) for name in quantized}
    ref, ct_logits = {}, []
    for i, ids in enumerate(prompts()):
        ids = torch.from_numpy(ids)
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float().contiguous()
        gen = greedy_with_cache(model, ids[None])
        if not torch.equal(gen, greedy_with_cache(model, ids[None])):
            raise SystemExit(f"{CT_NAME}/prompt{i}: greedy ids differ between two runs")
        ref[f"prompt{i}.ids"] = ids
        ref[f"prompt{i}.logits"] = logits
        ref[f"prompt{i}.generated"] = gen
        ct_logits.append(logits)
    worst = 0.0
    for name in quantized:  # decompressed by the hook: dense f32, exactly s * (u - 8)
        w = modules[name].weight
        if w.dtype != torch.float32:
            raise SystemExit(f"{name}: decompressed weight is {w.dtype}")
        worst = max(worst, (w - manual[name]).abs().max().item())
    print(f"transformers' decompressed weights vs our s * (u - 8) in f32: max |diff| {worst:.3e}")
    if worst != 0.0:
        raise SystemExit("transformers' decompressed weights are not s * (u - 8)")
    del model
    # transformers' other route, dequantize=True (its own load operation dequantizes each module while
    # loading) is not the reference: it multiplies in the checkpoint's scale dtype, so its f32 weights
    # are bf16(s * (u - 8)), not s * (u - 8). Checked as such, and how far its logits are reported.
    from transformers import CompressedTensorsConfig

    model = Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    modules = dict(model.named_modules())
    for name in quantized:
        if not torch.equal(modules[name].weight, manual[name].bfloat16().float()):
            raise SystemExit(f"{name}: transformers' dequantize=True weight is not bf16(s * (u - 8))")
    w_diff = max((modules[n].weight - manual[n]).abs().max().item() for n in quantized)
    with torch.no_grad():
        l_diff = max((model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].float()
                      - ct_logits[i]).abs().max().item() for i, ids in enumerate(prompts()))
    print(f"dequantize=True route (weights bf16(s * (u - 8))): weights max |diff| {w_diff:.3e}, "
          f"logits max |diff| {l_diff:.3e} from the reference")
    del model
    save_file(ref, os.path.join(p["reference"], f"{CT_NAME}.safetensors"))
    print(f"wrote {os.path.join(p['reference'], f'{CT_NAME}.safetensors')}")

    # 4. The same forward on our own dequantization: the bf16 source in f32 with every quantized
    # weight replaced by s * (u - 8) (the unquantized tensors were checked equal to the source's).
    model = Qwen3_5ForCausalLM.from_pretrained(p["source"], dtype=torch.float32, attn_implementation="eager").eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in manual.items():
            params[f"{name}.weight"].copy_(w)
    summary = {}
    for i, ids in enumerate(prompts()):
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0].float()
        diff = (logits - ct_logits[i]).abs().max().item()
        if diff > F32_TOLERANCE:
            raise SystemExit(f"{CT_NAME}/prompt{i}: transformers on the checkpoint vs our dequantization differ by {diff}")
        summary[f"{CT_NAME}/prompt{i}"] = dict(generated=ref[f"prompt{i}.generated"].tolist(), manual_diff=diff)
    print(json.dumps(summary, indent=1))


def load_deq(p, name):
    """transformers in f32 (eager) on the dequantized checkpoint of an MLX fixture."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    deq = os.path.join(p["deq"], name)
    model, info = Qwen3_5ForCausalLM.from_pretrained(
        deq, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise SystemExit(f"{deq}: missing {info['missing_keys']}, unexpected {info['unexpected_keys']}")
    return model.eval()


def stage_peft(p):
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("--stage peft needs PYTHONHASHSEED=0: peft saves target_modules from a set")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from make_fixtures import ALL12, greedy_with_cache, randomize_lora
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(2)
    # Made on the HF source (its module names), f32 so that A and B are f32, as make_adapters.py.
    source = Qwen3_5ForCausalLM.from_pretrained(p["source"], dtype=torch.float32, attn_implementation="eager")
    peft_model = get_peft_model(source, LoraConfig(r=LORA_RANK, lora_alpha=PEFT_ALPHA, lora_dropout=0.0,
                                                   target_modules=ALL12))
    randomize_lora(peft_model, PEFT_SEED, b_scale=PEFT_B_SCALE)
    # The base the adapter is for (save_pretrained would write the path the source was loaded from).
    peft_model.peft_config["default"].base_model_name_or_path = f"./tests/fixtures/models/{ADAPTER_BASE}"
    out = os.path.join(p["adapters"], PEFT_ADAPTER)
    if os.path.exists(out):
        shutil.rmtree(out)
    peft_model.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))
    print(f"wrote {out}")

    # The adapter as saved, on the dequantized quantized base.
    model = PeftModel.from_pretrained(load_deq(p, ADAPTER_BASE), out).eval()
    loras = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if len(loras) != 3 * 8 + 7:  # 3 GDN layers x (5 + 3 MLP), 1 attention layer x (4 + 3)
        raise SystemExit(f"{len(loras)} LoRA layers, expected 31")
    base_ref = load_file(os.path.join(p["reference"], f"{ADAPTER_BASE}.safetensors"))
    tensors = {}
    for i, ids in enumerate(prompts()):
        ids = torch.from_numpy(ids)
        if not torch.equal(ids, base_ref[f"prompt{i}.ids"]):
            raise SystemExit(f"prompt{i}: ids differ from {ADAPTER_BASE}'s reference")
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float().contiguous()
            for m in loras:
                m.set_scale("default", 0.5)
            half = model(input_ids=ids[None], use_cache=False).logits[0].float().contiguous()
            for m in loras:
                m.set_scale("default", 1.0)
        gen = greedy_with_cache(model, ids[None])
        if not torch.equal(gen, greedy_with_cache(model, ids[None])):
            raise SystemExit(f"{PEFT_ADAPTER}/prompt{i}: greedy ids differ between two runs")
        tensors[f"prompt{i}.ids"] = ids
        tensors[f"prompt{i}.logits"] = logits
        tensors[f"prompt{i}.generated"] = gen
        tensors[f"prompt{i}.logits_half"] = half
        effect = float((logits - base_ref[f"prompt{i}.logits"]).abs().max())
        print(f"{PEFT_ADAPTER}/prompt{i}: generated {gen.tolist()} (base {base_ref[f'prompt{i}.generated'].tolist()}), "
              f"max |adapter - base| logits {effect:.4f}, at 0.5 {float((half - base_ref[f'prompt{i}.logits']).abs().max()):.4f}")
    save_file(tensors, os.path.join(p["reference"], f"{PEFT_ADAPTER}.safetensors"))


def stage_mlx_lora(p):
    from pathlib import Path

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.generate import generate_step
    from mlx_lm.lora import CONFIG_DEFAULTS, build_parser
    from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
    from mlx_lm.utils import load_model, save_config
    from safetensors.numpy import save_file

    mx.set_default_device(mx.cpu)
    base = Path(p["models"]) / ADAPTER_BASE
    out = Path(p["adapters"]) / MLX_ADAPTER
    model, _ = load_model(base)

    # Every Linear of every layer, as mlx-lm collects them when lora_parameters has no keys, named
    # explicitly (sorted: a set's order follows the hash seed).
    keys = set()
    for layer in model.layers:
        layer.apply_to_modules(
            lambda k, m: keys.add(k) if isinstance(m, (nn.Linear, nn.QuantizedLinear)) else None)
    if len(keys) != 12:
        raise SystemExit(f"expected the 12 projections, found {sorted(keys)}")

    # adapter_config.json is vars(args) of `mlx_lm.lora --train`: the parsed command line with
    # CONFIG_DEFAULTS filled in (mlx_lm.lora.main), saved by save_config in train_model.
    args = vars(build_parser().parse_args([
        "--model", f"./tests/fixtures/models/{ADAPTER_BASE}", "--train", "--fine-tune-type", "lora",
        "--num-layers", str(len(model.layers)), "--iters", "0",
        "--adapter-path", f"./tests/fixtures/adapters/{MLX_ADAPTER}"]))
    for k, v in CONFIG_DEFAULTS.items():
        if args.get(k, None) is None:
            args[k] = v
    args["lora_parameters"] = dict(rank=LORA_RANK, dropout=0.0, scale=MLX_SCALE, keys=sorted(keys))

    # train_model: freeze, then linear_to_lora_layers (its new lora_a / lora_b are the trainables).
    model.freeze()
    linear_to_lora_layers(model, args["num_layers"], args["lora_parameters"])
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    if not all(k.endswith((".lora_a", ".lora_b")) for k in names) or len(names) != 2 * (3 * 8 + 7):
        raise SystemExit(f"unexpected trainable parameters {names}")
    # Random nonzero values (mlx-lm starts lora_b at zero), f32 like mlx-lm's own init.
    rng = np.random.default_rng(MLX_LORA_SEED)
    weights = []
    for k in sorted(names):
        shape = dict(tree_flatten(model.trainable_parameters()))[k].shape
        if k.endswith(".lora_a"):  # [in, r]
            v = rng.standard_normal(shape) / shape[0] ** 0.5
        else:  # [r, out]
            v = rng.standard_normal(shape) * MLX_B_SCALE / shape[0] ** 0.5 / MLX_SCALE
        weights.append((k, mx.array(v.astype(np.float32))))
    model.load_weights(weights, strict=False)

    # Saved as the trainer saves them, and the config as train_model saves it.
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    save_config(args, out / "adapter_config.json")
    print(f"wrote {out}")

    # mlx-lm with the adapter as saved (mlx_lm.utils.load with adapter_path): native, then in f32.
    model, _ = load_model(base)
    load_adapters(model, str(out))
    model.eval()
    res = {}
    for i, ids in enumerate(prompts()):
        x = mx.array(ids)
        res[f"prompt{i}.mlx_logits"] = np.array(model(x[None])[0].astype(mx.float32))
        gen = [tok for tok, _ in generate_step(x, model, max_tokens=GREEDY_TOKENS)]
        res[f"prompt{i}.mlx_generated"] = np.array(gen, dtype=np.int64)
    model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    for i, ids in enumerate(prompts()):
        res[f"prompt{i}.mlx_f32_logits"] = np.array(model(mx.array(ids)[None])[0])
    work = os.path.join(p["deq"], MLX_ADAPTER)
    os.makedirs(work, exist_ok=True)
    save_file(res, os.path.join(work, "mlx.safetensors"))
    print(f"wrote {work}")


def stage_mlx_lora_reference(p):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(2)
    adapter = os.path.join(p["adapters"], MLX_ADAPTER)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        lora = json.load(f)["lora_parameters"]
    mlx_weights = load_file(os.path.join(adapter, "adapters.safetensors"))
    # language_model.model.layers.N.<module>.lora_a -> the HF module model.layers.N.<module>
    modules = sorted({k.removeprefix("language_model.").rsplit(".", 1)[0] for k in mlx_weights})
    # delta = scale * (x @ lora_a) @ lora_b = (lora_alpha / r) * lora_B(lora_A(x)), lora_alpha = scale * r
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["scale"] * lora["rank"], lora_dropout=0.0,
                        target_modules=modules)
    model = get_peft_model(load_deq(p, ADAPTER_BASE), config)
    params = dict(model.named_parameters())
    assigned = set()
    with torch.no_grad():
        for m in modules:
            for mlx_leaf, peft_leaf in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                name = f"base_model.model.{m}.{peft_leaf}.default.weight"
                src = mlx_weights[f"language_model.{m}.{mlx_leaf}"].T
                if params[name].shape != src.shape:
                    raise SystemExit(f"{name}: {tuple(params[name].shape)} vs mlx {tuple(src.shape)}")
                params[name].copy_(src)
                assigned.add(name)
    left = [k for k in params if "lora_" in k and k not in assigned]
    if left:
        raise SystemExit(f"peft LoRA parameters without an MLX tensor: {left}")
    model.eval()

    mlx = load_file(os.path.join(p["deq"], MLX_ADAPTER, "mlx.safetensors"))
    base_ref = load_file(os.path.join(p["reference"], f"{ADAPTER_BASE}.safetensors"))
    tensors = {}
    for i, ids in enumerate(prompts()):
        logits, f32_diff = checked_reference(model, mlx, MLX_ADAPTER, i, ids, tensors)
        gen = tensors[f"prompt{i}.generated"]
        native = float((logits - mlx[f"prompt{i}.mlx_logits"]).abs().max())
        effect = float((logits - base_ref[f"prompt{i}.logits"]).abs().max())
        print(f"{MLX_ADAPTER}/prompt{i}: f32 diff {f32_diff:.2e}, max |mlx native - transformers| {native:.4f}, "
              f"max |adapter - base| {effect:.4f}; generated {gen.tolist()}, "
              f"mlx {mlx[f'prompt{i}.mlx_generated'].tolist()}, base {base_ref[f'prompt{i}.generated'].tolist()}")
    save_file(tensors, os.path.join(p["reference"], f"{MLX_ADAPTER}.safetensors"))


def stage_learn(p):
    """LoRA gradients on the 4-bit base: make_learn.py's oracle (PyTorch autograd through
    transformers + peft) on the dequantized mlx_q4_g64, for an adapter on the last layer's seven
    projections; the engine computes them with its backward reading the 4-bit weights."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("--stage learn needs PYTHONHASHSEED=0: peft saves target_modules from a set")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from make_fixtures import randomize_lora
    from make_learn import EVENTS, SCORES, TARGETS, loss_of

    torch.set_num_threads(2)
    model = load_deq(p, "mlx_q4_g64")
    layer = SOURCE_TEXT["num_hidden_layers"] - 1
    config = LoraConfig(lora_dropout=0.0, target_modules=TARGETS, layers_to_transform=[layer], r=4, lora_alpha=8)
    peft_model = get_peft_model(model, config)
    randomize_lora(peft_model, 2100, b_scale=0.5)
    peft_model.eval()
    g = torch.Generator().manual_seed(3100)
    vocab = SOURCE_TEXT["vocab_size"]
    events = [(torch.randint(0, vocab, (n,), generator=g), torch.randint(0, vocab, (m,), generator=g))
              for n, m in EVENTS]
    ref = {}
    for i, (prompt, response) in enumerate(events):
        ref[f"q4_last.e{i}.prompt"] = prompt
        ref[f"q4_last.e{i}.response"] = response
    ref["q4_last.scores"] = torch.tensor(SCORES, dtype=torch.float32)
    params = {n: q for n, q in peft_model.named_parameters() if "lora_" in n}
    for loss_name, weights in [("supervised", [1.0] * len(events)), ("reward", [s - 0.5 for s in SCORES])]:
        peft_model.zero_grad()
        loss = loss_of(peft_model, events, weights)
        loss.backward()
        for n, q in params.items():
            module, which = n[n.rindex("layers."):].replace(".default.weight", "").rsplit(".", 1)
            ref[f"q4_last.{loss_name}.{module}.{which}"] = q.grad.detach().clone().contiguous()
        print("q4_last", loss_name, loss.item())
    target = os.path.join(p["adapters"], "..", "learn", "q4_last")
    if os.path.exists(target):
        shutil.rmtree(target)
    # The base it applies to, not the uncommitted dequantized copy the oracle ran on.
    peft_model.peft_config["default"].base_model_name_or_path = "./tests/fixtures/models/mlx_q4_g64"
    peft_model.save_pretrained(target)
    os.remove(os.path.join(target, "README.md"))
    save_file(ref, os.path.join(p["reference"], "learn_q4.safetensors"))
    print(f"wrote {target}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="repository root")
    ap.add_argument("--stage", required=True, choices=["source", "convert", "reference", "transformers", "peft",
                                                       "compressed", "mlx-lora", "mlx-lora-reference", "learn",
                                                       "bench", "bench-4b"])
    args = ap.parse_args()
    p = paths(args.root)
    if args.stage == "bench":
        stage_bench(p, args.root)
        return
    if args.stage == "bench-4b":
        stage_bench_4b(args.root)
        return
    stages = {"source": stage_source, "convert": stage_convert, "reference": stage_reference,
              "transformers": stage_transformers, "compressed": stage_compressed, "peft": stage_peft,
              "mlx-lora": stage_mlx_lora,
              "mlx-lora-reference": stage_mlx_lora_reference, "learn": stage_learn}
    stages[args.stage](p)


if __name__ == "__main__":
    main()
