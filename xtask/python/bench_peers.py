"""transformers + peft on the same checkpoint and adapter as `cargo xtask bench` measures our
engine with: prefill and decode tokens/s without and with the adapter (unmerged), the time of
peft's `set_adapter` and of merge/unmerge. PyTorch on the CPU with 2 threads. Prints one JSON line.
"""

import argparse
import json
import statistics
import time

import torch
from peft import PeftModel
from transformers import DynamicCache, Qwen3_5ForCausalLM


def timed(fn, repeats):
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


@torch.no_grad()
def run(model, ids, decode):
    cache = DynamicCache(config=model.config)
    t = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    prefill = time.perf_counter() - t
    nxt = out.logits[0, -1].argmax().view(1, 1)
    t = time.perf_counter()
    for _ in range(decode):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[0, -1].argmax().view(1, 1)
    return ids.shape[1] / prefill, decode / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = Qwen3_5ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[(i * 7919 + 13) % vocab for i in range(args.prompt)]])

    def measure():
        rows = [run(model, ids, args.decode) for _ in range(args.repeats + 1)][1:]
        return summary([r[0] for r in rows]), summary([r[1] for r in rows])

    base_prefill, base_decode = measure()
    model = PeftModel.from_pretrained(model, args.adapter, adapter_name="a").eval()
    model.load_adapter(args.adapter, adapter_name="b")
    model.set_adapter("a")
    lora_prefill, lora_decode = measure()
    switch = []
    for i in range(200):
        t = time.perf_counter()
        model.set_adapter("b" if i % 2 == 0 else "a")
        switch.append((time.perf_counter() - t) * 1e6)
    merge = timed(lambda: (model.merge_adapter(), model.unmerge_adapter()), 3)
    print(json.dumps({
        "engine": f"transformers {__import__('transformers').__version__} + peft {__import__('peft').__version__}, torch {torch.__version__} CPU, 2 threads, f32",
        "prefill_tok_s": base_prefill, "decode_tok_s": base_decode,
        "adapter_prefill_tok_s": lora_prefill, "adapter_decode_tok_s": lora_decode,
        "set_adapter_us": summary(switch), "merge_plus_unmerge_s": summary(merge),
    }))


if __name__ == "__main__":
    main()
