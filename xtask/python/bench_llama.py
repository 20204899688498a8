"""llama.cpp (through llama-cpp-python, built from source) on the same checkpoint and adapter as
`cargo xtask bench` measures our engine with: the checkpoint and the PEFT adapter are converted to
GGUF with llama.cpp's own converters (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py` from the
package's source tree), then prefill and decode tokens/s are measured without and with the LoRA on
the CPU with 2 threads. Prints one JSON line.

The random-weight checkpoint has no tokenizer of its own; the converters need one, so the demo
model's (a 420-token BPE) is put beside it and the vocabulary is padded to the checkpoint's
vocab_size by the converter. Its pre-tokenizer hash is unknown to llama.cpp, so the converter is
told it is Qwen 3.5's ("qwen35"); the benchmark feeds token ids, never text, so the tokenizer
never runs. The checkpoint has no multi-token-prediction layers, so the converters are told so
(the HF converter's `--no-mtp`, which the LoRA converter lacks).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def summary(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


CONVERT = """
import sys
sys.argv = sys.argv[1:]
import conversion.base as base
import conversion.qwen as qwen
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
qwen.Qwen3_5TextModel.no_mtp = True
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(llama_src: Path, model: Path, adapter: Path, tokenizer_from: Path, out: Path):
    """GGUF files of the checkpoint (bf16, as stored) and of the adapter (f32), made once."""
    llama_src, model, adapter, tokenizer_from, out = (p.resolve() for p in (llama_src, model, adapter, tokenizer_from, out))
    out.mkdir(parents=True, exist_ok=True)
    base_gguf, lora_gguf = out / "model-bf16.gguf", out / "lora-f32.gguf"
    hf = out / "hf"
    if not hf.is_dir():
        hf.mkdir()
        for f in model.iterdir():
            os.symlink(f.resolve(), hf / f.name)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, hf / name)
    env = dict(os.environ, PYTHONPATH=str(llama_src / "gguf-py"))
    run = lambda args: subprocess.run(
        [sys.executable, "-c", CONVERT, *args], cwd=llama_src, env=env, check=True, stdout=sys.stderr
    )
    if not base_gguf.is_file():
        run(["convert_hf_to_gguf.py", str(hf), "--outtype", "bf16", "--outfile", str(base_gguf)])
    if not lora_gguf.is_file():
        run(["convert_lora_to_gguf.py", str(adapter), "--base", str(hf), "--outtype", "f32",
             "--outfile", str(lora_gguf)])
    return base_gguf, lora_gguf


def measure(llm, ids, decode, repeats):
    def once():
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(decode):
            llm.eval([ids[i % len(ids)]])
        return len(ids) / prefill, decode / (time.perf_counter() - t)

    rows = [once() for _ in range(repeats + 1)][1:]
    return summary([r[0] for r in rows]), summary([r[1] for r in rows])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--adapter", required=True, type=Path)
    ap.add_argument("--llama-src", required=True, type=Path, help="llama.cpp source tree (the sdist's vendor/llama.cpp)")
    ap.add_argument("--tokenizer-from", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    base_gguf, lora_gguf = convert(args.llama_src, args.model, args.adapter, args.tokenizer_from, args.out)

    import llama_cpp

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ids = [(i * 7919 + 13) % vocab for i in range(args.prompt)]
    common = dict(n_ctx=args.prompt + args.decode + 8, n_batch=args.prompt, n_ubatch=args.prompt, n_threads=2,
                  n_threads_batch=2, verbose=False)
    llm = llama_cpp.Llama(model_path=str(base_gguf), **common)
    base_prefill, base_decode = measure(llm, ids, args.decode, args.repeats)
    del llm
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(base_gguf), lora_path=str(lora_gguf), lora_scale=1.0, **common)
    load_with_lora = time.perf_counter() - t
    lora_prefill, lora_decode = measure(llm, ids, args.decode, args.repeats)
    print(json.dumps({
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) CPU, 2 threads, bf16 weights, f32 LoRA",
        "prefill_tok_s": base_prefill, "decode_tok_s": base_decode,
        "adapter_prefill_tok_s": lora_prefill, "adapter_decode_tok_s": lora_decode,
        "model_plus_lora_load_s": load_with_lora,
        "gguf_bytes": base_gguf.stat().st_size, "lora_gguf_bytes": lora_gguf.stat().st_size,
    }))


if __name__ == "__main__":
    main()
