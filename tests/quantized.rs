//! MLX-format checkpoints (bf16 and affine 4/8-bit, a mixed per-module config, our q4-quality
//! recipe with bf16 in_proj_a/b beside 4-bit in_proj_qkv/z; made by
//! `mlx_lm.convert` in `cargo xtask fixtures`): logits and greedy ids vs transformers on the
//! dequantized weights, logits vs mlx-lm's own forward.

mod common;

use std::sync::Arc;

use common::tolerance::{LOGITS_MAX_ABS, LOGITS_REL, MLX_LOGITS_MAX_ABS, MLX_LOGITS_REL};
use common::{fixture_model, gpu, rel_and_max, scratch_copy, Reference};
use qwen35_wgpu::gpu::Dtype;
use qwen35_wgpu::model::quantize::quantize_bytes;
use qwen35_wgpu::model::{save_mlx, Checkpoint, Mixer};
use qwen35_wgpu::{
    AdapterError, GenerateParams, LoadOptions, LoraAdapter, Model, QuantizeRecipe, Session, SessionOptions,
};

const FIXTURES: [&str; 5] = ["mlx_bf16", "mlx_q4_g64", "mlx_q8_g32", "mlx_mixed", "mlx_q4_quality"];
/// With a compressed-tensors W4A16 (pack-quantized, group 64, in_proj_a/b ignored) checkpoint,
/// whose reference is transformers on that checkpoint itself (decompressed by compressed-tensors).
const WITH_TRANSFORMERS: [&str; 6] =
    ["mlx_bf16", "mlx_q4_g64", "mlx_q8_g32", "mlx_mixed", "mlx_q4_quality", "ct_w4a16_g64"];
const PROMPTS: usize = 2;

fn load(name: &str) -> Option<Arc<Model>> {
    let ctx = gpu()?;
    Some(Arc::new(Model::load(ctx, &fixture_model(name)).unwrap_or_else(|e| panic!("{name}: {e}"))))
}

fn session(model: &Arc<Model>) -> Session {
    Session::new(model.clone(), SessionOptions { max_context: 64, max_batch: 16 }).expect("session")
}

/// Every position of `ours` vs `want` (rows of `vocab` logits): ‖ours − want‖ / ‖want‖ ≤ `rel` and
/// max |ours − want| ≤ `abs`.
fn assert_rows(what: &str, ours: &[f32], want: &[f32], vocab: usize, rel: f32, abs: f32) {
    common::assert_whole_rows(what, ours, want, vocab);
    for (pos, (o, w)) in ours.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let (r, m) = rel_and_max(o, w);
        assert!(r <= rel && m <= abs, "{what} position {pos}: rel {r:.3e} (≤ {rel}), max abs {m:.3e} (≤ {abs})");
    }
}

#[test]
fn mlx_checkpoints_load_quantized_as_their_config_says() {
    let Some(q4) = load("mlx_q4_g64") else {
        return;
    };
    let affine = |d: Dtype| match d {
        Dtype::Affine(a) => Some((a.bits, a.group)),
        _ => None,
    };
    assert_eq!(affine(q4.embed.dtype), Some((4, 64)), "q4 embedding (the tied lm_head)");
    assert_eq!(affine(q4.layers[0].mlp.down_proj.dtype), Some((4, 64)));
    let mixed = load("mlx_mixed").expect("mixed");
    assert_eq!(affine(mixed.embed.dtype), Some((8, 64)), "mixed: embed_tokens override");
    assert_eq!(affine(mixed.layers[1].mlp.down_proj.dtype), Some((4, 128)), "mixed: down_proj g128");
    let Mixer::Gdn(g) = &mixed.layers[0].mixer else { panic!("layer 0 is GDN") };
    assert_eq!(affine(g.in_proj.dtype), Some((8, 64)), "mixed: layer 0 at 8-bit");
    assert_eq!(affine(g.out_proj.dtype), Some((8, 32)), "mixed: out_proj override");
    let ct = load("ct_w4a16_g64").expect("compressed-tensors");
    assert_eq!(affine(ct.layers[0].mlp.down_proj.dtype), Some((4, 64)), "W4A16 group 64");
    let Mixer::Gdn(g) = &ct.layers[0].mixer else { panic!("layer 0 is GDN") };
    let parts: Vec<Option<(u32, u32)>> = g.in_proj.chunks.iter().map(|c| affine(c.dtype)).collect();
    assert_eq!(parts, [Some((4, 64)), None], "qkv|z packed, the ignored in_proj_b|a in bf16");
    let bf16 = load("mlx_bf16").expect("bf16");
    assert_eq!(bf16.embed.dtype, Dtype::BF16);
    // 4-bit codes, one (scale, bias) word per 64 weights: well under a third of bf16's bytes.
    assert!(q4.embed.bytes() * 3 < bf16.embed.bytes(), "{} vs {}", q4.embed.bytes(), bf16.embed.bytes());
}

/// Prefill logits of every prompt of each fixture in `names` vs the reference's `key` tensor.
fn check_prefill(names: &[&str], key: &str, rel: f32, abs: f32) {
    for &name in names {
        let Some(model) = load(name) else {
            return;
        };
        let r = Reference::load(name);
        for p in 0..PROMPTS {
            let ids = r.ids(&format!("prompt{p}.ids"));
            let (_, want) = r.f32(&format!("prompt{p}.{key}"));
            let (logits, _) = session(&model).feed_debug(&ids).expect("forward");
            assert_rows(&format!("{name} prompt{p} vs {key}"), &logits.data, &want, model.config.vocab_size, rel, abs);
        }
    }
}

#[test]
fn mlx_prefill_logits_match_transformers_on_the_dequantized_weights() {
    check_prefill(&WITH_TRANSFORMERS, "logits", LOGITS_REL, LOGITS_MAX_ABS);
}

#[test]
fn mlx_greedy_continuations_match_transformers_on_the_dequantized_weights() {
    for name in WITH_TRANSFORMERS {
        let Some(model) = load(name) else {
            return;
        };
        let r = Reference::load(name);
        for p in 0..PROMPTS {
            let ids = r.ids(&format!("prompt{p}.ids"));
            let want = r.ids(&format!("prompt{p}.generated"));
            let params = GenerateParams { max_tokens: want.len(), stop_at_eos: false, ..Default::default() };
            for fused in [false, true] {
                let mut s = session(&model);
                s.set_fused_decode(fused);
                let got = s.generate(&ids, &params, |_| true).expect("generate");
                assert_eq!(got, want, "{name} prompt{p} (fused {fused}): greedy continuation");
            }
        }
    }
}

#[test]
fn mlx_prefill_logits_agree_with_mlx_lm() {
    check_prefill(&FIXTURES, "mlx_logits", MLX_LOGITS_REL, MLX_LOGITS_MAX_ABS);
}

/// Load-time quantization of the bf16 source the MLX fixtures were converted from gives, tensor
/// by tensor, the words, scales and biases `mlx_lm.convert` wrote (4-bit g64 and 8-bit g32 are
/// mlx-lm's; q4 is the recipe `QuantizeRecipe::Q4`, q8 g32 exercises the quantizer at group 32).
#[test]
fn load_time_quantization_is_bit_identical_to_mlx() {
    let src = Checkpoint::open_dir(&fixture_model("mlx_source_bf16")).expect("source");
    for (name, bits, group) in [("mlx_q4_g64", 4, 64), ("mlx_q8_g32", 8, 32)] {
        let mlx = Checkpoint::open_dir(&fixture_model(name)).expect("mlx");
        let mut matrices = 0;
        for mlx_name in mlx.names().filter(|n| n.ends_with(".scales")) {
            let module = mlx_name.trim_end_matches(".scales");
            let hf = format!("model.{}.weight", module.trim_start_matches("language_model.model."));
            let entry = src.get(&hf).unwrap_or_else(|| panic!("{hf} in the source"));
            let (rows, cols) = (entry.shape[0], entry.shape[1]);
            let q = quantize_bytes(&src.read(entry).expect("read"), Dtype::BF16, cols, bits, group).expect("quantize");
            let (words, scales, biases) = (&q.words, &q.scales, &q.biases);
            assert_eq!((q.format.bits, q.format.group, words.len()), (bits, group, rows * cols * bits as usize / 32));
            let want = |suffix: &str| mlx.read(mlx.get(&format!("{module}.{suffix}")).expect("tensor")).expect("read");
            assert!(bytemuck::cast_slice::<u32, u8>(words) == want("weight").as_slice(), "{name} {module}: codes");
            assert!(bytemuck::cast_slice::<u16, u8>(scales) == want("scales").as_slice(), "{name} {module}: scales");
            assert!(bytemuck::cast_slice::<u16, u8>(biases) == want("biases").as_slice(), "{name} {module}: biases");
            matrices += 1;
        }
        // 4 layers × 7 or 8 projections, and the embedding.
        assert_eq!(matrices, 3 * 8 + 7 + 1, "{name}: quantized matrices compared");
    }
}

/// The bf16 source quantized at load runs exactly as mlx-lm's conversion of it: with the MLX
/// file's norms replaced by the source's (mlx-lm stores `1 + w` rounded to bf16; here `1 + w` in
/// f32, which the loader's shift back returns exactly), the logits are bit-identical.
#[test]
fn a_checkpoint_quantized_at_load_runs_as_mlx_lms_conversion() {
    let Some(ctx) = gpu() else { return };
    let src_dir = fixture_model("mlx_source_bf16");
    let src = Checkpoint::open_dir(&src_dir).expect("source");
    let dir = scratch_copy(&fixture_model("mlx_q4_g64"), "q4-exact-norms");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let shifted = [
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    ];
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if shifted.iter().any(|s| name.ends_with(s)) {
            let hf = format!("model.{}", name.trim_start_matches("language_model.model."));
            let w = src.read_f32(&hf, view.shape()).expect("source norm");
            let plus: Vec<u8> = w.iter().flat_map(|v| (v + 1.0).to_le_bytes()).collect();
            tensors.push((name, safetensors::Dtype::F32, view.shape().to_vec(), plus));
        } else {
            tensors.push((name, view.dtype(), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    let views: std::collections::HashMap<String, safetensors::tensor::TensorView> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &file).expect("write");
    let mlx = Arc::new(Model::load(ctx.clone(), &dir).expect("mlx"));
    let opts = LoadOptions { quantize: Some(QuantizeRecipe::Q4), ..Default::default() };
    let ours = Arc::new(Model::load_with(ctx, &src_dir, &opts).expect("quantized at load"));
    assert!(matches!(ours.embed.dtype, Dtype::Affine(a) if a.bits == 4 && a.group == 64));
    let r = Reference::load("mlx_q4_g64");
    for p in 0..PROMPTS {
        let ids = r.ids(&format!("prompt{p}.ids"));
        let (a, _) = session(&mlx).feed_debug(&ids).expect("mlx forward");
        let (b, _) = session(&ours).feed_debug(&ids).expect("our forward");
        assert!(a.data == b.data, "prompt{p}: logits of the load-time q4 differ from mlx-lm's q4");
    }
}

/// A PEFT adapter (scales 1 and 0.5) and an MLX adapter (`mlx_lm.lora`'s files: transposed
/// factors, an absolute scale) on the 4-bit base, unmerged, vs transformers + peft on the
/// dequantized base: logits and greedy ids (fused and unfused decode).
#[test]
fn lora_adapters_apply_on_a_quantized_base() {
    let Some(model) = load("mlx_q4_g64") else {
        return;
    };
    let vocab = model.config.vocab_size;
    for name in ["mlx_q4_lora", "mlx_q4_mlx_lora"] {
        let path = common::root().join("tests/fixtures/adapters").join(name);
        let adapter = Arc::new(LoraAdapter::load(&model, &path).unwrap_or_else(|e| panic!("{name}: {e}")));
        let r = Reference::load(name);
        let scales: &[(f32, &str)] =
            if name == "mlx_q4_lora" { &[(1.0, "logits"), (0.5, "logits_half")] } else { &[(1.0, "logits")] };
        for p in 0..PROMPTS {
            let ids = r.ids(&format!("prompt{p}.ids"));
            for &(scale, key) in scales {
                let mut s = session(&model);
                s.set_adapter(Some((adapter.clone(), scale))).expect("adapter");
                let (logits, _) = s.feed_debug(&ids).expect("forward");
                assert_rows(
                    &format!("{name} scale {scale} prompt{p}"),
                    &logits.data,
                    &r.f32(&format!("prompt{p}.{key}")).1,
                    vocab,
                    LOGITS_REL,
                    LOGITS_MAX_ABS,
                );
            }
            if name == "mlx_q4_mlx_lora" {
                // mlx-lm itself with the adapter, in its dtypes (MLX_LOGITS_REL's bf16 noise).
                let mut s = session(&model);
                s.set_adapter(Some((adapter.clone(), 1.0))).expect("adapter");
                let (logits, _) = s.feed_debug(&ids).expect("forward");
                let (_, want) = r.f32(&format!("prompt{p}.mlx_logits"));
                assert_rows(
                    &format!("{name} prompt{p} vs mlx-lm"),
                    &logits.data,
                    &want,
                    vocab,
                    MLX_LOGITS_REL,
                    MLX_LOGITS_MAX_ABS,
                );
            }
            let want = r.ids(&format!("prompt{p}.generated"));
            let params = GenerateParams { max_tokens: want.len(), stop_at_eos: false, ..Default::default() };
            for fused in [false, true] {
                let mut s = session(&model);
                s.set_fused_decode(fused);
                s.set_adapter(Some((adapter.clone(), 1.0))).expect("adapter");
                let got = s.generate(&ids, &params, |_| true).expect("generate");
                assert_eq!(got, want, "{name} prompt{p} (fused {fused}): greedy continuation");
            }
        }
    }
}

/// An MLX adapter directory with `edit` applied to its config.
fn mlx_adapter_with(tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> std::path::PathBuf {
    let dir = scratch_copy(&common::root().join("tests/fixtures/adapters/mlx_q4_mlx_lora"), tag);
    let path = dir.join("adapter_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    edit(&mut cfg);
    std::fs::write(&path, cfg.to_string()).expect("write");
    dir
}

#[test]
fn malformed_mlx_adapters_are_typed_errors() {
    let Some(model) = load("mlx_q4_g64") else {
        return;
    };
    let err = |dir: std::path::PathBuf| LoraAdapter::load(&model, &dir).err().expect("must fail");
    let e = err(mlx_adapter_with("mlx-dora", |c| c["fine_tune_type"] = "dora".into()));
    assert!(matches!(&e, AdapterError::Unsupported { feature, .. } if feature == "DoRA"), "{e}");
    let e = err(mlx_adapter_with("mlx-full", |c| c["fine_tune_type"] = "full".into()));
    assert!(matches!(&e, AdapterError::Unsupported { key, .. } if key == "fine_tune_type"), "{e}");
    let e = err(mlx_adapter_with("mlx-rank", |c| c["lora_parameters"]["rank"] = 4.into()));
    assert!(matches!(&e, AdapterError::RankMismatch { expected: 4, found: 8, .. }), "{e}");
    let e = err(mlx_adapter_with("mlx-keys", |c| c["lora_parameters"]["keys"] = serde_json::json!(["mlp.up_proj"])));
    assert!(matches!(&e, AdapterError::NotTargeted { .. }), "{e}");
    let e = err(mlx_adapter_with("mlx-scale", |c| c["lora_parameters"]["scale"] = "big".into()));
    assert!(matches!(&e, AdapterError::BadConfig { field, .. } if field == "lora_parameters.scale"), "{e}");
    let no_config = mlx_adapter_with("mlx-noconfig", |_| {});
    std::fs::remove_file(no_config.join("adapter_config.json")).expect("rm");
    assert!(matches!(err(no_config), AdapterError::NotPeft { .. }));
}

/// The tensors of a safetensors file: name -> (dtype, shape, bytes).
fn tensors_of(path: &std::path::Path) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// save_mlx's error (as text) on a scratch copy of the bf16 source with one BF16 tensor written
/// over or beside its tensors: `edit` gets the source's names and returns the tensor's name,
/// shape and bytes. The refused save must write nothing.
fn refused_save(tag: &str, edit: impl FnOnce(&[String]) -> (String, Vec<usize>, Vec<u8>)) -> String {
    use safetensors::tensor::TensorView;
    let src = scratch_copy(&fixture_model("mlx_source_bf16"), tag);
    let file = src.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let names: Vec<String> = st.names().into_iter().map(String::from).collect();
    let (name, shape, data) = edit(&names);
    let mut views: Vec<(String, TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| *n != name).map(|(n, v)| (n.to_string(), v)).collect();
    views.push((name, TensorView::new(safetensors::Dtype::BF16, shape, &data).expect("view")));
    std::fs::write(&file, safetensors::serialize(views, None).expect("serialize")).expect("write");
    let dir = std::env::temp_dir().join(format!("qwen35-{tag}-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let e = save_mlx(&src, &dir, QuantizeRecipe::Q4).expect_err(tag).to_string();
    assert!(!dir.exists(), "{tag}: nothing written");
    std::fs::remove_dir_all(&src).ok();
    e
}

/// A source tensor that would land on the name of another one's output (a stray `.scales`
/// beside a quantized weight) is refused, and nothing is written.
#[test]
fn mlx_saves_refuse_colliding_names() {
    let e = refused_save("mlx-collide", |names| {
        let embed = names.iter().find(|n| n.ends_with("embed_tokens.weight")).expect("embed");
        (embed.replace(".weight", ".scales"), vec![2], vec![0; 4])
    });
    assert!(e.contains("embed_tokens.scales"), "{e}");
}

/// A matrix to quantize with no rows and a width whose word count overflows (a header the
/// safetensors sizes accept: zero bytes) is a typed error, not an overflow.
#[test]
fn mlx_saves_refuse_empty_matrices_of_absurd_width() {
    let mut up = String::new();
    let e = refused_save("mlx-absurd-width", |names| {
        up = names.iter().find(|n| n.ends_with("layers.0.mlp.up_proj.weight")).expect("up_proj").clone();
        (up.clone(), vec![0, 1 << 62], Vec::new())
    });
    assert!(e.contains(&up) && e.contains("row"), "{e}");
}

/// A sparse source with one extra 4 GiB tensor under the text prefix (its header is valid, its
/// bytes never written) is refused from the header before that tensor is read, and nothing is
/// written: save_mlx holds what it writes in memory, so what it reads is bounded by the config.
#[test]
fn mlx_saves_refuse_sources_larger_than_their_config() {
    let src = scratch_copy(&fixture_model("mlx_source_bf16"), "mlx-sparse");
    let file = src.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header");
    let data = &bytes[8 + header_len..];
    let prefix = {
        let embed = header.as_object().expect("object").keys().find(|k| k.ends_with("embed_tokens.weight"));
        embed.expect("embed").trim_end_matches("embed_tokens.weight").to_string()
    };
    let (rows, cols) = (1usize << 20, 2048usize);
    let extra = rows * cols * 2;
    header[format!("{prefix}layers.0.extra.weight")] =
        serde_json::json!({"dtype": "BF16", "shape": [rows, cols], "data_offsets": [data.len(), data.len() + extra]});
    let mut h = serde_json::to_vec(&header).expect("header");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(&h);
    out.extend(data);
    std::fs::write(&file, &out).expect("write");
    std::fs::File::options()
        .write(true)
        .open(&file)
        .expect("open")
        .set_len((out.len() + extra) as u64)
        .expect("sparse");
    let dir = std::env::temp_dir().join(format!("qwen35-mlx-sparse-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let start = std::time::Instant::now();
    let e = save_mlx(&src, &dir, QuantizeRecipe::Q4).expect_err("4 GiB past the config");
    assert!(matches!(&e, qwen35_wgpu::ModelError::TooManyElements { found, limit, .. } if found > limit), "{e}");
    assert!(start.elapsed().as_secs() < 10, "refused from the header, not after reading");
    assert!(!dir.exists(), "nothing written");
    std::fs::remove_dir_all(&src).ok();
}

/// A save into a directory whose index would shadow the saved file, or into the source itself,
/// is refused before anything is written; a save whose config cannot be moved into place (a
/// directory holds its name) leaves the earlier weights and no temporary behind.
#[test]
fn mlx_saves_refuse_shadowed_or_source_outputs_and_leave_earlier_saves_whole() {
    let src = fixture_model("mlx_source_bf16");
    let dir = std::env::temp_dir().join(format!("qwen35-mlx-save-guard-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("model.safetensors.index.json"), "{}").expect("index");
    let e = save_mlx(&src, &dir, QuantizeRecipe::Q4).expect_err("an index would shadow the save").to_string();
    assert!(e.contains("shadow"), "{e}");
    std::fs::remove_file(dir.join("model.safetensors.index.json")).expect("rm index");
    let copy = scratch_copy(&src, "mlx-save-onto-source");
    let e = save_mlx(&copy, &copy.join("."), QuantizeRecipe::Q4).expect_err("onto the source").to_string();
    assert!(e.contains("is the source"), "{e}");
    std::fs::remove_dir_all(&copy).ok();
    std::fs::create_dir_all(dir.join("model.safetensors/inner")).expect("a directory in the way");
    let e = save_mlx(&src, &dir, QuantizeRecipe::Q4).expect_err("a directory holds the name").to_string();
    assert!(e.contains("directory"), "{e}");
    assert!(dir.join("model.safetensors/inner").is_dir(), "the directory is left as it was");
    std::fs::remove_dir_all(dir.join("model.safetensors")).expect("rm");
    let stray: Vec<_> = std::fs::read_dir(&dir).expect("dir").collect();
    assert!(stray.is_empty(), "a refused save leaves nothing: {stray:?}");
    std::fs::write(dir.join("model.safetensors"), b"earlier").expect("sentinel");
    std::fs::create_dir_all(dir.join("config.json/blocker")).expect("blocker");
    let e = save_mlx(&src, &dir, QuantizeRecipe::Q4).expect_err("the config cannot be moved into place").to_string();
    assert!(e.contains("config.json"), "{e}");
    assert!(std::fs::read(dir.join("model.safetensors")).expect("weights") == b"earlier", "earlier weights back");
    let mut left: Vec<String> =
        std::fs::read_dir(&dir).expect("dir").map(|e| e.expect("entry").file_name().to_string_lossy().into()).collect();
    left.sort();
    assert_eq!(left, ["config.json", "model.safetensors"], "nothing else left");
    std::fs::remove_dir_all(&dir).ok();
}

/// Saving the bf16 source as an MLX directory writes, tensor for tensor, what `mlx_lm.convert`
/// wrote for it (codes, scales, biases, the +1-shifted norms in bf16, conv weights `[C, K, 1]`),
/// and the same quantization section; the saved directory loads back and runs like mlx-lm's.
#[test]
fn an_mlx_directory_saved_here_is_mlx_lms() {
    let dir = std::env::temp_dir().join(format!("qwen35-mlx-save-{}", std::process::id()));
    let report = save_mlx(&fixture_model("mlx_source_bf16"), &dir, QuantizeRecipe::Q4).expect("save");
    assert_eq!(report.quantized, 32, "every projection and the embedding");
    let ours = tensors_of(&dir.join("model.safetensors"));
    let theirs = tensors_of(&fixture_model("mlx_q4_g64").join("model.safetensors"));
    assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>(), "tensor names");
    for (name, t) in &theirs {
        let o = &ours[name];
        assert!(o.0 == t.0 && o.1 == t.1, "{name}: {:?} {:?} vs mlx-lm's {:?} {:?}", o.0, o.1, t.0, t.1);
        assert!(o.2 == t.2, "{name}: bytes differ from mlx-lm's");
    }
    let cfg = |d: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).expect("config")).expect("json")
    };
    let (a, b) = (cfg(&dir), cfg(&fixture_model("mlx_q4_g64")));
    assert_eq!(a["quantization"], b["quantization"]);
    assert_eq!(a["model_type"], b["model_type"]);
    let Some(ctx) = gpu() else { return };
    let saved = Arc::new(Model::load(ctx.clone(), &dir).expect("the saved directory loads"));
    let mlx = Arc::new(Model::load(ctx, &fixture_model("mlx_q4_g64")).expect("mlx"));
    let ids = Reference::load("mlx_q4_g64").ids("prompt1.ids");
    let (x, _) = session(&saved).feed_debug(&ids).expect("forward");
    let (y, _) = session(&mlx).feed_debug(&ids).expect("forward");
    assert!(x.data == y.data, "the saved q4 runs bit-identically to mlx-lm's");
}

/// The quality recipe: in_proj_a/b stay bf16 inside the GDN's concatenated input projection
/// (chunks of their own beside the 4-bit rows), the sensitive projections and the embedding go
/// to 8 bits; saved, it is byte for byte mlx-lm's conversion with that recipe, and the config
/// records it per module. (Its logits: `mlx_q4_quality` in the parity tests above.)
#[test]
fn the_quality_recipe_mixes_precisions_as_it_says() {
    let Some(ctx) = gpu() else { return };
    let src = fixture_model("mlx_source_bf16");
    let opts = LoadOptions { quantize: Some(QuantizeRecipe::Q4Quality), ..Default::default() };
    let m = Model::load_with(ctx, &src, &opts).expect("q4-quality");
    let bits = |d: Dtype| match d {
        Dtype::Affine(a) => a.bits,
        _ => 16,
    };
    let Mixer::Gdn(g) = &m.layers[0].mixer else { panic!("layer 0 is GDN") };
    let chunks: Vec<(usize, u32)> = g.in_proj.chunks.iter().map(|c| (c.rows, bits(c.dtype))).collect();
    let c = &m.config;
    assert_eq!(
        chunks,
        [(c.conv_dim() + c.value_dim(), 4), (2 * c.linear_value_heads, 16)],
        "qkv|z at 4 bits, b|a in bf16"
    );
    assert_eq!(bits(g.out_proj.dtype), 8);
    assert_eq!((bits(m.embed.dtype), bits(m.layers[0].mlp.gate_up.dtype)), (8, 4));
    let Mixer::Attention(a) = &m.layers[3].mixer else { panic!("layer 3 is attention") };
    assert_eq!((bits(a.qkv.dtype), bits(a.o_proj.dtype)), (8, 8));
    let dir = std::env::temp_dir().join(format!("qwen35-mlx-save-quality-{}", std::process::id()));
    save_mlx(&src, &dir, QuantizeRecipe::Q4Quality).expect("save");
    // mlx-lm's conversion with the same recipe as a predicate (make_mlx.py quality_predicate).
    let ours = tensors_of(&dir.join("model.safetensors"));
    let theirs = tensors_of(&fixture_model("mlx_q4_quality").join("model.safetensors"));
    assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>(), "tensor names");
    for (name, t) in &theirs {
        assert!(ours[name] == *t, "{name}: differs from mlx-lm's q4-quality conversion");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config")).expect("json");
    let q = &cfg["quantization"];
    assert_eq!(q["bits"], 4);
    assert_eq!(q["language_model.model.layers.0.linear_attn.in_proj_a"], false);
    assert_eq!(q["language_model.model.layers.0.linear_attn.out_proj"]["bits"], 8);
    assert_eq!(q["language_model.model.embed_tokens"]["bits"], 8);
    assert!(q.get("language_model.model.layers.0.mlp.up_proj").is_none(), "default modules have no entry");
}
