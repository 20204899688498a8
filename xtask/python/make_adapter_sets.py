"""peft's outputs with several adapters active at once, with per-adapter and per-module scales.

Run through `cargo xtask fixtures` after make_adapters.py. The committed fixture adapters of
gva_tied_f32 are loaded into one PeftModel; each case activates a set with
`base_model.set_adapter([...])` (peft sums the active adapters' deltas in every LoRA layer) and
sets each adapter's scale per module with `LoraLayer.set_scale`, which is scale · alpha / r (or
alpha / √r): a factor of 0 turns the adapter off on that module. Run unmerged in f32.

The cases (tests/adapter_sets.rs builds the same sets; keep them in step):
  pair        all12_r8 1.0 + gdn_mlp_r4_rslora 1.0
  weighted    all12_r8 0.7 + gdn_mlp_r4_rslora -0.5
  triple      all12_r8 1.0 + patterns_r16 0.5 + layers_0_3 -1.5
  layers      all12_r8 1.0, factor 0 on layers 0-1 and on every attention projection
              (q/k/v/o_proj), 0.5 on layer 5
  pair_layers all12_r8 1.0 on layers 6-7 only + gdn_mlp_r4_rslora 2.0 with factor 0 on the MLP

Output: tests/fixtures/reference/adapter_sets.safetensors
    ids                  [T] i64   the prompt (prompt1 of gva_tied_f32's fixture)
    <case>.logits        [T, V]    logits with the set active
    <case>.generated     [N] i64   greedy continuation (with the cache)
"""

import argparse
import os
import re

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from make_adapters import load_base, run

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def layer_of(name):
    return int(re.search(r"\.layers\.(\d+)\.", name).group(1))


def factor_layers(off=(), attention=1.0, half=()):
    def f(name):
        layer = layer_of(name)
        if layer in off:
            return 0.0
        if name.split(".")[-1] in ATTENTION:
            return attention
        return 0.5 if layer in half else 1.0
    return f


def only_layers(keep):
    return lambda name: 1.0 if layer_of(name) in keep else 0.0


def no_mlp(name):
    return 0.0 if name.split(".")[-1] in MLP else 1.0


def everywhere(_name):
    return 1.0


# case: [(adapter, scale, factor(module name))]
CASES = {
    "pair": [("all12_r8", 1.0, everywhere), ("gdn_mlp_r4_rslora", 1.0, everywhere)],
    "weighted": [("all12_r8", 0.7, everywhere), ("gdn_mlp_r4_rslora", -0.5, everywhere)],
    "triple": [("all12_r8", 1.0, everywhere), ("patterns_r16", 0.5, everywhere), ("layers_0_3", -1.5, everywhere)],
    "layers": [("all12_r8", 1.0, factor_layers(off=(0, 1), attention=0.0, half=(5,)))],
    "pair_layers": [("all12_r8", 1.0, only_layers((6, 7))), ("gdn_mlp_r4_rslora", 2.0, no_mlp)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    adapters = os.path.join(args.root, "tests", "fixtures", "adapters")
    base_ref = load_file(os.path.join(args.root, "tests", "fixtures", "reference", "gva_tied_f32.safetensors"))
    ids = base_ref["prompt1.ids"].view(1, -1)
    names = ["all12_r8", "gdn_mlp_r4_rslora", "patterns_r16", "layers_0_3"]
    model = PeftModel.from_pretrained(load_base(args.root, "gva_tied_f32"), os.path.join(adapters, names[0]),
                                      adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(os.path.join(adapters, name), adapter_name=name)
    model.eval()
    ref = {"ids": ids[0].contiguous()}
    for case, entries in CASES.items():
        model.base_model.set_adapter([a for a, _, _ in entries])
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            for adapter, scale, factor in entries:
                module.set_scale(adapter, scale * factor(module_name))
        logits, gen = run(model, ids)
        ref[f"{case}.logits"] = logits
        ref[f"{case}.generated"] = gen
        print(case, gen.tolist())
    save_file(ref, os.path.join(args.root, "tests", "fixtures", "reference", "adapter_sets.safetensors"))


if __name__ == "__main__":
    main()
