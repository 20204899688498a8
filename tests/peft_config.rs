//! The PEFT and MLX adapter parsers without a GPU: config semantics against peft's own decisions
//! (tests/fixtures/peft/semantics.json, written by xtask/python/make_peft_semantics.py), and
//! hostile configs, metadata and tensors refused with typed errors, from synthetic files.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use common::tolerance::HOSTILE_INPUT_SECONDS;
use common::{fixture_model, root};
use qwen35_wgpu::lora::{peft, PeftConfig, Proj, MAX_PATTERN_KEYS};
use qwen35_wgpu::{AdapterError, TextConfig};
use serde_json::{json, Value};

fn model() -> TextConfig {
    let text = std::fs::read_to_string(fixture_model("gva_tied_f32").join("config.json")).expect("config");
    TextConfig::from_json(&text).expect("parse")
}

/// A fresh directory under the target dir.
fn scratch(tag: &str) -> PathBuf {
    let dir = root().join("target/test-scratch/peft_config").join(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// One F32 tensor: name, shape, fill value.
type T<'a> = (&'a str, Vec<usize>, f32);

/// Write a safetensors file by hand (so headers can be as large or as odd as a test wants).
fn write_st(path: &Path, tensors: &[T], meta: Option<Value>) {
    let mut header = serde_json::Map::new();
    if let Some(m) = meta {
        header.insert("__metadata__".into(), m);
    }
    let mut data = Vec::new();
    for (name, shape, fill) in tensors {
        let n: usize = shape.iter().product();
        let begin = data.len();
        for _ in 0..n {
            data.extend_from_slice(&fill.to_le_bytes());
        }
        header.insert(name.to_string(), json!({"dtype": "F32", "shape": shape, "data_offsets": [begin, data.len()]}));
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).expect("header");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.extend(data);
    std::fs::write(path, bytes).expect("write");
}

/// A PEFT directory with `config` and `tensors`.
fn peft_dir(tag: &str, config: Value, tensors: &[T]) -> PathBuf {
    let dir = scratch(tag);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).expect("config");
    write_st(&dir.join("adapter_model.safetensors"), tensors, None);
    dir
}

/// `lora_A` `[r, in]` and `lora_B` `[out, r]` of `module` (a full name inside the PEFT model).
fn pair(module: &str, proj: Proj, r: usize, fill: f32) -> [(String, Vec<usize>, f32); 2] {
    let (fan_in, fan_out) = proj.dims(&model());
    [
        (format!("base_model.model.{module}.lora_A.weight"), vec![r, fan_in], fill),
        (format!("base_model.model.{module}.lora_B.weight"), vec![fan_out, r], fill),
    ]
}

fn refs(owned: &[(String, Vec<usize>, f32)]) -> Vec<T<'_>> {
    owned.iter().map(|(n, s, f)| (n.as_str(), s.clone(), *f)).collect()
}

/// Layer 3 of the fixture model is full attention; layer 0 Gated DeltaNet.
const Q3: &str = "model.layers.3.self_attn.q_proj";
const Q3_VLM: &str = "model.language_model.layers.3.self_attn.q_proj";
const V3_VLM: &str = "model.language_model.layers.3.self_attn.v_proj";

fn bad_config(e: &AdapterError) -> bool {
    matches!(e, AdapterError::BadConfig { .. })
}

#[test]
fn config_decisions_equal_peft_for_every_case_and_module() {
    let text = std::fs::read_to_string(root().join("tests/fixtures/peft/semantics.json")).expect("semantics.json");
    let all: Value = serde_json::from_str(&text).expect("json");
    let cases = all["cases"].as_object().expect("cases");
    assert!(cases.len() >= 20);
    for (case, want) in cases {
        let parsed = PeftConfig::from_json(&want["config"]);
        if want.get("error").is_some() {
            assert!(parsed.is_err(), "{case}: peft refuses this config ({}), we accepted it", want["error"]);
            continue;
        }
        let config = parsed.unwrap_or_else(|e| panic!("{case}: {e}"));
        for m in want["modules"].as_array().expect("modules") {
            let name = m["name"].as_str().expect("name");
            let targeted = config.excludes(name).expect("match").is_none();
            assert_eq!(targeted, m["targeted"].as_bool().expect("bool"), "{case}: is {name} targeted");
            let r = m["r"].as_u64().expect("r") as usize;
            assert_eq!(config.rank_for(name).expect("rank"), Some(r), "{case}: rank of {name}");
            let alpha = m["alpha"].as_f64().expect("alpha");
            assert_eq!(config.scaling(name, r).expect("scaling"), (alpha / r as f64) as f32, "{case}: alpha of {name}");
        }
    }
}

#[test]
fn ms_swift_lookahead_adapter_loads_on_vlm_names_only() {
    let config =
        json!({"r": 4, "lora_alpha": 8, "target_modules": r"^(model\.language_model(?=\.).*\.(q_proj|v_proj))$"});
    let mut owned = pair(Q3_VLM, Proj::QProj, 4, 0.01).to_vec();
    owned.extend(pair(V3_VLM, Proj::VProj, 4, 0.02));
    let dir = peft_dir("ms_swift", config.clone(), &refs(&owned));
    let parsed = peft::parse(&dir, &model()).expect("ms-swift adapter loads");
    let modules: Vec<_> = parsed.deltas.iter().map(|d| (d.layer, d.proj, d.scaling)).collect();
    assert_eq!(modules, [(3, Proj::QProj, 2.0), (3, Proj::VProj, 2.0)]);
    // The same regex does not name the text class's modules, for peft or for us.
    let dir = peft_dir("ms_swift_text", config, &refs(&pair(Q3, Proj::QProj, 4, 0.01)));
    assert!(matches!(peft::parse(&dir, &model()), Err(AdapterError::NotTargeted { .. })));
}

#[test]
fn a_module_under_both_prefixes_is_refused() {
    let mut owned = pair(Q3, Proj::QProj, 4, 0.01).to_vec();
    owned.extend(pair(Q3_VLM, Proj::QProj, 4, 0.02));
    let dir = peft_dir("both_prefixes", json!({"r": 4, "lora_alpha": 4}), &refs(&owned));
    let e = peft::parse(&dir, &model()).expect_err("two pairs for one projection");
    assert!(matches!(e, AdapterError::DuplicateModule { .. }), "{e}");
}

#[test]
fn metadata_alpha_and_rank_must_be_finite_and_bounded() {
    let model = model();
    let owned = pair(Q3, Proj::QProj, 8, 0.01);
    for (alpha, r) in [
        ("nan", "8"),
        ("inf", "8"),
        ("-inf", "8"),
        ("1e30", "8"),
        ("16", "inf"),
        ("16", "nan"),
        ("16", "1e30"),
        ("16", "18446744073709551615"),
    ] {
        let dir = scratch(&format!("meta_{alpha}_{r}"));
        let file = dir.join("adapter.safetensors");
        write_st(&file, &refs(&owned), Some(json!({"lora_alpha": alpha, "r": r})));
        let e = peft::parse(&file, &model).expect_err("refused like the config-file path");
        assert!(bad_config(&e), "alpha {alpha} r {r}: {e}");
    }
    let dir = scratch("meta_ok");
    let file = dir.join("adapter.safetensors");
    write_st(&file, &refs(&owned), Some(json!({"lora_alpha": "32", "r": "8"})));
    assert_eq!(peft::parse(&file, &model).expect("finite metadata loads").deltas[0].scaling, 4.0);
}

#[test]
fn absurd_ranks_and_alphas_in_the_config_are_typed_errors() {
    let model = model();
    let owned = pair(Q3, Proj::QProj, 8, 0.01);
    for config in [
        json!({"r": u64::MAX, "lora_alpha": 16}),
        json!({"r": 1u64 << 40, "lora_alpha": 16}),
        json!({"r": 0, "lora_alpha": 16}),
        json!({"r": 8, "lora_alpha": 1e30}),
        json!({"r": 8, "lora_alpha": -1e30}),
        json!({"r": 8, "lora_alpha": 16, "alpha_pattern": {"q_proj": 1e30}}),
        json!({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 1u64 << 40}}),
        json!({"r": 8, "lora_alpha": 1e4, "use_rslora": true}),
    ] {
        let dir = peft_dir("absurd", config.clone(), &refs(&owned));
        let e = peft::parse(&dir, &model).expect_err("absurd config");
        assert!(bad_config(&e), "{config}: {e}");
    }
    // A tensor whose rank is beyond the bound, with no config to say otherwise.
    let dir = scratch("rank_tensor");
    let file = dir.join("adapter.safetensors");
    write_st(&file, &[("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight", vec![1 << 17, 0], 0.0)], None);
    assert!(peft::parse(&file, &model).is_err());
}

#[test]
fn huge_pattern_maps_are_refused_fast() {
    let model = model();
    let owned = pair(Q3, Proj::QProj, 8, 0.01);
    for field in ["rank_pattern", "alpha_pattern"] {
        let map: serde_json::Map<String, Value> = (0..200_000).map(|i| (format!(r"l{i}\..*"), json!(8))).collect();
        let mut config = json!({"r": 8, "lora_alpha": 16});
        config[field] = Value::Object(map);
        let dir = peft_dir(field, config, &refs(&owned));
        let start = Instant::now();
        let e = peft::parse(&dir, &model).expect_err("200,000 keys");
        let took = start.elapsed().as_secs_f64();
        assert!(bad_config(&e), "{field}: {e}");
        assert!(took < HOSTILE_INPUT_SECONDS, "{field}: {took:.2} s");
    }
    // A map within the key bound whose keys are all regular expressions is refused before any
    // is compiled (each may take up to 256 KiB): counted from the JSON. The keys do not even
    // compile, so an error about the count shows that none was tried.
    let map: serde_json::Map<String, Value> =
        (0..MAX_PATTERN_KEYS).map(|i| (format!(r"l{i}(\w{{30}}q_proj"), json!(8))).collect();
    let e = PeftConfig::from_json(&json!({"r": 8, "rank_pattern": map})).expect_err("4096 regular expressions");
    assert!(bad_config(&e) && e.to_string().contains("at most 256 regular expressions"), "{e}");
    // The largest map accepted still parses quickly (plain keys need no regex engine).
    let map: serde_json::Map<String, Value> =
        (0..MAX_PATTERN_KEYS).map(|i| (format!("layers.{}.mlp.x{i}_proj", i % 8), json!(2))).collect();
    let dir = peft_dir("max_map", json!({"r": 8, "lora_alpha": 16, "rank_pattern": map}), &refs(&owned));
    let start = Instant::now();
    assert_eq!(peft::parse(&dir, &model).expect("4096 keys").deltas[0].rank, 8);
    assert!(start.elapsed().as_secs_f64() < HOSTILE_INPUT_SECONDS);
}

#[test]
fn an_adapter_past_the_element_bound_is_refused_from_its_header() {
    // One rank-65,536 gate_proj pair on a model with intermediate_size 40,000: each factor passes
    // the rank bound, but B alone is 2.6 G elements (10 GiB as f32). The file is sparse: nothing
    // is read, the header's shapes refuse it.
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_model("gva_tied_f32").join("config.json")).expect("cfg"))
            .expect("json");
    let text = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
    text["intermediate_size"] = json!(40_000);
    let model = TextConfig::from_json(&cfg.to_string()).expect("a wide config");
    let (r, h, i) = (65_536usize, model.hidden_size, 40_000usize);
    let dir = scratch("adapter_elements");
    std::fs::write(dir.join("adapter_config.json"), json!({"r": r, "lora_alpha": r}).to_string()).expect("config");
    let key = "base_model.model.model.layers.0.mlp.gate_proj";
    let (a_bytes, b_bytes) = (r * h * 2, i * r * 2);
    let header = json!({
        format!("{key}.lora_A.weight"): {"dtype": "BF16", "shape": [r, h], "data_offsets": [0, a_bytes]},
        format!("{key}.lora_B.weight"): {"dtype": "BF16", "shape": [i, r], "data_offsets": [a_bytes, a_bytes + b_bytes]},
    });
    let mut h_bytes = serde_json::to_vec(&header).expect("header");
    while !h_bytes.len().is_multiple_of(8) {
        h_bytes.push(b' ');
    }
    let path = dir.join("adapter_model.safetensors");
    let mut bytes = (h_bytes.len() as u64).to_le_bytes().to_vec();
    bytes.extend(&h_bytes);
    std::fs::write(&path, &bytes).expect("header");
    std::fs::File::options()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len((bytes.len() + a_bytes + b_bytes) as u64)
        .expect("sparse");
    let start = Instant::now();
    let e = peft::parse(&dir, &model).expect_err("2.6 G elements");
    assert!(matches!(&e, AdapterError::BadConfig { field, .. } if field == "adapter size"), "{e}");
    assert!(start.elapsed().as_secs_f64() < HOSTILE_INPUT_SECONDS);
    std::fs::remove_dir_all(&dir).ok();
}

/// Patterns that backtrack exponentially in Python's `re` get Python's answer, fast: the
/// look-ahead's body runs on the linear engine, so no key has an `x` to find (q_proj is then not
/// targeted, the rank pattern applies nowhere and the default rank is the file's), an empty
/// nest of groups matches no module, and a pattern past the size cap is refused.
#[test]
fn catastrophic_regexes_are_bounded() {
    let model = model();
    let owned = pair(Q3, Proj::QProj, 8, 0.01);
    let outcome = |r: &Result<(), AdapterError>| match r {
        Ok(()) => "parses",
        Err(AdapterError::NotTargeted { why, .. }) if why == "target_modules" => "not targeted",
        Err(AdapterError::BadConfig { field, .. }) if field == "target_modules" => "refused",
        Err(_) => "another error",
    };
    let cases = [
        (json!({"r": 8, "target_modules": r"(?=(.*)*x)(.*)*q_proj"}), "not targeted"),
        (json!({"r": 8, "rank_pattern": {r"(?=(.*.*)*x).*": 8}}), "parses"),
        (json!({"r": 8, "target_modules": "(".repeat(100) + &")".repeat(100)}), "not targeted"),
        (json!({"r": 8, "target_modules": "a".repeat(5000)}), "refused"),
    ];
    for (config, expected) in cases {
        let dir = peft_dir("catastrophic", config.clone(), &refs(&owned));
        let start = Instant::now();
        let result = peft::parse(&dir, &model).map(|_| ());
        assert!(start.elapsed().as_secs_f64() < HOSTILE_INPUT_SECONDS, "{config}: {:?}", result.as_ref().err());
        assert_eq!(outcome(&result), expected, "{config}: {:?}", result.as_ref().err());
    }
}

#[test]
fn backtracking_patterns_per_config_are_bounded() {
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!(r"(?=.*layers\.{i}\.).*_proj"), json!(8))).collect();
    let e = PeftConfig::from_json(&json!({"r": 8, "rank_pattern": many})).expect_err("17 look-around keys");
    assert!(bad_config(&e), "{e}");
    let few: serde_json::Map<String, Value> =
        (0..16).map(|i| (format!(r"(?=.*layers\.{i}\.).*_proj"), json!(4))).collect();
    let config = PeftConfig::from_json(&json!({"r": 8, "rank_pattern": few})).expect("16 look-around keys");
    assert_eq!(config.rank_for("model.layers.3.mlp.up_proj").expect("match"), Some(4));
    assert_eq!(config.rank_for("model.layers.30.mlp.up_proj").expect("match"), Some(8));
}

#[test]
fn weights_that_would_overflow_are_refused() {
    let model = model();
    for (fill, ok) in [(1e4f32, true), (-1e4, true), (2e4, false), (1e38, false), (-3e38, false)] {
        let dir = peft_dir("weights", json!({"r": 4, "lora_alpha": 4}), &refs(&pair(Q3, Proj::QProj, 4, fill)));
        match peft::parse(&dir, &model) {
            Ok(_) => assert!(ok, "{fill} accepted"),
            Err(e) => assert!(!ok && matches!(e, AdapterError::WeightTooLarge { .. }), "{fill}: {e}"),
        }
    }
}

#[test]
fn a_header_of_ignored_keys_keeps_a_sample_and_a_count() {
    let mut owned = pair(Q3, Proj::QProj, 4, 0.01).to_vec();
    let n = 50_000;
    owned.extend(
        (0..n).map(|i| (format!("base_model.model.model.visual.blocks.{i}.attn.qkv.lora_A.weight"), vec![1], 0.0)),
    );
    let dir = peft_dir("ignored", json!({"r": 4, "lora_alpha": 4}), &refs(&owned));
    let parsed = peft::parse(&dir, &model()).expect("vision keys are skipped");
    assert_eq!(parsed.ignored_count, n);
    assert!(parsed.ignored.len() <= 32, "{} names kept", parsed.ignored.len());
}

#[test]
fn oversized_or_special_config_files_are_refused_without_reading_them() {
    let owned = pair(Q3, Proj::QProj, 4, 0.01);
    let dir = peft_dir("big_config", json!({}), &refs(&owned));
    let mut big = b"{\"r\": 4".to_vec();
    big.resize(5 << 20, b' ');
    big.push(b'}');
    std::fs::write(dir.join("adapter_config.json"), big).expect("write");
    assert!(matches!(peft::parse(&dir, &model()), Err(AdapterError::NotPeft { .. })));
    #[cfg(unix)]
    {
        let dir = peft_dir("fifo_config", json!({}), &refs(&owned));
        let config = dir.join("adapter_config.json");
        std::fs::remove_file(&config).expect("rm");
        let made = std::process::Command::new("mkfifo").arg(&config).status().is_ok_and(|s| s.success());
        if made {
            assert!(matches!(peft::parse(&dir, &model()), Err(AdapterError::NotPeft { .. })), "a FIFO must not block");
        }
        let e = peft::parse(Path::new("/dev/null"), &model()).expect_err("a device");
        assert!(matches!(e, AdapterError::NotPeft { .. }), "/dev/null is no adapter, but it exists: {e}");
    }
}

/// An MLX adapter directory: `adapters.safetensors` + `adapter_config.json`.
fn mlx_dir(tag: &str, params: Value, tensors: &[T]) -> PathBuf {
    mlx_dir_with(tag, json!({"fine_tune_type": "lora", "num_layers": 8, "lora_parameters": params}), tensors)
}

/// An MLX adapter directory with the whole `adapter_config.json` given.
fn mlx_dir_with(tag: &str, config: Value, tensors: &[T]) -> PathBuf {
    let dir = scratch(tag);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).expect("config");
    write_st(&dir.join("adapters.safetensors"), tensors, None);
    dir
}

#[test]
fn mlx_adapters_parse_and_refuse_without_a_gpu() {
    let model = model();
    let (fan_in, fan_out) = Proj::QProj.dims(&model);
    let mlx_pair = |prefix: &str, r: usize| {
        [
            (format!("{prefix}model.layers.3.self_attn.q_proj.lora_a"), vec![fan_in, r], 0.5f32),
            (format!("{prefix}model.layers.3.self_attn.q_proj.lora_b"), vec![r, fan_out], 0.25f32),
        ]
    };
    let dir = mlx_dir("mlx_ok", json!({"rank": 4, "scale": 10.0}), &refs(&mlx_pair("", 4)));
    let parsed = peft::parse(&dir, &model).expect("MLX adapter");
    let d = &parsed.deltas[0];
    assert_eq!((d.layer, d.proj, d.rank, d.scaling), (3, Proj::QProj, 4, 10.0));
    assert_eq!((d.a.len(), d.b.len()), (4 * fan_in, fan_out * 4));
    assert!(d.a.iter().all(|&v| v == 0.5) && d.b.iter().all(|&v| v == 0.25));

    for params in [json!({"rank": 4, "scale": 1e30}), json!({"rank": 1u64 << 40, "scale": 1.0})] {
        let dir = mlx_dir("mlx_bad", params.clone(), &refs(&mlx_pair("", 4)));
        let e = peft::parse(&dir, &model).expect_err("absurd MLX config");
        assert!(bad_config(&e), "{params}: {e}");
    }
    // mlx-lm 0.32's load_adapters: num_layers, lora_parameters, its scale and rank are required
    // (it raises without them); LoRA layers are the last num_layers of the model's 8 (all when
    // num_layers ≤ 0), and a tensor of another layer is "not an adapter parameter in the model".
    let params = json!({"rank": 4, "scale": 10.0, "dropout": 0.0});
    let config = |num_layers: Value, params: Value| {
        let mut c = json!({"fine_tune_type": "lora", "lora_parameters": params});
        if !num_layers.is_null() {
            c["num_layers"] = num_layers;
        }
        c
    };
    let q3_pair = mlx_pair("", 4);
    let q3 = refs(&q3_pair);
    for (num_layers, loads) in [(json!(5), true), (json!(0), true), (json!(-1), true), (json!(4), false)] {
        let dir = mlx_dir_with("mlx_num_layers", config(num_layers.clone(), params.clone()), &q3);
        match peft::parse(&dir, &model) {
            Ok(p) => assert!(loads && p.deltas.len() == 1, "num_layers {num_layers}: layer 3 loaded"),
            Err(e) => assert!(
                !loads && matches!(&e, AdapterError::NotTargeted { why, .. } if why.contains("num_layers")),
                "num_layers {num_layers}: {e}"
            ),
        }
    }
    let without = |field: &str| {
        let mut p = params.clone();
        p.as_object_mut().expect("object").remove(field);
        p
    };
    let mut alpha = without("scale");
    alpha["alpha"] = json!(16);
    for (cfg, field) in [
        (config(Value::Null, params.clone()), "num_layers"),
        (config(json!(8), Value::Null), "lora_parameters"),
        (config(json!(8), without("scale")), "lora_parameters.scale"),
        (config(json!(8), alpha), "lora_parameters.scale"),
        (config(json!(8), without("rank")), "lora_parameters.rank"),
    ] {
        let dir = mlx_dir_with("mlx_required", cfg.clone(), &q3);
        let e = peft::parse(&dir, &model).expect_err("mlx-lm refuses it");
        assert!(matches!(&e, AdapterError::BadConfig { field: f, .. } if f == field), "{cfg}: {e}");
    }
    // mlx-lm's model-level pass: a full module path in `keys` gets LoRA in any layer.
    let mut full = params.clone();
    full["keys"] = json!(["model.layers.3.self_attn.q_proj"]);
    let dir = mlx_dir_with("mlx_full_key", config(json!(1), full.clone()), &q3);
    assert_eq!(peft::parse(&dir, &model).map(|p| p.deltas.len()).ok(), Some(1), "layer 3 named in full");
    full["keys"] = json!(["model.layers.2.self_attn.q_proj"]);
    let dir = mlx_dir_with("mlx_other_full_key", config(json!(1), full), &q3);
    assert!(matches!(peft::parse(&dir, &model), Err(AdapterError::NotTargeted { .. })), "another module named");
    let dir = mlx_dir_with("mlx_no_dropout", config(json!(8), without("dropout")), &q3);
    assert!(peft::parse(&dir, &model).is_ok(), "dropout does not change inference");

    let mut both = mlx_pair("", 4).to_vec();
    both.extend(mlx_pair("language_model.", 4));
    let dir = mlx_dir("mlx_both", json!({"rank": 4, "scale": 1.0}), &refs(&both));
    assert!(matches!(peft::parse(&dir, &model), Err(AdapterError::DuplicateModule { .. })));
}

#[test]
fn committed_fixture_adapters_parse_on_the_cpu() {
    let model = model();
    let dir = root().join("tests/fixtures/adapters");
    let mut covered = BTreeMap::new();
    for name in ["all12_r8", "gdn_mlp_r4_rslora", "patterns_r16", "layers_0_3", "meta_only.safetensors"] {
        let parsed = peft::parse(&dir.join(name), &model).unwrap_or_else(|e| panic!("{name}: {e}"));
        covered.insert(name, parsed.deltas.len());
    }
    // The counts the GPU tests check through AdapterInfo, here without a device.
    for name in ["all12_r8", "gdn_mlp_r4_rslora", "patterns_r16", "layers_0_3"] {
        assert_eq!(covered[name], common::lora_a_tensors(&dir.join(name)), "{name}: the modules peft saved");
    }
}

/// An `init_lora_weights` under which peft rewrites the base weights when it loads the adapter
/// (PiSSA, OLoRA, LoftQ, CorDA, LoRA-GA) is refused by name: applied to the original weights the
/// adapter would give other numbers than peft without a word. The others load.
#[test]
fn adapters_trained_against_rewritten_base_weights_are_refused() {
    let base = json!({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]});
    for init in ["pissa", "pissa_niter_4", "olora", "loftq", "corda", "lora_ga"] {
        let mut cfg = base.clone();
        cfg["init_lora_weights"] = json!(init);
        let e = PeftConfig::from_json(&cfg).expect_err(init);
        assert!(matches!(&e, AdapterError::Unsupported { key, .. } if key == "init_lora_weights"), "{init}: {e}");
    }
    for init in [json!(true), json!(false), json!("gaussian"), json!("eva"), json!("orthogonal")] {
        let mut cfg = base.clone();
        cfg["init_lora_weights"] = init.clone();
        assert!(PeftConfig::from_json(&cfg).is_ok(), "{init}");
    }
}

/// `fan_in_fan_out: true` on an `nn.Linear` (every Qwen 3.5 projection): peft warns, sets the
/// flag to false and applies A and B as saved (semantics.json records its layer's flag and the
/// output change it computes). The engine loads such an adapter with the same numbers as with
/// the flag false.
#[test]
fn fan_in_fan_out_on_linear_layers_is_what_peft_makes_of_it() {
    let text = std::fs::read_to_string(root().join("tests/fixtures/peft/semantics.json")).expect("semantics.json");
    let all: Value = serde_json::from_str(&text).expect("json");
    let rec = &all["fan_in_fan_out_on_linear"];
    assert_eq!(rec["config"]["fan_in_fan_out"], json!(true));
    assert_eq!(rec["layer_fan_in_fan_out"], json!(false), "peft keeps the flag on a Linear");
    let warned = rec["warnings"].as_array().expect("warnings");
    assert!(warned.iter().any(|w| w.as_str().is_some_and(|w| w.contains("Setting fan_in_fan_out to False"))));
    let config = PeftConfig::from_json(&rec["config"]).expect("peft loads this config, so do we");
    let matrix = |v: &Value| -> Vec<Vec<f64>> {
        v.as_array()
            .expect("rows")
            .iter()
            .map(|r| r.as_array().expect("row").iter().map(|x| x.as_f64().expect("number")).collect())
            .collect()
    };
    let (a, b, x) = (matrix(&rec["lora_A"]), matrix(&rec["lora_B"]), matrix(&rec["x"]));
    let scaling = f64::from(config.scaling("q_proj", a.len()).expect("scaling"));
    // scaling · B · (A · x): A and B as saved, not transposed.
    let ax: Vec<f64> = a.iter().map(|row| row.iter().zip(&x[0]).map(|(w, v)| w * v).sum()).collect();
    let ours: Vec<f64> = b.iter().map(|row| scaling * row.iter().zip(&ax).map(|(w, v)| w * v).sum::<f64>()).collect();
    assert_eq!(vec![ours], matrix(&rec["delta"]), "peft's output change");

    let fixture = root().join("tests/fixtures/adapters/all12_r8");
    let dir = common::scratch_copy(&fixture, "fan_in_fan_out");
    let path = dir.join("adapter_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    cfg["fan_in_fan_out"] = json!(true);
    std::fs::write(&path, cfg.to_string()).expect("write");
    let key = |d: &peft::ModuleDelta| (d.layer, d.proj.path(), d.rank, d.scaling, d.a.clone(), d.b.clone());
    let with = peft::parse(&dir, &model()).expect("fan_in_fan_out: true loads");
    let without = peft::parse(&fixture, &model()).expect("fixture");
    assert_eq!(with.deltas.len(), without.deltas.len());
    assert!(with.deltas.iter().map(key).eq(without.deltas.iter().map(key)), "the same deltas as with false");
}
