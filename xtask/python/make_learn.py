"""Oracle for on-GPU learning: LoRA gradients by PyTorch autograd through transformers + peft.

Run through `cargo xtask fixtures` after make_fixtures.py. For each case, a PEFT adapter on the
last (full-attention) layer's seven projections (q/k/v/o, gate/up/down) with nonzero random A and B
is saved, and for fixed events the gradients of the engine's loss with respect to every lora_A
and lora_B are recorded:

  L = (1/E) sum_e w_e * mean_t CE(response token t of event e | everything before it)
  supervised: w_e = 1;  reward-weighted: w_e = score_e - 0.5 (the engine's starting baseline)

Outputs:
  tests/fixtures/learn/<case>/                 adapter_config.json + adapter_model.safetensors
  tests/fixtures/reference/learn.safetensors
      <case>.e<i>.prompt / .response   [n] i64   the events
      <case>.scores                    [E] f32   the scores of the reward-weighted loss
      <case>.<loss>.<module>.lora_A    [r, in]   dL/dA  (loss: supervised | reward)
      <case>.<loss>.<module>.lora_B    [out, r]  dL/dB  (module: layers.<i>.mlp.gate_proj, ...)
"""

import argparse
import os
import shutil

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file

from make_adapters import load_base
from make_fixtures import randomize_lora

CASES = {
    # f32, tied embeddings, GVA; one rank for all four modules.
    "gva_last": dict(base="gva_tied_f32", layer=7, config=dict(r=4, lora_alpha=8)),
    # bf16 weights in the VLM layout; q_proj and gate_proj with a larger rank than the other
    # members of their group (t offsets).
    "vlm_last": dict(base="vlm_bf16_sharded", layer=3,
                     config=dict(r=4, lora_alpha=4, rank_pattern={"gate_proj": 8, "q_proj": 8})),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EVENTS = [(5, 4), (3, 6)]  # (prompt length, response length)
SCORES = [0.9, 0.2]


def loss_of(model, events, weights):
    total = 0.0
    for (prompt, response), w in zip(events, weights):
        ids = torch.cat([prompt, response]).view(1, -1)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        p = prompt.numel()
        rows = logits[p - 1 : ids.shape[1] - 1]
        ce = torch.nn.functional.cross_entropy(rows, response, reduction="mean")
        total = total + w / len(events) * ce
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    out_dir = os.path.join(args.root, "tests", "fixtures", "learn")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    ref = {}
    for seed, (name, spec) in enumerate(CASES.items()):
        model = load_base(args.root, spec["base"])
        vocab = model.config.get_text_config().vocab_size
        config = LoraConfig(lora_dropout=0.0, target_modules=TARGETS, layers_to_transform=[spec["layer"]],
                            **spec["config"])
        peft_model = get_peft_model(model, config)
        randomize_lora(peft_model, 2000 + seed, b_scale=0.5)
        peft_model.eval()
        g = torch.Generator().manual_seed(3000 + seed)
        events = [(torch.randint(0, vocab, (p,), generator=g), torch.randint(0, vocab, (r,), generator=g))
                  for p, r in EVENTS]
        for i, (prompt, response) in enumerate(events):
            ref[f"{name}.e{i}.prompt"] = prompt
            ref[f"{name}.e{i}.response"] = response
        ref[f"{name}.scores"] = torch.tensor(SCORES, dtype=torch.float32)
        params = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
        for loss_name, weights in [("supervised", [1.0] * len(events)), ("reward", [s - 0.5 for s in SCORES])]:
            peft_model.zero_grad()
            loss = loss_of(peft_model, events, weights)
            loss.backward()
            for n, p in params.items():
                module, which = n[n.rindex("layers."):].replace(".default.weight", "").rsplit(".", 1)
                ref[f"{name}.{loss_name}.{module}.{which}"] = p.grad.detach().clone().contiguous()
            print(name, loss_name, loss.item())
        target = os.path.join(out_dir, name)
        peft_model.save_pretrained(target)
        os.remove(os.path.join(target, "README.md"))
    save_file(ref, os.path.join(args.root, "tests", "fixtures", "reference", "learn.safetensors"))


if __name__ == "__main__":
    main()
