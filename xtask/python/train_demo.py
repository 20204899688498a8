"""Train the embedded demo model, its tokenizer and two LoRA adapters, on CPU, from a synthetic corpus.

Run through `cargo xtask train-demo` (same pinned venv as the fixtures; ~10 minutes on 2 cores).

The corpus is synthesised here (no download, no licence question): short questions about a few
dozen everyday things, answered in one sentence, in the Qwen chat format. The base model learns
to answer in English. Two PEFT LoRA adapters are then trained on top of the frozen base:

* `shout` (MLP projections only: gate_proj, up_proj, down_proj) answers in capitals;
* `french` (Gated DeltaNet and attention projections: in_proj_qkv, in_proj_z, in_proj_b,
  in_proj_a, out_proj, q/k/v/o_proj) answers in French.

Outputs (committed; a few MB):
  examples/assets/demo/                   model (bf16), tokenizer.json, tokenizer_config.json (with
                                          the chat template), generation_config.json
  examples/assets/demo/adapters/{shout,french}/
  tests/fixtures/reference/demo.json      greedy generations by transformers + peft for fixed
                                          prompts: rendered prompt ids, generated ids and text
"""

import argparse
import json
import os
import random
import shutil
import time

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

# name, gender (m/f, for French agreement), French name, colour key, place key, kind (en, fr)
THINGS = [
    ("sky", "m", "ciel", "blue", "top", ("view", "vue")),
    ("sea", "f", "mer", "blue", "bottom", ("water", "eau")),
    ("grass", "f", "herbe", "green", "garden", ("plant", "plante")),
    ("leaf", "f", "feuille", "green", "tree", ("plant", "plante")),
    ("cat", "m", "chat", "black", "house", ("animal", "animal")),
    ("dog", "m", "chien", "brown", "garden", ("animal", "animal")),
    ("horse", "m", "cheval", "white", "field", ("animal", "animal")),
    ("cow", "f", "vache", "white", "field", ("animal", "animal")),
    ("bird", "m", "oiseau", "yellow", "tree", ("animal", "animal")),
    ("fish", "m", "poisson", "red", "bottom", ("animal", "animal")),
    ("apple", "f", "pomme", "red", "kitchen", ("fruit", "fruit")),
    ("banana", "f", "banane", "yellow", "kitchen", ("fruit", "fruit")),
    ("lemon", "m", "citron", "yellow", "kitchen", ("fruit", "fruit")),
    ("cherry", "f", "cerise", "red", "tree", ("fruit", "fruit")),
    ("car", "f", "voiture", "red", "street", ("machine", "machine")),
    ("bus", "m", "bus", "yellow", "street", ("machine", "machine")),
    ("train", "m", "train", "grey", "station", ("machine", "machine")),
    ("bike", "m", "vélo", "green", "street", ("machine", "machine")),
    ("door", "f", "porte", "brown", "house", ("thing", "chose")),
    ("table", "f", "table", "brown", "kitchen", ("thing", "chose")),
    ("chair", "f", "chaise", "black", "kitchen", ("thing", "chose")),
    ("bed", "m", "lit", "white", "house", ("thing", "chose")),
    ("book", "m", "livre", "blue", "school", ("thing", "chose")),
    ("pen", "m", "stylo", "black", "school", ("thing", "chose")),
    ("snow", "f", "neige", "white", "top", ("weather", "météo")),
    ("cloud", "m", "nuage", "grey", "top", ("weather", "météo")),
    ("rose", "f", "rose", "red", "garden", ("flower", "fleur")),
    ("tulip", "f", "tulipe", "yellow", "garden", ("flower", "fleur")),
    ("moon", "f", "lune", "white", "top", ("star", "astre")),
    ("sun", "m", "soleil", "yellow", "top", ("star", "astre")),
]

COLOURS = {  # en: (fr masculine, fr feminine)
    "blue": ("bleu", "bleue"), "green": ("vert", "verte"), "black": ("noir", "noire"),
    "brown": ("brun", "brune"), "white": ("blanc", "blanche"), "yellow": ("jaune", "jaune"),
    "red": ("rouge", "rouge"), "grey": ("gris", "grise"),
}
PLACES = {  # key: (English phrase, French phrase)
    "top": ("up high", "en haut"), "bottom": ("down low", "en bas"), "garden": ("in the garden", "dans le jardin"),
    "tree": ("in the tree", "dans l'arbre"), "house": ("in the house", "dans la maison"),
    "field": ("in the field", "dans le champ"), "kitchen": ("in the kitchen", "dans la cuisine"),
    "street": ("in the street", "dans la rue"), "station": ("at the station", "à la gare"),
    "school": ("at school", "à l'école"),
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPTS = ["What color is the sky?", "Where is the cat?", "What is the apple?", "What color is the bike?"]


def article_fr(gender, noun):
    if noun[0] in "aeiouéh":
        return "L'" + noun
    return ("Le " if gender == "m" else "La ") + noun


def qa_pairs():
    """(question, English answer, French answer) for every thing and question type."""
    out = []
    for name, gender, fr, colour, place, (kind_en, kind_fr) in THINGS:
        subj_fr = article_fr(gender, fr)
        col_fr = COLOURS[colour][0 if gender == "m" else 1]
        article_en = "an" if kind_en[0] in "aeiou" else "a"
        article_kind_fr = "un" if kind_fr in ("animal", "fruit", "astre") else "une"
        out.append((f"What color is the {name}?", f"The {name} is {colour}.", f"{subj_fr} est {col_fr}."))
        out.append((f"Where is the {name}?", f"The {name} is {PLACES[place][0]}.", f"{subj_fr} est {PLACES[place][1]}."))
        out.append((f"What is the {name}?", f"The {name} is {article_en} {kind_en}.", f"{subj_fr} est {article_kind_fr} {kind_fr}."))
    return out


def chat(q, a):
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"


def train_tokenizer(texts, out_dir):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def batches(tok, texts, batch, rng):
    # Sequences pack 1-4 conversations: the GDN fallback's cost is per call, not per token.
    while True:
        chosen = ["".join(texts[rng.randrange(len(texts))] for _ in range(rng.randint(1, 4))) for _ in range(batch)]
        enc = tok(chosen, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        yield enc["input_ids"], enc["attention_mask"], labels


def fit(model, tok, texts, steps, lr, seed, label):
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    gen = batches(tok, texts, 32, rng)
    t0 = time.time()
    for step in range(steps):
        ids, mask, labels = next(gen)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"{label} step {step} loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
    model.eval()


@torch.no_grad()
def greedy(model, tok, question, max_new=32):
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    new = out[0, ids.shape[1]:].tolist()
    return prompt, ids[0].tolist(), new, tok.decode(new, skip_special_tokens=True)


def accuracy(model, tok, pairs, pick):
    sample = pairs[::3]
    ok = sum(greedy(model, tok, q, max_new=24)[3] == pick(en, fr) for q, en, fr in sample)
    return f"{ok}/{len(sample)}"



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--base-steps", type=int, default=500)
    ap.add_argument("--adapter-steps", type=int, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    out_dir = os.path.join(args.root, "examples", "assets", "demo")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    pairs = qa_pairs()
    english = [chat(q, en) for q, en, _ in pairs]
    shout = [chat(q, en.upper()) for q, en, _ in pairs]
    french = [chat(q, fr) for q, _, fr in pairs]
    tok = train_tokenizer(english + shout + french, out_dir)
    print("vocab", len(tok))

    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="eager").float()
    # The base model also reads the capitalised and French sentences as plain text (no chat
    # format), so every token the adapters will need has a trained embedding; in a chat it
    # answers in English.
    documents = [en.upper() + "\n" for _, en, _ in pairs] + [fr + "\n" for _, _, fr in pairs]
    fit(model, tok, english + english + documents, args.base_steps, 2e-3, 1, "base")
    # Keep exactly what is shipped: bf16 weights, used in f32 by every reference below.
    model = model.to(torch.bfloat16).float().eval()
    print("base accuracy", accuracy(model, tok, pairs, lambda en, fr: en))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model = Qwen3_5ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [cfg.eos_token_id], "pad_token_id": cfg.pad_token_id, "do_sample": False}, f, indent=2)

    reference = {"prompts": PROMPTS, "max_new_tokens": 32, "outputs": {}}

    def record(name, m):
        rows = []
        for q in PROMPTS:
            prompt, ids, new, text = greedy(m, tok, q)
            rows.append({"question": q, "prompt": prompt, "prompt_ids": ids, "generated_ids": new, "text": text})
            print(f"{name:>6}: {q} -> {text}")
        reference["outputs"][name] = rows

    record("base", model)
    adapters = {
        "shout": (shout, ["gate_proj", "up_proj", "down_proj"], lambda en, fr: en.upper()),
        "french": (french, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                            "q_proj", "k_proj", "v_proj", "o_proj"], lambda en, fr: fr),
    }
    for i, (name, (texts, targets, pick)) in enumerate(adapters.items()):
        base = Qwen3_5ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
        peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
        fit(peft_model, tok, texts, args.adapter_steps, 3e-3, 10 + i, name)
        print(f"{name} accuracy", accuracy(peft_model, tok, pairs, pick))
        record(name, peft_model)
        target = os.path.join(out_dir, "adapters", name)
        peft_model.save_pretrained(target)
        os.remove(os.path.join(target, "README.md"))
    with open(os.path.join(args.root, "tests", "fixtures", "reference", "demo.json"), "w") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
