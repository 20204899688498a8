"""mlx-lm on the CPU as a benchmark peer, on the MLX checkpoints `make_mlx.py --stage bench` (and
--stage bench-4b) writes: prefill and decode tokens/s with the same prompt ids as `cargo xtask bench`.
Runs in the mlx venv. Prints one JSON line.

The checkpoints have no tokenizer, so the model is loaded with mlx_lm.utils.load_model (mlx_lm.load
wants one). Prefill is one forward over the prompt with a fresh cache (make_prompt_cache) and the
output projection on the last position only (mlx-lm's generate_step never projects the other prompt
positions either), then mx.eval of those logits; decode is M greedy steps through that cache, one
token each, argmax and mx.eval every step (generate_step without its async_eval pipelining). One
warm-up run, then R timed ones.

The mlx-cpu wheel links the reference (netlib) BLAS and LAPACK and runs its ops on one CPU stream:
"cpu_time_over_wall" is the process's CPU seconds over wall seconds in the timed runs, the number
of cores it actually kept busy. Its CPU quantized matmul is a plain loop (~0.15 GMAC/s here, against
~1-3 for the same product in bf16, and no faster for 16 rows than for one), so the 0.8B 4-bit model
runs at ~0.3 tokens/s in prefill and ~0.2 in decode: --prompt 128 --decode 64 --repeats 5 takes over
an hour.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path


def summary(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def cpu_seconds():
    t = os.times()
    return t.user + t.system


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path, help="an MLX checkpoint directory (config.json + model*.safetensors)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import compute_bits_per_weight, load_model

    mx.set_default_device(mx.cpu)
    t = time.perf_counter()
    model, config = load_model(args.model)
    load_s = time.perf_counter() - t
    model.eval()
    text = model.language_model if hasattr(model, "language_model") else model
    body = text.model

    def last_logits(ids, cache):
        h = body(ids[None], cache=cache)[:, -1:, :]
        if text.args.tie_word_embeddings:
            return body.embed_tokens.as_linear(h)[:, -1, :]
        return text.lm_head(h)[:, -1, :]

    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    ids = mx.array([(i * 7919 + 13) % vocab for i in range(args.prompt)], dtype=mx.int32)

    def once():
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = last_logits(ids, cache)
        y = mx.argmax(logits, axis=-1)
        mx.eval(y)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.decode):
            logits = model(y[None], cache=cache)[:, -1, :]
            y = mx.argmax(logits, axis=-1)
            mx.eval(y)
        decode = time.perf_counter() - t
        return args.prompt / prefill, args.decode / decode, prefill + decode

    once()  # warm-up
    cpu0, rows = cpu_seconds(), []
    for _ in range(args.repeats):
        rows.append(once())
    busy = (cpu_seconds() - cpu0) / sum(r[2] for r in rows)
    quant = config.get("quantization")
    print(json.dumps({
        "engine": f"mlx-lm {mlx_lm.__version__} (mlx {mx.__version__}) CPU, "
                  + (f"{quant['bits']}-bit g{quant['group_size']} {quant.get('mode', 'affine')}" if quant else "unquantized"),
        "model": str(args.model),
        "device": str(mx.default_device()),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": "one CPU stream (mlx-cpu wheel, reference BLAS)",
        "cpu_time_over_wall": busy,
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
        "quantization": quant,
        "bits_per_weight": compute_bits_per_weight(model),
        "model_load_s": load_s,
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "repeats": args.repeats,
        "prefill_tok_s": summary([r[0] for r in rows]),
        "decode_tok_s": summary([r[1] for r in rows]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "mlx_peak_memory_bytes": mx.get_peak_memory(),
    }))


if __name__ == "__main__":
    main()
