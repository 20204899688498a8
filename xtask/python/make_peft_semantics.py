"""peft's own decisions on adapter_config.json fields, for the engine's CPU-only config tests.

For each case below, real peft (0.21) decides, for every module name in NAMES (full names inside
the PEFT model: `model.layers.N…` for the text class, `model.language_model.layers.N…` for the
VLM class), whether the module is targeted (`check_target_module_exists`, after the
`"all-linear"` expansion `_maybe_include_all_linear_layers` does), and which rank and alpha it
gets (`get_pattern_key` over `rank_pattern` / `alpha_pattern`, as `LoraModel._create_and_replace`
does). A config `LoraConfig` refuses is recorded as an error.

`fan_in_fan_out_on_linear` records what `PeftModel.from_pretrained` makes of an adapter whose
saved config says `fan_in_fan_out: true` on an `nn.Linear` (every Qwen 3.5 projection): the flag
the layer keeps, and the output change `(y_with - y_without)` for a fixed input, with the A and B
it loaded.

Run: `python xtask/python/make_peft_semantics.py --root .` (no model, no GPU; a few seconds).
Output: tests/fixtures/peft/semantics.json, committed, read by tests/peft_config.rs.
"""

import argparse
import json
import os
import tempfile
import warnings

import peft
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import save_file
from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists
from peft.utils.other import get_pattern_key

PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj",
        "linear_attn.in_proj_qkv", "linear_attn.in_proj_a"]
NAMES = [f"{prefix}layers.{layer}.{p}"
         for prefix in ["model.", "model.language_model."]
         for layer in [0, 1, 3, 11]
         for p in PROJ]

CASES = {
    # ms-swift (peft 0.19.1) writes target_modules as one regex with a look-ahead.
    "ms_swift_lookahead": {"r": 8, "lora_alpha": 16,
                           "target_modules": r"^(model\.language_model(?=\.).*\.(q_proj|v_proj))$"},
    "regex_fullmatch_not_search": {"r": 4, "lora_alpha": 8, "target_modules": r"q_proj|.*mlp\.up_proj"},
    "regex_lookbehind": {"r": 4, "lora_alpha": 8, "target_modules": r".*(?<=self_attn\.)[kv]_proj"},
    "regex_python_Z": {"r": 4, "lora_alpha": 8, "target_modules": r".*layers\.1\..*proj\Z"},
    "regex_backref": {"r": 4, "lora_alpha": 8, "target_modules": r".*\.(?P<x>[a-z])_proj(?P=x)?"},
    "list_suffix": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "mlp.up_proj", "attn.k_proj"]},
    "list_layers": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"], "layers_to_transform": [0, 3]},
    "list_layers_int": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj"], "layers_to_transform": 1},
    "list_layers_empty": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_to_transform": []},
    "layers_pattern_layers": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "in_proj_qkv"],
                              "layers_to_transform": [1, 11], "layers_pattern": "layers"},
    "layers_pattern_vlm_only": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                "layers_to_transform": [0, 1], "layers_pattern": "language_model.layers"},
    "layers_pattern_list": {"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"],
                            "layers_to_transform": [3], "layers_pattern": ["h", "layers"]},
    "exact_name_skips_layers": {"r": 4, "lora_alpha": 8,
                                "target_modules": ["model.layers.11.self_attn.q_proj", "v_proj"],
                                "layers_to_transform": [0]},
    "exclude_list": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "up_proj"],
                     "exclude_modules": ["k_proj", "model.layers.0.mlp.up_proj"]},
    "exclude_regex": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                      "exclude_modules": r".*\.(linear_attn)\..*|.*layers\.3\..*"},
    "all_linear_upper": {"r": 4, "lora_alpha": 8, "target_modules": "ALL-LINEAR"},
    "patterns_first_key_wins": {
        "r": 8, "lora_alpha": 16, "target_modules": "all-linear",
        "rank_pattern": {"q_proj": 4, "layers.1.self_attn.q_proj": 2, r"layers\.[0-3]\..*proj": 6,
                         "1.mlp.up_proj": 3},
        "alpha_pattern": {r"(?=.*mlp).*down_proj": 32, "self_attn.k_proj": 2.5, "in_proj_a": 0.5},
    },
    "patterns_anchor_at_dot": {
        "r": 8, "lora_alpha": 16, "target_modules": "all-linear",
        "rank_pattern": {"layers.1.mlp.up_proj": 5, "ayers.3.self_attn.q_proj": 7, "^model.layers.0.*": 9},
        "alpha_pattern": {r"layers\.11\..*|q_proj": 3},
    },
    # LoraConfig's defaults where the file leaves r or lora_alpha out.
    "default_alpha": {"r": 16, "target_modules": ["q_proj", "up_proj"]},
    "default_r_and_alpha": {"target_modules": ["q_proj"], "rank_pattern": {"layers.1.self_attn.q_proj": 4}},
    "error_str_target_with_layers": {"r": 4, "target_modules": r".*q_proj", "layers_to_transform": [0]},
    "error_all_linear_with_layers": {"r": 4, "target_modules": "all-linear", "layers_to_transform": [0]},
    "error_layers_pattern_alone": {"r": 4, "target_modules": ["q_proj"], "layers_pattern": "layers"},
}


def decide(cfg: dict) -> dict:
    try:
        config = LoraConfig(**cfg)
    except (ValueError, TypeError) as e:
        return {"config": cfg, "error": str(e)}
    target = config.target_modules
    if isinstance(target, str) and target.lower() == "all-linear":
        # What _maybe_include_all_linear_layers leaves: every linear module's full name.
        config.target_modules = set(NAMES)
    modules = []
    for name in NAMES:
        hit = check_target_module_exists(config, name)
        targeted = bool(hit) and not isinstance(hit, _ExcludedModule)
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha)
        modules.append({"name": name, "targeted": targeted, "r": r, "alpha": alpha})
    return {"config": cfg, "modules": modules}


def fan_in_fan_out_on_linear() -> dict:
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(3, 2, bias=False)

        def forward(self, x):
            return self.q_proj(x)

    torch.manual_seed(0)
    base = Tiny()
    a = [[0.5, -1.0, 2.0]]  # lora_A [r = 1, in = 3]
    b = [[1.5], [-0.25]]  # lora_B [out = 2, r = 1]
    x = [[1.0, 2.0, -3.0]]
    with torch.no_grad():
        y_base = base(torch.tensor(x))
    with tempfile.TemporaryDirectory() as d:
        cfg = {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["q_proj"], "fan_in_fan_out": True}
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
        save_file({"base_model.model.q_proj.lora_A.weight": torch.tensor(a),
                   "base_model.model.q_proj.lora_B.weight": torch.tensor(b)},
                  os.path.join(d, "adapter_model.safetensors"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = PeftModel.from_pretrained(base, d).eval()
        with torch.no_grad():
            delta = (model(torch.tensor(x)) - y_base).tolist()
    return {"config": cfg, "lora_A": a, "lora_B": b, "x": x, "delta": delta,
            "layer_fan_in_fan_out": model.base_model.model.q_proj.fan_in_fan_out,
            "warnings": sorted({str(w.message) for w in caught if "fan_in_fan_out" in str(w.message)})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=".")
    args = ap.parse_args()
    out = {"peft_version": peft.__version__, "cases": {k: decide(v) for k, v in CASES.items()},
           "fan_in_fan_out_on_linear": fan_in_fan_out_on_linear()}
    path = os.path.join(args.root, "tests/fixtures/peft/semantics.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(CASES)} cases x {len(NAMES)} modules (peft {peft.__version__})")


if __name__ == "__main__":
    main()
