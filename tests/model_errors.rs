//! Bad model directories give the right typed error, never a panic.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{damaged_model, fixture_model, gpu, root, scratch_copy, Tensors};
use qwen35_wgpu::error::FileError;
use qwen35_wgpu::model::{Checkpoint, Dtype, LayerType, Mixer};
use qwen35_wgpu::runtime::{Batch, Session, SessionOptions};
use qwen35_wgpu::{AdapterError, LoraAdapter, Model, ModelError, RunError, TextConfig};

const BASE: &str = "odd_untied_f32";

fn base_config() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_model(BASE).join("config.json")).expect("config");
    serde_json::from_str(&text).expect("json")
}

fn config_error(edit: impl FnOnce(&mut serde_json::Value)) -> ModelError {
    let mut cfg = base_config();
    edit(&mut cfg);
    TextConfig::from_json(&cfg.to_string()).expect_err("config must be rejected")
}

#[test]
fn config_errors_are_typed() {
    assert!(TextConfig::from_json(&base_config().to_string()).is_ok());
    let e = config_error(|c| c["model_type"] = "qwen3_5_moe_text".into());
    assert!(matches!(e, ModelError::Unsupported { .. }), "{e}");
    let e = config_error(|c| c["model_type"] = "llama".into());
    assert!(matches!(&e, ModelError::BadConfig { field, .. } if field == "model_type"), "{e}");
    let e = config_error(|c| c["head_dim"] = 1024.into());
    assert!(matches!(&e, ModelError::BadConfig { field, found, .. } if field == "head_dim" && found == "1024"), "{e}");
    let e = config_error(|c| c["layer_types"] = serde_json::json!(["full_attention"]));
    assert!(matches!(&e, ModelError::BadConfig { field, .. } if field == "layer_types"), "{e}");
    let e = config_error(|c| c["num_key_value_heads"] = 2.into());
    assert!(matches!(&e, ModelError::BadConfig { field, .. } if field == "num_key_value_heads"), "{e}");
    let e = config_error(|c| c["hidden_act"] = "gelu".into());
    assert!(matches!(&e, ModelError::BadConfig { field, .. } if field == "hidden_act"), "{e}");
    // qwen3_5 without text_config is mlx-lm's flat form: its fields must be there.
    let e = TextConfig::from_json(r#"{"model_type": "qwen3_5"}"#).expect_err("no text fields");
    assert!(matches!(&e, ModelError::BadJson { message, .. } if message.contains("vocab_size")), "{e}");
    let e = TextConfig::from_json("{not json").expect_err("not json");
    assert!(matches!(e, ModelError::BadJson { .. }), "{e}");
}

/// Config fields transformers reads with a meaning the engine does not run are refused, never
/// dropped: q/k/v/o biases, a legacy `rope_scaling` other than plain RoPE (transformers lets it
/// replace `rope_parameters`), an interval of 0; a `rope_parameters` with both `type` and
/// `rope_type` (transformers re-saves mlx-lm's `type` so) loads when they agree.
#[test]
fn config_fields_that_change_the_math_are_refused_not_dropped() {
    let e = config_error(|c| c["attention_bias"] = true.into());
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("attention_bias")), "{e}");
    let e = config_error(|c| c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0}));
    assert_eq!(bad_config(&e).0, "rope_scaling");
    let e = config_error(|c| c["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0}));
    assert_eq!(bad_config(&e).0, "rope_scaling");
    let e = config_error(|c| {
        c.as_object_mut().expect("object").remove("layer_types");
        c["full_attention_interval"] = 0.into();
    });
    assert_eq!(bad_config(&e).0, "full_attention_interval");
    let e = config_error(|c| c["rope_parameters"]["type"] = "yarn".into());
    assert_eq!(bad_config(&e).0, "rope_parameters.type");
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut cfg = base_config();
        edit(&mut cfg);
        TextConfig::from_json(&cfg.to_string())
    };
    for (what, edit) in [
        ("attention_bias false", &(|c: &mut serde_json::Value| c["attention_bias"] = false.into()) as &dyn Fn(&mut _)),
        ("rope_scaling null", &|c: &mut serde_json::Value| c["rope_scaling"] = serde_json::Value::Null),
        ("type beside rope_type", &|c: &mut serde_json::Value| c["rope_parameters"]["type"] = "default".into()),
        ("rope_scaling {}", &|c: &mut serde_json::Value| c["rope_scaling"] = serde_json::json!({})),
        ("rope_scaling without a type", &|c: &mut serde_json::Value| {
            c["rope_scaling"] = serde_json::json!({"mrope_section": [2, 1, 1], "rope_theta": 1e7})
        }),
    ] {
        assert!(edited(edit).is_ok(), "{what} loads");
    }
    // A plain-RoPE rope_scaling replaces rope_parameters, as in transformers; one without a
    // rope_theta (transformers would take its class default, 10^4) is refused.
    let replaced = edited(&|c| c["rope_scaling"] = serde_json::json!({"rope_type": "default", "rope_theta": 5000.0}));
    assert_eq!(replaced.expect("loads").rope_theta, 5000.0);
    let e = edited(&|c| c["rope_scaling"] = serde_json::json!({"rope_type": "default"})).expect_err("no theta");
    assert_eq!(bad_config(&e).0, "rope_parameters.rope_theta");
    // The VLM form's top-level end ids come first, as transformers' generation config reads them.
    let path = fixture_model("vlm_bf16_sharded").join("config.json");
    let mut vlm: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("config")).expect("json");
    vlm["text_config"]["eos_token_id"] = 3.into();
    vlm["eos_token_id"] = serde_json::json!([5, 7]);
    assert_eq!(TextConfig::from_json(&vlm.to_string()).expect("vlm").eos_token_ids, [5, 7]);
    vlm["eos_token_id"] = serde_json::Value::Null;
    assert_eq!(TextConfig::from_json(&vlm.to_string()).expect("vlm").eos_token_ids, [3]);
}

/// The field and the found value of a `BadConfig`.
fn bad_config(e: &ModelError) -> (&str, &str) {
    match e {
        ModelError::BadConfig { field, found, .. } => (field, found),
        other => panic!("expected BadConfig, got {other}"),
    }
}

#[test]
fn absurd_config_sizes_are_refused_before_anything_is_allocated() {
    // Without layer_types, num_hidden_layers alone sized a Vec: 10^12 aborted the process.
    for layers in [1_000_000_000_000u64, 100_000_000, 1025] {
        let e = config_error(|c| {
            c.as_object_mut().expect("object").remove("layer_types");
            c["num_hidden_layers"] = layers.into();
        });
        assert_eq!(bad_config(&e), ("num_hidden_layers", layers.to_string().as_str()), "{e}");
    }
    let cases: [(&str, u64); 8] = [
        ("vocab_size", (1 << 24) + 1),
        ("hidden_size", 65_537),
        ("intermediate_size", 1 << 40),
        ("num_attention_heads", 1 << 20),
        ("num_key_value_heads", 1 << 33),
        ("linear_num_value_heads", 1 << 62),
        ("linear_key_head_dim", 4096),
        ("linear_value_head_dim", u64::MAX),
    ];
    for (field, v) in cases {
        let e = config_error(|c| c[field] = v.into());
        assert_eq!(bad_config(&e), (field, v.to_string().as_str()), "{e}");
    }
    // Each within its bound, the product not: 2 · V · H alone is 2^41 elements.
    let e = config_error(|c| {
        c["vocab_size"] = (1u64 << 24).into();
        c["hidden_size"] = 65_536.into();
    });
    assert_eq!(bad_config(&e).0, "(parameter count)", "{e}");
}

#[test]
fn rope_theta_eps_and_rotary_factor_must_be_positive_and_finite() {
    let rope = |key: &'static str, v: serde_json::Value| move |c: &mut serde_json::Value| c["rope_parameters"][key] = v;
    // 1e-300 is positive as f64 and 0 as an f32 (a NaN RoPE table); 1e-40 is subnormal.
    for v in [0.0, -10000.0, 1e300, 1e-300, 1e-40] {
        let e = config_error(rope("rope_theta", v.into()));
        assert_eq!(bad_config(&e).0, "rope_theta", "{v}: {e}");
    }
    for v in [-0.25, 1.5, 1e300] {
        let e = config_error(rope("partial_rotary_factor", v.into()));
        assert_eq!(bad_config(&e).0, "partial_rotary_factor", "{v}: {e}");
    }
    // 1e-50 is positive as f64 and 0 as the f32 the kernels use; 1e300 is infinite as f32.
    for v in [0.0, -1e-6, 1e-50, 1e300] {
        let e = config_error(|c| c["rms_norm_eps"] = v.into());
        assert_eq!(bad_config(&e).0, "rms_norm_eps", "{v}: {e}");
    }
    let e = config_error(|c| c["rope_parameters"]["rope_theta"] = "inf".into());
    assert!(matches!(e, ModelError::BadJson { .. }), "{e}");
}

/// TextConfig's fields are public: a config edited by hand past the bounds `from_json` checks is
/// refused by the public functions that take one, typed and naming the field.
#[test]
fn hand_edited_configs_are_checked_where_they_are_used() {
    let good = TextConfig::from_json(&base_config().to_string()).expect("config");
    assert!(good.check().is_ok());
    assert!(qwen35_wgpu::runtime::rope_table(&good, 4).is_ok());
    let mut odd = good.clone();
    odd.rotary_dim = odd.head_dim + 2;
    let e = qwen35_wgpu::runtime::rope_table(&odd, 4).expect_err("rotary dim past head_dim");
    let qwen35_wgpu::RunError::ModelConfig(inner) = &e else { panic!("expected ModelConfig, got {e}") };
    assert_eq!(bad_config(inner).0, "partial_rotary_factor", "{e}");
    let mut no_kv = good.clone();
    no_kv.num_kv_heads = 0;
    let adapter = root().join("tests/fixtures/adapters/odd_r4");
    let e = qwen35_wgpu::lora::peft::parse(&adapter, &no_kv).expect_err("no kv heads");
    let qwen35_wgpu::AdapterError::ModelConfig(inner) = &e else { panic!("expected ModelConfig, got {e}") };
    assert_eq!(bad_config(inner), ("num_key_value_heads", "0"), "{e}");
    let mut eos = good.clone();
    eos.eos_token_ids = vec![eos.vocab_size as u32];
    assert_eq!(bad_config(&eos.check().expect_err("eos past the vocab")).0, "eos_token_id");
}

#[test]
fn both_config_forms_give_the_same_dimensions() {
    let vlm = TextConfig::from_dir(&fixture_model("vlm_bf16_sharded")).expect("vlm config");
    assert_eq!(vlm.hidden_size, 48);
    assert!(vlm.tie_word_embeddings);
    assert_eq!(vlm.rotary_dim, 8);
    let text = TextConfig::from_dir(&fixture_model(BASE)).expect("text config");
    assert!(!text.tie_word_embeddings);
    assert_eq!(text.rotary_dim, 6);
}

/// Rewrite the model file of a copy of the base fixture with `edit` applied to its tensors.
fn damaged(tag: &str, edit: impl FnOnce(&mut Tensors)) -> PathBuf {
    damaged_model(BASE, tag, edit)
}

#[test]
fn unreadable_and_malformed_files_are_typed_errors() {
    let missing = std::env::temp_dir().join("qwen35-no-such-model-dir");
    assert!(matches!(TextConfig::from_dir(&missing), Err(ModelError::Io { .. })));

    let dir = scratch_copy(&fixture_model(BASE), "noweights");
    std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
    assert!(matches!(Checkpoint::open_dir(&dir), Err(ModelError::NoWeights { .. })));

    // An entry is read only by the checkpoint it came from (another's file list may hold a
    // different file, or none, at its index).
    let (one, other) = (
        Checkpoint::open_dir(&fixture_model(BASE)).expect("open"),
        Checkpoint::open_dir(&fixture_model(BASE)).expect("open"),
    );
    let name = one.names().next().expect("a tensor").to_string();
    let entry = other.get(&name).expect("the same name");
    assert!(other.read(entry).is_ok(), "its own checkpoint reads it");
    assert!(matches!(one.read(entry), Err(ModelError::ForeignEntry { .. })), "{name}: another checkpoint's entry");

    let dir = scratch_copy(&fixture_model(BASE), "truncated");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    std::fs::write(&file, &bytes[..bytes.len() / 2]).expect("truncate");
    let e = Checkpoint::open_dir(&dir).err().expect("truncated file must fail");
    assert!(matches!(e, ModelError::BadSafetensors { .. }), "{e}");

    let mut huge = (u64::MAX / 2).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    std::fs::write(&file, &huge).expect("write");
    let e = Checkpoint::open_dir(&dir).err().expect("huge header must fail");
    assert!(matches!(&e, ModelError::BadSafetensors { message, .. } if message.contains("exceeds")), "{e}");

    std::fs::write(&file, b"\x05").expect("write");
    assert!(matches!(Checkpoint::open_dir(&dir), Err(ModelError::BadSafetensors { .. })));

    let dir = scratch_copy(&fixture_model(BASE), "gguf");
    std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
    std::fs::write(dir.join("model-Q4_K_M.gguf"), b"GGUF").expect("write");
    let e = Checkpoint::open_dir(&dir).err().expect("a GGUF directory must fail");
    assert!(matches!(&e, ModelError::Unsupported { what } if what.starts_with("GGUF")), "{e}");
}

#[test]
fn missing_wrong_shape_and_wrong_dtype_tensors_are_named() {
    let Some(ctx) = gpu() else { return };
    let victim = "model.layers.1.self_attn.k_proj.weight";

    let dir = damaged("missing", |t| t.retain(|(n, ..)| n != victim));
    let e = Model::load(ctx.clone(), &dir).err().expect("must fail");
    assert!(matches!(&e, ModelError::MissingTensor { name, .. } if name == victim), "{e}");

    let dir = damaged("shape", |t| {
        let e = t.iter_mut().find(|(n, ..)| n == victim).expect("victim");
        e.2 = vec![e.2[1], e.2[0]];
    });
    let e = Model::load(ctx.clone(), &dir).err().expect("must fail");
    assert!(
        matches!(&e, ModelError::ShapeMismatch { name, expected, found } if name == victim && expected == &vec![24, 38] && found == &vec![38, 24]),
        "{e}"
    );

    let dir = damaged("dtype", |t| {
        let e = t.iter_mut().find(|(n, ..)| n == victim).expect("victim");
        e.1 = safetensors::Dtype::I32;
    });
    let e = Model::load(ctx.clone(), &dir).err().expect("must fail");
    assert!(matches!(&e, ModelError::UnsupportedDtype { name, found } if name == victim && found == "I32"), "{e}");

    // q|k|v are stored as one weight: a k_proj of another dtype than q_proj gets chunks of its own.
    let dir = damaged("mixed", |t| {
        let e = t.iter_mut().find(|(n, ..)| n == victim).expect("victim");
        e.1 = safetensors::Dtype::F16;
        e.3 =
            e.3.chunks_exact(4)
                .flat_map(|b| half::f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
                .collect();
    });
    let m = Model::load(ctx.clone(), &dir).expect("a q|k|v of mixed dtypes loads");
    let Mixer::Attention(a) = &m.layers[1].mixer else { panic!("layer 1 is attention") };
    let dtypes: Vec<Dtype> = a.qkv.chunks.iter().map(|c| c.dtype).collect();
    assert_eq!(dtypes, [Dtype::F32, Dtype::F16, Dtype::F32], "q, k, v chunks");
    assert_eq!(a.qkv.chunks.iter().map(|c| c.rows).sum::<usize>(), a.qkv.rows);

    let dir = damaged("nohead", |t| t.retain(|(n, ..)| n != "lm_head.weight"));
    let e = Model::load(ctx.clone(), &dir).err().expect("untied model without lm_head must fail");
    assert!(matches!(&e, ModelError::MissingTensor { name, .. } if name == "lm_head.weight"), "{e}");
}

#[test]
fn vision_and_mtp_tensors_are_ignored() {
    let Some(ctx) = gpu() else { return };
    let dir = damaged("extras", |t| {
        t.push(("mtp.fc.weight".into(), safetensors::Dtype::I8, vec![3], vec![1, 2, 3]));
        t.push(("model.visual.blocks.0.attn.qkv.weight".into(), safetensors::Dtype::F32, vec![1], vec![0; 4]));
    });
    Model::load(ctx, &dir).expect("extra mtp.* and model.visual.* tensors are not read");
}

/// A copy of the MLX 4-bit fixture with `edit` applied to its tensors and `config` to its
/// config.json.
fn damaged_mlx(tag: &str, edit: impl FnOnce(&mut Tensors), config: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = damaged_model("mlx_q4_g64", tag, edit);
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    config(&mut cfg);
    std::fs::write(&path, cfg.to_string()).expect("write config");
    dir
}

#[test]
fn malformed_quantized_checkpoints_are_typed_errors_naming_the_tensor() {
    let Some(ctx) = gpu() else { return };
    let module = "language_model.model.layers.1.mlp.up_proj";
    let (weight, scales, biases) = (format!("{module}.weight"), format!("{module}.scales"), format!("{module}.biases"));
    let reshape = |name: String, shape: Vec<usize>| {
        move |t: &mut Tensors| t.iter_mut().find(|(n, ..)| *n == name).expect("victim").2 = shape
    };
    let load = |dir: PathBuf| Model::load(ctx.clone(), &dir).err().expect("must fail");

    // Codes packed for another width: [128, 8] u32 words hold 64 4-bit inputs per row.
    let e = load(damaged_mlx("q-width", reshape(weight.clone(), vec![64, 16]), |_| {}));
    assert!(
        matches!(&e, ModelError::ShapeMismatch { name, expected, .. } if *name == weight && expected == &vec![128, 8]),
        "{e}"
    );
    let e = load(damaged_mlx("q-scales", reshape(scales.clone(), vec![64, 2]), |_| {}));
    assert!(
        matches!(&e, ModelError::ShapeMismatch { name, expected, .. } if *name == scales && expected == &vec![128, 1]),
        "{e}"
    );
    let e = load(damaged_mlx("q-biases", |t| t.retain(|(n, ..)| *n != biases), |_| {}));
    assert!(matches!(&e, ModelError::MissingTensor { name, .. } if *name == biases), "{e}");
    let e = load(damaged_mlx("q-bits3", |_| {}, |c| c["quantization"]["bits"] = 3.into()));
    assert!(
        matches!(&e, ModelError::BadConfig { field, found, .. } if field == "quantization.bits" && found == "3"),
        "{e}"
    );
    let e = load(damaged_mlx(
        "q-bits5",
        |_| {},
        |c| c["quantization"][module] = serde_json::json!({"bits": 5, "group_size": 64}),
    ));
    assert!(
        matches!(&e, ModelError::BadConfig { field, .. } if *field == format!("quantization.{module}.bits")),
        "{e}"
    );
    // up_proj reads the 64-wide hidden state: a group of 128 does not divide it.
    let e = load(damaged_mlx(
        "q-group",
        |_| {},
        |c| c["quantization"][module] = serde_json::json!({"bits": 4, "group_size": 128}),
    ));
    assert!(
        matches!(&e, ModelError::BadConfig { field, .. } if *field == format!("quantization.{module}.group_size")),
        "{e}"
    );
    let e = load(damaged_mlx("q-false", |_| {}, |c| c["quantization"][module] = false.into()));
    assert!(matches!(&e, ModelError::BadConfig { field, .. } if *field == format!("quantization.{module}")), "{e}");
    let e = load(damaged_mlx(
        "q-noconfig",
        |_| {},
        |c| {
            let o = c.as_object_mut().expect("object");
            o.remove("quantization");
            o.remove("quantization_config");
        },
    ));
    assert!(matches!(&e, ModelError::BadConfig { found, .. } if found == "no quantization section"), "{e}");
    let e = load(damaged_mlx("q-mode", |_| {}, |c| c["quantization"]["mode"] = "mxfp4".into()));
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("mxfp4")), "{e}");
    let e = load(damaged_mlx(
        "q-gptq",
        |_| {},
        |c| {
            let o = c.as_object_mut().expect("object");
            o.remove("quantization");
            o.insert("quantization_config".into(), serde_json::json!({"quant_method": "gptq", "bits": 4}));
        },
    ));
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("gptq")), "{e}");
    let e = load(damaged_mlx(
        "q-dtype",
        |t| t.iter_mut().find(|(n, ..)| *n == scales).expect("scales").1 = safetensors::Dtype::I16,
        |_| {},
    ));
    assert!(matches!(&e, ModelError::UnsupportedDtype { name, .. } if *name == scales), "{e}");
}

#[test]
fn compressed_tensors_schemes_the_kernels_cannot_run_are_refused_by_name() {
    let Some(ctx) = gpu() else { return };
    let with = |tag: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let dir = scratch_copy(&fixture_model("ct_w4a16_g64"), tag);
        let path = dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
        edit(&mut cfg);
        std::fs::write(&path, cfg.to_string()).expect("write");
        Model::load(ctx.clone(), &dir).err().expect("must fail")
    };
    let q = "quantization_config";
    let e = with("ct-fp8", &|c| c[q]["format"] = "float-quantized".into());
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("float-quantized")), "{e}");
    let e = with("ct-asym", &|c| c[q]["config_groups"]["group_0"]["weights"]["symmetric"] = false.into());
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("symmetric")), "{e}");
    let e = with("ct-w4a8", &|c| {
        c[q]["config_groups"]["group_0"]["input_activations"] = serde_json::json!({"num_bits": 8, "type": "int"})
    });
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("activation")), "{e}");
    let e = with("ct-bits", &|c| c[q]["config_groups"]["group_0"]["weights"]["num_bits"] = 3.into());
    assert!(matches!(&e, ModelError::BadConfig { field, .. } if field.ends_with("num_bits")), "{e}");
    // What changes the math when present is refused, not dropped: group activation ordering
    // (compressed-tensors 0.20 refuses it too), online rotations, a quantized KV cache or
    // outputs, sparse compression.
    for (tag, edit, named) in [
        (
            "ct-actorder",
            &(|c: &mut serde_json::Value| c[q]["config_groups"]["group_0"]["weights"]["actorder"] = "group".into())
                as &dyn Fn(&mut serde_json::Value),
            "actorder",
        ),
        ("ct-actorder-true", &|c| c[q]["config_groups"]["group_0"]["weights"]["actorder"] = true.into(), "actorder"),
        ("ct-transform", &|c| c[q]["transform_config"] = serde_json::json!({"config_groups": {"u": {}}}), "transform"),
        ("ct-kv", &|c| c[q]["kv_cache_scheme"] = serde_json::json!({"num_bits": 8, "type": "float"}), "kv_cache"),
        (
            "ct-out",
            &|c| c[q]["config_groups"]["group_0"]["output_activations"] = serde_json::json!({"num_bits": 8}),
            "output_activations",
        ),
        ("ct-sparse", &|c| c[q]["sparsity_config"] = serde_json::json!({"format": "sparse-24-bitmask"}), "sparsity"),
    ] {
        let e = with(tag, edit);
        assert!(matches!(&e, ModelError::Unsupported { what } if what.contains(named)), "{tag}: {e}");
    }
    // llm-compressor's "dense" sparsity format is ordinary dense tensors.
    let dir = scratch_copy(&fixture_model("ct_w4a16_g64"), "ct-dense");
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    cfg[q]["sparsity_config"] =
        serde_json::json!({"format": "dense", "global_sparsity": 0.5, "sparsity_structure": "2:4"});
    std::fs::write(&path, cfg.to_string()).expect("write");
    assert!(Model::load(ctx.clone(), &dir).is_ok(), "a dense sparsity_config loads");
}

#[test]
fn compressed_tensors_data_the_kernels_cannot_take_is_refused_by_name() {
    let Some(ctx) = gpu() else { return };
    let module = "model.layers.0.mlp.down_proj";
    let (shape, scale) = (format!("{module}.weight_shape"), format!("{module}.weight_scale"));
    let load = |tag: &str, edit: &dyn Fn(&mut Tensors)| {
        Model::load(ctx.clone(), &damaged_model("ct_w4a16_g64", tag, edit)).err().expect("must fail")
    };
    // weight_shape is two integers: anything else is refused before its header sizes a read.
    let e = load("ct-shape-len", &|t| {
        let s = t.iter_mut().find(|(n, ..)| *n == shape).expect("weight_shape");
        (s.2, s.3) = (vec![4], vec![0; 32]);
    });
    assert!(
        matches!(&e, ModelError::ShapeMismatch { name, found, .. } if name.contains(&shape) && *found == [4]),
        "{e}"
    );
    let e = load("ct-shape-dtype", &|t| {
        t.iter_mut().find(|(n, ..)| *n == shape).expect("weight_shape").1 = safetensors::Dtype::F64
    });
    assert!(matches!(&e, ModelError::UnsupportedDtype { name, found } if *name == shape && found == "F64"), "{e}");
    let e = load("ct-shape-values", &|t| {
        t.iter_mut().find(|(n, ..)| *n == shape).expect("weight_shape").3 =
            [64i64, 65].iter().flat_map(|d| d.to_le_bytes()).collect()
    });
    assert!(matches!(&e, ModelError::ShapeMismatch { found, .. } if *found == [64, 65]), "{e}");
    // A g_idx (group activation ordering) maps columns to groups out of order.
    let e = load("ct-g-idx", &|t| {
        t.push((format!("{module}.weight_g_idx"), safetensors::Dtype::I32, vec![4], vec![0; 16]));
    });
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("weight_g_idx")), "{e}");
    // An F16 scale of 10^4 at 4 bits: its bias -8 * 10^4 is past F16's range (infinite).
    let e = load("ct-scale-f16", &|t| {
        let s = t.iter_mut().find(|(n, ..)| *n == scale).expect("weight_scale");
        let mut vals: Vec<f32> = s.3.chunks(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        vals[3] = 1e4;
        s.1 = safetensors::Dtype::F16;
        s.3 = vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
    });
    assert!(matches!(&e, ModelError::WeightOutOfRange { tensor, index: 3, .. } if *tensor == scale), "{e}");
}

#[test]
fn end_of_sequence_ids_are_kept_or_refused_never_dropped() {
    let Some(ctx) = gpu() else { return };
    let demo = root().join("examples/assets/demo");
    let load = |tag: &str, file: &str, eos: serde_json::Value| {
        let dir = std::env::temp_dir().join(format!("qwen35-test-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        for f in ["config.json", "generation_config.json", "model.safetensors"] {
            std::fs::copy(demo.join(f), dir.join(f)).expect("copy");
        }
        let path = dir.join(file);
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
        cfg["eos_token_id"] = eos;
        std::fs::write(&path, cfg.to_string()).expect("write");
        let result = Model::load(ctx.clone(), &dir).map(|m| m.eos_token_ids.clone());
        std::fs::remove_dir_all(&dir).expect("cleanup");
        result
    };
    // null in generation_config.json is no value: config.json's id stands (it replaced it with none).
    let gen = "generation_config.json";
    assert_eq!(load("eos-null", gen, serde_json::Value::Null).expect("loads"), [2]);
    assert_eq!(load("eos-list", gen, serde_json::json!([2, 7])).expect("loads"), [2, 7]);
    // A string, a negative or fractional id, or one past the vocabulary (420) is an error naming
    // the file: dropping it would let every answer run to max_tokens.
    for (file, eos) in [
        (gen, serde_json::json!([2, "</s>"])),
        (gen, serde_json::json!(420)),
        ("config.json", serde_json::json!(-1)),
        ("config.json", serde_json::json!(2.5)),
    ] {
        let e = load("eos-bad", file, eos.clone()).expect_err("refused");
        assert!(
            matches!(&e, ModelError::BadConfig { field, .. } if *field == format!("{file} eos_token_id")),
            "{file} {eos}: {e}"
        );
    }
}

/// A safetensors file written by hand: the length field, `header` and `data`.
fn raw_safetensors(len_field: u64, header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = len_field.to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The error of opening a directory whose only weights file holds `bytes`.
fn header_error(tag: &str, bytes: &[u8]) -> String {
    let dir = std::env::temp_dir().join(format!("qwen35-test-hdr-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("model.safetensors"), bytes).expect("write");
    let e = Checkpoint::open_dir(&dir).err().unwrap_or_else(|| panic!("{tag}: must be refused"));
    assert!(matches!(e, ModelError::BadSafetensors { .. }), "{tag}: {e}");
    e.to_string()
}

#[test]
fn safetensors_offsets_must_tile_the_data_section_exactly() {
    // Two f32 tensors of 2 elements, header padded with spaces to 8 bytes as the writers do.
    let entry =
        |name: &str, b: u64, e: u64| format!(r#""{name}":{{"dtype":"F32","shape":[2],"data_offsets":[{b},{e}]}}"#);
    let header = |entries: &[String]| {
        let mut h = format!("{{{}}}", entries.join(","));
        while h.len() % 8 != 0 {
            h.push(' ');
        }
        h.push_str("        ");
        h
    };
    let data: Vec<u8> = (0u8..16).collect();
    let good = header(&[entry("a", 0, 8), entry("b", 8, 16)]);
    let dir = std::env::temp_dir().join(format!("qwen35-test-hdr-good-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("model.safetensors"), raw_safetensors(good.len() as u64, &good, &data)).expect("w");
    let ck = Checkpoint::open_dir(&dir).expect("a well-formed file opens");
    assert_eq!(ck.read(ck.get("b").expect("b")).expect("read"), data[8..]);

    // The length field one byte short: the JSON still parses (a padding space is cut off), but
    // the data section would start a byte early and every weight would be shifted.
    let e = header_error("short", &raw_safetensors(good.len() as u64 - 1, &good, &data));
    assert!(e.contains("data section"), "{e}");
    // One byte long: the header takes the first data byte.
    header_error("long", &raw_safetensors(good.len() as u64 + 1, &good, &data));
    header_error("zero", &raw_safetensors(0, &good, &data));
    // Bytes after the last tensor (the file size does not match the header).
    let mut extra = data.clone();
    extra.push(0);
    let e = header_error("trailing", &raw_safetensors(good.len() as u64, &good, &extra));
    assert!(e.contains("tensors end at byte 16 of a 17-byte data section"), "{e}");
    // Overlap, a gap, a tensor past the end, a size that is not dtype size × elements.
    let cases = [
        ("overlap", vec![entry("a", 0, 8), entry("b", 4, 12)], "overlap"),
        ("gap", vec![entry("a", 0, 8), entry("b", 12, 20)], "outside"),
        ("gap2", vec![entry("a", 8, 16)], "gap"),
        ("past", vec![entry("a", 0, 8), entry("b", 8, 24)], "outside"),
        ("size", vec![entry("a", 0, 4), entry("b", 4, 16)], "needs 8 bytes"),
        ("dup", vec![entry("a", 0, 8), entry("a", 8, 16)], "appears twice"),
    ];
    for (tag, entries, want) in cases {
        let h = header(&entries);
        let e = header_error(tag, &raw_safetensors(h.len() as u64, &h, &data));
        assert!(e.contains(want), "{tag}: {e}");
    }
    // A shape whose element count overflows u64.
    let h = header(&[r#""a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}"#.to_string()]);
    let e = header_error("overflow", &raw_safetensors(h.len() as u64, &h, &data));
    assert!(e.contains("more than 2^64"), "{e}");
}

#[test]
fn header_errors_print_sizes_not_file_content() {
    // The first 8 bytes of a text file read as a length: the error must not echo them (nor
    // their value as a number), whatever a symlink points at.
    let text = b"root:x:0:0:root:/root:/bin/bash\n";
    let field = u64::from_le_bytes(text[..8].try_into().expect("8 bytes"));
    let e = header_error("text", text);
    assert!(!e.contains(&field.to_string()) && !e.contains("root"), "{e}");
    assert!(e.contains(&format!("file of {} bytes", text.len())), "{e}");
    let mut small = 1000u64.to_le_bytes().to_vec();
    small.extend_from_slice(b"{}");
    let e = header_error("past-end", &small);
    assert!(!e.contains("1000") && e.contains("10-byte file"), "{e}");
}

#[cfg(unix)]
#[test]
fn devices_fifos_and_huge_files_are_refused_before_reading() {
    let dir = scratch_copy(&fixture_model(BASE), "devices");
    let config = dir.join("config.json");
    let weights = dir.join("model.safetensors");
    let link = |target: &str, at: &Path| {
        std::fs::remove_file(at).expect("rm");
        std::os::unix::fs::symlink(target, at).expect("symlink");
    };
    // config.json → /dev/zero would read forever, → /dev/null is empty, not missing.
    for dev in ["/dev/zero", "/dev/null"] {
        link(dev, &config);
        let e = TextConfig::from_dir(&dir).expect_err(dev);
        assert!(
            matches!(&e, ModelError::File(FileError::NotRegular { what, kind, .. }) if what == "config.json" && *kind == "a character device"),
            "{e}"
        );
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
    // A FIFO with no writer: opening it would block.
    std::fs::remove_file(&config).expect("rm");
    let ok = std::process::Command::new("mkfifo").arg(&config).status().expect("mkfifo");
    assert!(ok.success());
    let e = TextConfig::from_dir(&dir).expect_err("fifo");
    assert!(matches!(&e, ModelError::File(FileError::NotRegular { kind, .. }) if *kind == "a FIFO"), "{e}");
    // A sparse 1 GiB config.json is refused by its length.
    std::fs::remove_file(&config).expect("rm");
    std::fs::File::create(&config).and_then(|f| f.set_len(1 << 30)).expect("sparse");
    let e = TextConfig::from_dir(&dir).expect_err("sparse");
    assert!(matches!(&e, ModelError::File(FileError::TooLarge { size, .. }) if *size == 1 << 30), "{e}");
    // The weights file as a device or FIFO is named as such, not "no model.safetensors".
    link("/dev/null", &weights);
    let e = Checkpoint::open_dir(&dir).err().expect("/dev/null weights");
    assert!(matches!(&e, ModelError::File(FileError::NotRegular { kind, .. }) if *kind == "a character device"), "{e}");
    std::fs::remove_file(&weights).expect("rm");
    let ok = std::process::Command::new("mkfifo").arg(&weights).status().expect("mkfifo");
    assert!(ok.success());
    let e = Checkpoint::open_dir(&dir).err().expect("fifo weights");
    assert!(matches!(&e, ModelError::File(FileError::NotRegular { kind, .. }) if *kind == "a FIFO"), "{e}");
    // A sharded index that is a FIFO.
    std::fs::remove_file(&weights).expect("rm");
    let index = dir.join("model.safetensors.index.json");
    let ok = std::process::Command::new("mkfifo").arg(&index).status().expect("mkfifo");
    assert!(ok.success());
    let e = Checkpoint::open_dir(&dir).err().expect("fifo index");
    assert!(matches!(&e, ModelError::File(FileError::NotRegular { kind, .. }) if *kind == "a FIFO"), "{e}");
}

#[test]
fn dtype_strings_the_safetensors_format_does_not_define_are_refused_even_on_ignored_tensors() {
    for (tag, dtype) in [("q4_0", "Q4_0"), ("empty", ""), ("lower", "f32")] {
        let dir = scratch_copy(&fixture_model(BASE), &format!("dtype-{tag}"));
        let file = dir.join("model.safetensors");
        let bytes = std::fs::read(&file).expect("read");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
        let name = header.as_object().expect("map").keys().find(|k| *k != "__metadata__").expect("a tensor").clone();
        header[&name]["dtype"] = serde_json::json!(dtype);
        let text = header.to_string();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&file, out).expect("write");
        match Checkpoint::open_dir(&dir) {
            Err(ModelError::BadSafetensors { message, .. }) => {
                assert!(message.contains("is not a safetensors dtype"), "{dtype}: {message}")
            }
            other => panic!("{dtype:?}: expected BadSafetensors, got {:?}", other.err()),
        }
    }
}

/// Sub-byte dtypes get the reference parser's size check: whole bytes, and as many as the shape
/// needs (they were accepted at any size, so a file safetensors refuses loaded).
#[test]
fn sub_byte_tensors_must_fill_whole_bytes_as_the_format_says() {
    let file = |dtype: &str, shape: &str, end: usize| {
        let header = format!(r#"{{"t":{{"dtype":"{dtype}","shape":{shape},"data_offsets":[0,{end}]}}}}"#);
        raw_safetensors(header.len() as u64, &header, &vec![0u8; end])
    };
    for (tag, dtype, shape, end, want) in [
        ("f4-odd", "F4", "[3]", 2, "not whole bytes"),
        ("f4-long", "F4", "[4]", 4, "needs 2 bytes"),
        ("f6-short", "F6_E2M3", "[4]", 2, "needs 3 bytes"),
    ] {
        let e = header_error(tag, &file(dtype, shape, end));
        assert!(e.contains(want), "{tag}: {e}");
    }
    for (tag, dtype, shape, end) in [("f4-ok", "F4", "[4]", 2), ("f6-ok", "F6_E3M2", "[4]", 3)] {
        let dir = std::env::temp_dir().join(format!("qwen35-test-hdr-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("model.safetensors"), file(dtype, shape, end)).expect("write");
        assert!(Checkpoint::open_dir(&dir).is_ok(), "{tag}: the format allows it");
    }
}

/// A `Model`'s fields are public too: one edited past what its weights are (a layer type
/// dropped or changed, a config size of 0, a matrix's shape) is refused by a session, a batch and
/// an adapter upload, typed and naming the field or tensor, before any buffer is sized from it.
#[test]
fn hand_edited_models_are_refused_before_a_step() {
    let Some(ctx) = gpu() else { return };
    let dir = fixture_model(BASE);
    let load = || Model::load(ctx.clone(), &dir).expect("fixture model");
    let good = load();
    assert!(good.check().is_ok());
    let adapter = qwen35_wgpu::lora::peft::parse(&root().join("tests/fixtures/adapters/odd_r4"), &good.config)
        .expect("fixture adapter");
    let good = Arc::new(good);
    assert!(Session::new(good.clone(), SessionOptions::default()).is_ok());
    assert!(Batch::new(good.clone(), 2).is_ok());
    assert!(LoraAdapter::upload(&good, &adapter).is_ok());
    type Edit = fn(&mut Model);
    let cases: [(Edit, &str); 6] = [
        (|m| _ = m.config.layer_types.pop(), "num_hidden_layers"),
        (|m| m.config.conv_kernel = 0, "linear_conv_kernel_dim"),
        (|m| m.config.layer_types[1] = LayerType::Linear, "layer_types[1]"),
        (|m| m.layers[2].mlp.down_proj.rows -= 1, "layers.2.mlp.down_proj"),
        (|m| m.embed.chunks[0].row_start = 1, "embed_tokens.weight"),
        (|m| m.module_prefix = "language_model.model.", "module_prefix"),
    ];
    for (edit, name) in cases {
        let mut model = load();
        edit(&mut model);
        let named = |e: &ModelError| match e {
            ModelError::BadConfig { field, .. } => field.clone(),
            ModelError::ShapeMismatch { name, .. } => name.clone(),
            other => panic!("{name}: expected BadConfig or ShapeMismatch, got {other}"),
        };
        assert_eq!(named(&model.check().expect_err(name)), name);
        let model = Arc::new(model);
        let run = |e: RunError| match e {
            RunError::ModelConfig(inner) => named(&inner),
            other => panic!("{name}: expected ModelConfig, got {other}"),
        };
        assert_eq!(run(Session::new(model.clone(), SessionOptions::default()).err().expect(name)), name);
        assert_eq!(run(Batch::new(model.clone(), 2).err().expect(name)), name);
        match LoraAdapter::upload(&model, &adapter).err().expect(name) {
            AdapterError::ModelConfig(inner) => assert_eq!(named(&inner), name),
            other => panic!("{name}: expected ModelConfig, got {other}"),
        }
    }
}
