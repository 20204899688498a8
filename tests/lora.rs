//! LoRA adapters against the transformers + peft oracle, the adapter API, and failure semantics.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::tolerance::{ADAPTER_EFFECT_REL, PATHS_REL};
use common::{check_logits, fixture_model, gpu, rel_and_max, root, scratch_copy, Reference};
use qwen35_wgpu::{
    AdapterError, BackendError, GenerateParams, LearnError, LearnOptions, LlmBackend, LoraAdapter, Model, ModelInfo,
    Proj, Session, SessionOptions, TextTokenizer, TrainSpec, WgpuBackend,
};

/// (adapter, base model, scales with a reference).
const CASES: [(&str, &str, &[f32]); 6] = [
    ("all12_r8", "gva_tied_f32", &[1.0, 0.5, 2.0, -1.0]),
    ("gdn_mlp_r4_rslora", "gva_tied_f32", &[1.0]),
    ("patterns_r16", "gva_tied_f32", &[1.0]),
    ("layers_0_3", "gva_tied_f32", &[1.0]),
    ("vlm_bf16_r8", "vlm_bf16_sharded", &[1.0]),
    ("odd_r4", "odd_untied_f32", &[1.0]),
];

fn adapter_path(name: &str) -> PathBuf {
    root().join("tests/fixtures/adapters").join(name)
}

fn opts() -> SessionOptions {
    SessionOptions { max_context: 64, max_batch: 16 }
}

fn load_model(name: &str) -> Option<Arc<Model>> {
    let ctx = gpu()?;
    Some(Arc::new(Model::load(ctx, &fixture_model(name)).expect("model")))
}

#[test]
fn logits_and_greedy_match_peft_for_every_adapter_and_scale() {
    let r = Reference::load("adapters");
    for (name, base, scales) in CASES {
        let Some(model) = load_model(base) else { return };
        let adapter =
            Arc::new(LoraAdapter::load(&model, &adapter_path(name)).unwrap_or_else(|e| panic!("{name}: {e}")));
        let ids = r.ids(&format!("{name}.ids"));
        let base_logits = Session::new(model.clone(), opts()).expect("session").feed_all(&ids).expect("base");
        for &scale in scales {
            let key = format!("{name}.s{scale}");
            let (_, want) = r.f32(&format!("{key}.logits"));
            let mut s = Session::new(model.clone(), opts()).expect("session");
            s.set_adapter(Some((adapter.clone(), scale))).expect("activate");
            let got = s.feed_all(&ids).expect("forward");
            check_logits(&key, &got.data, &want, model.config.vocab_size);
            let (rel, _) = rel_and_max(&got.data, &base_logits.data);
            assert!(rel > ADAPTER_EFFECT_REL, "{key}: the adapter barely changes the logits (rel {rel:.2e})");

            let gen_want = r.ids(&format!("{key}.generated"));
            let mut s = Session::new(model.clone(), opts()).expect("session");
            s.set_adapter(Some((adapter.clone(), scale))).expect("activate");
            let params = GenerateParams { max_tokens: gen_want.len(), stop_at_eos: false, ..Default::default() };
            assert_eq!(s.generate(&ids, &params, |_| true).expect("generate"), gen_want, "{key}: greedy");
        }
    }
}

#[test]
fn adapter_info_reports_ranks_and_covered_modules() {
    let Some(model) = load_model("gva_tied_f32") else {
        return;
    };
    let a = LoraAdapter::load(&model, &adapter_path("patterns_r16")).expect("load");
    assert_eq!(a.info.ranks, vec![4, 8, 16]);
    assert!(a.info.modules.contains(&(3, Proj::QProj)));
    assert_eq!(a.info.modules.len(), common::lora_a_tensors(&adapter_path("patterns_r16")));
    let l = LoraAdapter::load(&model, &adapter_path("layers_0_3")).expect("load");
    assert!(l.info.modules.iter().all(|(layer, _)| *layer == 0 || *layer == 3));
    assert_eq!(l.info.modules.len(), common::lora_a_tensors(&adapter_path("layers_0_3")));
}

#[test]
fn metadata_only_file_uses_its_alpha() {
    let Some(model) = load_model("gva_tied_f32") else {
        return;
    };
    let r = Reference::load("adapters");
    let a = LoraAdapter::load(&model, &root().join("tests/fixtures/adapters/meta_only.safetensors")).expect("load");
    assert_eq!(a.info.config_source, qwen35_wgpu::lora::ConfigSource::FileMetadata);
    let ids = r.ids("all12_r8.ids");
    let mut s = Session::new(model.clone(), opts()).expect("session");
    s.set_adapter(Some((Arc::new(a), 1.0))).expect("activate");
    // alpha 32 at r 8 equals all12_r8 (alpha 16) at scale 2.
    let (_, want) = r.f32("all12_r8.s2.logits");
    check_logits("meta_only", &s.feed_all(&ids).expect("forward").data, &want, model.config.vocab_size);
}

#[test]
fn unload_and_switching_are_bit_identical() {
    let Some(model) = load_model("gva_tied_f32") else {
        return;
    };
    let ids = Reference::load("adapters").ids("all12_r8.ids");
    let a = Arc::new(LoraAdapter::load(&model, &adapter_path("all12_r8")).expect("a"));
    let b = Arc::new(LoraAdapter::load(&model, &adapter_path("patterns_r16")).expect("b"));
    let mut s = Session::new(model.clone(), opts()).expect("session");
    let base = s.feed_all(&ids).expect("base").data;
    let mut run = |adapter: Option<(Arc<LoraAdapter>, f32)>| {
        s.set_adapter(adapter).expect("set");
        s.reset();
        s.feed_all(&ids).expect("forward").data
    };
    let with_a = run(Some((a.clone(), 1.0)));
    let with_b = run(Some((b.clone(), 1.0)));
    let again_a = run(Some((a.clone(), 1.0)));
    let unloaded = run(None);
    assert_ne!(with_a, with_b);
    assert_eq!(with_a, again_a, "A -> B -> A must give bit-identical A");
    assert_eq!(unloaded, base, "unloading must restore the base model bit for bit");
}

#[test]
fn prefill_with_adapter_equals_token_by_token_decode() {
    let Some(model) = load_model("gva_tied_f32") else {
        return;
    };
    let ids = Reference::load("adapters").ids("all12_r8.ids");
    let a = Arc::new(LoraAdapter::load(&model, &adapter_path("all12_r8")).expect("a"));
    let mut s = Session::new(model.clone(), opts()).expect("session");
    s.set_adapter(Some((a, 1.0))).expect("set");
    let full = s.feed_all(&ids).expect("prefill").data;
    // Decode with the block norms and SwiGLU folded into the projections (and the shrinks), and
    // without.
    for fused in [false, true] {
        s.reset();
        s.set_fused_decode(fused);
        let mut steps = Vec::new();
        for &id in &ids {
            steps.extend(s.feed(&[id]).expect("decode").data);
        }
        let (rel, _) = rel_and_max(&steps, &full);
        assert!(rel <= PATHS_REL, "decode vs prefill with adapter (fused {fused}): rel {rel:.3e}");
    }
}

/// With the norms folded (the default), an adapter on all 12 projections adds one dispatch to
/// a decode token: layer 0's mixer input shrink. Every other group's shrink is written by the
/// dispatch before it (the mixers' split by head, the SwiGLU's and each residual projection's
/// shrink out); a fallback to a shrink dispatch of its own fails this, also in a session that
/// steps one token at a time (`max_batch` 1: its scratch still has room for those parts).
#[test]
fn a_fused_decode_token_with_an_adapter_takes_one_shrink_dispatch() {
    let Some(ctx) = gpu().map(|_| Arc::new(qwen35_wgpu::GpuContext::new().expect("context"))) else {
        return;
    };
    // A context of its own: the shared one counts the work of tests running beside this one.
    let model = Arc::new(Model::load(ctx, &fixture_model("gva_tied_f32")).expect("model"));
    let ids = Reference::load("adapters").ids("all12_r8.ids");
    let a = Arc::new(LoraAdapter::load(&model, &adapter_path("all12_r8")).expect("a"));
    for max_batch in [opts().max_batch, 1] {
        let mut s = Session::new(model.clone(), SessionOptions { max_batch, ..opts() }).expect("session");
        s.set_fused_decode(true);
        let token = |s: &mut Session| {
            s.reset();
            s.feed_all(&ids[..3]).expect("prefill");
            let before = model.ctx.counters();
            s.feed(&ids[3..4]).expect("decode");
            (model.ctx.counters() - before).dispatches
        };
        let base = token(&mut s);
        s.set_adapter(Some((a.clone(), 1.0))).expect("set");
        let with = token(&mut s);
        assert_eq!(
            with,
            base + 1,
            "max_batch {max_batch}: dispatches of a fused decode token: {base} without the adapter, {with} with it"
        );
    }
}

/// A prompt of 2 to 8 tokens folds each block's RMSNorm1p into the projections and the LoRA
/// shrinks that read it (the batched matvec's `NORM`), and runs 2 · layers + 1 dispatches fewer
/// than with the norms unfused. With an adapter on all 12 projections both match peft (the first
/// rows of the 11-token reference, the model being causal); without one they match each other.
#[test]
fn a_short_prompt_folds_its_norms_and_matches_peft() {
    let Some(ctx) = gpu().map(|_| Arc::new(qwen35_wgpu::GpuContext::new().expect("context"))) else {
        return;
    };
    // A context of its own: the shared one counts the work of tests running beside this one.
    let model = Arc::new(Model::load(ctx, &fixture_model("gva_tied_f32")).expect("model"));
    let r = Reference::load("adapters");
    let ids = r.ids("all12_r8.ids");
    let (_, want) = r.f32("all12_r8.s1.logits");
    let a = Arc::new(LoraAdapter::load(&model, &adapter_path("all12_r8")).expect("a"));
    let vocab = model.config.vocab_size;
    let norms = 2 * model.config.num_layers() as u64 + 1;
    let mut s = Session::new(model.clone(), opts()).expect("session");
    for adapter in [None, Some(a)] {
        let adapted = adapter.is_some();
        s.set_adapter(adapter.map(|a| (a, 1.0))).expect("set");
        for t in [2, 5, 8] {
            let mut run = |fused: bool| {
                s.reset();
                s.set_fused_decode(fused);
                let before = model.ctx.counters();
                let logits = s.feed_all(&ids[..t]).expect("prefill").data;
                (logits, (model.ctx.counters() - before).dispatches)
            };
            let (folded, fewer) = run(true);
            let (unfolded, more) = run(false);
            let what = format!("{t} tokens, adapter {adapted}");
            if adapted {
                check_logits(&format!("{what}, folded"), &folded, &want[..t * vocab], vocab);
                check_logits(&format!("{what}, unfolded"), &unfolded, &want[..t * vocab], vocab);
            } else {
                let (rel, _) = rel_and_max(&folded, &unfolded);
                assert!(rel <= PATHS_REL, "{what}: folded vs unfolded rel {rel:.3e}");
            }
            assert_eq!(more - fewer, norms, "{what}: dispatches {fewer} folded, {more} not");
        }
    }
}

/// A backend that keeps the trait's adapter defaults and "generates" fixed token ids (with the
/// demo model's tokenizer when it has one).
struct NoAdapters {
    tok: Option<Arc<TextTokenizer>>,
    ids: Vec<u32>,
}

impl LlmBackend for NoAdapters {
    fn backend_name(&self) -> &str {
        "no-adapters"
    }
    fn load_model(&mut self, _: &Path) -> Result<(), BackendError> {
        Ok(())
    }
    fn unload_model(&mut self) {}
    fn is_model_loaded(&self) -> bool {
        true
    }
    fn model_info(&self) -> Option<ModelInfo> {
        None
    }
    fn tokenizer(&self) -> Option<Arc<TextTokenizer>> {
        self.tok.clone()
    }
    fn generate_tokens(
        &mut self,
        _: &[u32],
        _: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, BackendError> {
        let mut out = Vec::new();
        for &id in &self.ids {
            out.push(id);
            if !on_token(id) {
                break;
            }
        }
        Ok(out)
    }
    fn embeddings_ids(&mut self, _: &[u32]) -> Result<Vec<f32>, BackendError> {
        Ok(Vec::new())
    }
}

#[test]
fn a_stream_the_caller_stopped_gets_no_more_text() {
    let tok = Arc::new(TextTokenizer::from_dir(&root().join("examples/assets/demo")).expect("the demo tokenizer"));
    let ids = tok.encode("The sky is blue today.").expect("encode");
    let mut b = NoAdapters { tok: Some(tok), ids };
    let params = GenerateParams { stop: vec!["###".into()], ..Default::default() };
    // Stop strings hold back their length - 1 bytes: a tail is pending when the caller stops.
    let mut calls = Vec::new();
    let text = b
        .generate_stream_ids(&[1], &params, &mut |d| {
            calls.push(d.to_string());
            false
        })
        .expect("generate");
    assert_eq!(calls.len(), 1, "called again after returning false: {calls:?}");
    assert!(text.starts_with(&calls[0]) && text.len() > calls[0].len(), "{text:?} vs {calls:?}");
    // Without a stop the whole text streams.
    let mut all = String::new();
    let text = b.generate_stream_ids(&[1], &GenerateParams::default(), &mut |d| {
        all.push_str(d);
        true
    });
    assert_eq!(text.expect("generate"), all);
    assert_eq!(all, "The sky is blue today.");
}

#[test]
fn default_adapter_methods_say_not_supported() {
    let mut b = NoAdapters { tok: None, ids: Vec::new() };
    let not_supported = |r: Result<(), BackendError>| {
        assert!(
            matches!(r, Err(BackendError::AdapterNotSupported { ref backend }) if backend == "no-adapters"),
            "{r:?}"
        );
    };
    not_supported(b.load_adapter(Path::new("x"), 1.0).map(|_| ()));
    not_supported(b.unload_adapter());
    not_supported(b.active_adapter().map(|_| ()));
    not_supported(b.preload_adapter(Path::new("x"), None).map(|_| ()));
    not_supported(b.activate_adapter("x", 1.0));
    not_supported(b.deactivate_adapter());
    not_supported(b.set_adapter_scale(2.0));
    not_supported(b.list_adapters().map(|_| ()));
    not_supported(b.remove_adapter("x"));
    let no_learning = |r: Result<(), BackendError>| {
        assert!(
            matches!(r, Err(BackendError::LearningNotSupported { ref backend }) if backend == "no-adapters"),
            "{r:?}"
        );
    };
    no_learning(b.create_trainable_adapter(&TrainSpec::default()).map(|_| ()));
    no_learning(b.import_trainable_adapter(Path::new("x")).map(|_| ()));
    no_learning(b.learn(&[], &LearnOptions::default()).map(|_| ()));
    no_learning(b.export_trainable_adapter(Path::new("x")));
}

#[test]
fn a_parsed_adapter_that_does_not_fit_the_model_is_refused_before_upload() {
    // ParsedAdapter's fields are public: one built by hand, or parsed for another config, is
    // checked against the model it is uploaded to (a rank-0 delta divided by zero in the upload,
    // a B of the wrong width was read past its end by the expand).
    let Some(model) = load_model("gva_tied_f32") else { return };
    let parsed = qwen35_wgpu::lora::peft::parse(&adapter_path("all12_r8"), &model.config).expect("parse");
    LoraAdapter::upload(&model, &parsed).expect("the parsed adapter uploads");
    let attn_layer = model.config.layer_types.iter().position(|t| format!("{t:?}") == "Full").expect("attention");
    let q = parsed.deltas.iter().position(|d| d.proj == Proj::QProj).expect("a q_proj delta");
    type Edit<'a> = (&'a str, &'a dyn Fn(&mut qwen35_wgpu::lora::ParsedAdapter));
    let edits: [Edit; 8] = [
        ("rank 0", &|p| (p.deltas[q].rank, p.deltas[q].a, p.deltas[q].b) = (0, vec![], vec![])),
        ("short B", &|p| _ = p.deltas[q].b.pop()),
        ("rank not A's", &|p| p.deltas[q].rank += 1),
        ("layer past the model", &|p| p.deltas[q].layer = 99),
        ("q_proj on a GDN layer", &|p| p.deltas[q].layer = (attn_layer + 1) % 4),
        ("NaN scaling", &|p| p.deltas[q].scaling = f32::NAN),
        ("infinite weight", &|p| p.deltas[q].a[5] = f32::INFINITY),
        ("twice", &|p| p.deltas.push(p.deltas[q].clone())),
    ];
    for (what, edit) in edits {
        let mut bad = parsed.clone();
        edit(&mut bad);
        let e = LoraAdapter::upload(&model, &bad).err().unwrap_or_else(|| panic!("{what}: uploaded"));
        let named = match &e {
            AdapterError::BadConfig { field, .. } => field.contains("q_proj"),
            AdapterError::LayerOutOfRange { layer: 99, .. } | AdapterError::WrongTarget { .. } => true,
            AdapterError::WeightTooLarge { key, index: 5, .. } => key.ends_with("q_proj.lora_A"),
            AdapterError::DuplicateModule { key, .. } => key.contains("q_proj"),
            _ => false,
        };
        assert!(named, "{what}: {e}");
    }
}

fn backend() -> Option<WgpuBackend> {
    let ctx = gpu()?;
    let mut b = WgpuBackend::with_context(ctx, opts());
    b.load_model(&fixture_model("gva_tied_f32")).expect("model");
    Some(b)
}

fn logits(b: &mut WgpuBackend, ids: &[u32]) -> Vec<f32> {
    let s = b.session().expect("session");
    s.reset();
    s.feed_all(ids).expect("forward").data
}

#[test]
fn backend_adapter_lifecycle() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapters").ids("all12_r8.ids");
    let base = logits(&mut b, &ids);
    assert!(b.active_adapter().expect("query").is_none());
    let a = b.load_adapter(&adapter_path("all12_r8"), 1.0).expect("load");
    let active = b.active_adapter().expect("query").expect("active");
    assert_eq!((active.id.as_str(), active.scale, active.info.ranks.as_slice()), (a.as_str(), 1.0, &[8][..]));
    let with_a = logits(&mut b, &ids);
    let p = b.preload_adapter(&adapter_path("patterns_r16"), Some("patterns")).expect("preload");
    assert_eq!(p, "patterns");
    assert_eq!(logits(&mut b, &ids), with_a, "preloading must not activate");
    assert_eq!(b.list_adapters().expect("list").len(), 2);
    b.activate_adapter("patterns", 0.5).expect("activate");
    b.set_adapter_scale(1.0).expect("scale");
    let with_p = logits(&mut b, &ids);
    assert_ne!(with_p, with_a);
    b.activate_adapter(&a, 1.0).expect("back to a");
    assert_eq!(logits(&mut b, &ids), with_a);
    b.deactivate_adapter().expect("deactivate");
    assert_eq!(logits(&mut b, &ids), base);
    b.activate_adapter(&a, 1.0).expect("a again");
    b.unload_adapter().expect("unload");
    assert_eq!(logits(&mut b, &ids), base);
    assert_eq!(b.list_adapters().expect("list").len(), 1, "unload removes the active adapter");
    assert!(matches!(b.activate_adapter(&a, 1.0), Err(BackendError::Adapter(AdapterError::UnknownId { .. }))));
    b.remove_adapter("patterns").expect("remove");
    assert!(b.list_adapters().expect("list").is_empty());
}

#[test]
fn switching_between_tokens_applies_from_the_next_token() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapters").ids("all12_r8.ids");
    b.preload_adapter(&adapter_path("all12_r8"), Some("a")).expect("a");
    let params = GenerateParams { max_tokens: 6, stop_at_eos: false, ..Default::default() };
    // With the run-ahead step the switch discards (the GPU default; CPU adapters run without).
    b.session().expect("session").set_run_ahead(true);
    let base = b.generate_ids(&ids, &params).expect("base");
    let mut n = 0;
    let switched = b
        .generate_tokens_with(&ids, &params, &mut |_, switch| {
            n += 1;
            if n == 3 {
                switch.activate("a", 1.0);
            }
            true
        })
        .expect("switched");
    assert_eq!(switched[..3], base[..3], "tokens before the switch come from the base model");
    assert_eq!(b.active_adapter().expect("q").map(|a| a.id), Some("a".to_string()));
    // The same continuation by hand: base model for the prompt and two tokens, then the adapter.
    let s = b.session().expect("session");
    s.set_adapter(None).expect("base");
    s.reset();
    s.feed(&ids).expect("prompt");
    s.feed(&base[..2]).expect("two base tokens");
    let adapter = Arc::new(LoraAdapter::load(s.model(), &adapter_path("all12_r8")).expect("a"));
    s.set_adapter(Some((adapter, 1.0))).expect("switch");
    let mut by_hand = base[..3].to_vec();
    let mut logits = s.feed(&base[2..3]).expect("third token under the adapter");
    while by_hand.len() < 6 {
        let next = qwen35_wgpu::runtime::argmax(logits.last().expect("a row"));
        by_hand.push(next);
        logits = s.feed(&[next]).expect("step");
    }
    assert_eq!(switched, by_hand);
}

/// Write a modified copy of `all12_r8`: `edit` gets the tensors and the config.
fn broken(
    tag: &str,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>, &mut serde_json::Value),
) -> PathBuf {
    let dir = scratch_copy(&adapter_path("all12_r8"), tag);
    let file = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Vec<_> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    let cfg_path = dir.join("adapter_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("cfg")).expect("json");
    edit(&mut tensors, &mut cfg);
    let views: std::collections::HashMap<String, safetensors::tensor::TensorView> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &file).expect("write");
    std::fs::write(&cfg_path, cfg.to_string()).expect("write cfg");
    dir
}

fn rename(t: &mut [(String, safetensors::Dtype, Vec<usize>, Vec<u8>)], from: &str, to: &str) {
    for e in t.iter_mut() {
        e.0 = e.0.replace(from, to);
    }
}

#[test]
fn every_failed_load_leaves_the_state_unchanged() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapters").ids("all12_r8.ids");
    let active = b.load_adapter(&adapter_path("gdn_mlp_r4_rslora"), 0.5).expect("load");
    let before = logits(&mut b, &ids);
    let q_a = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight";
    type Case = (&'static str, PathBuf, fn(&AdapterError) -> bool);
    let cases: Vec<Case> = vec![
        ("missing", root().join("tests/fixtures/adapters/nope"), |e| matches!(e, AdapterError::Io { .. })),
        ("not peft", fixture_model("gva_tied_f32"), |e| matches!(e, AdapterError::NotPeft { .. })),
        (
            "truncated",
            {
                let d = scratch_copy(&adapter_path("all12_r8"), "trunc");
                let f = d.join("adapter_model.safetensors");
                let bytes = std::fs::read(&f).expect("read");
                std::fs::write(&f, &bytes[..bytes.len() - 100]).expect("truncate");
                d
            },
            |e| matches!(e, AdapterError::BadSafetensors { .. }),
        ),
        ("rank", broken("rank", |_, c| c["r"] = 4.into()), |e| {
            matches!(e, AdapterError::RankMismatch { expected: 4, found: 8, .. })
        }),
        (
            "shape",
            broken("shape", |t, _| {
                let e = t.iter_mut().find(|e| e.0 == q_a).expect("q A");
                e.2 = vec![4, 128];
            }),
            |e| matches!(e, AdapterError::ShapeMismatch { .. }),
        ),
        ("layer", broken("layer", |t, _| rename(t, "layers.7.", "layers.9.")), |e| {
            matches!(e, AdapterError::LayerOutOfRange { layer: 9, layers: 8, .. })
        }),
        (
            "wrong target",
            broken("target", |t, _| rename(t, "layers.3.self_attn.q_proj", "layers.2.self_attn.q_proj")),
            |e| matches!(e, AdapterError::WrongTarget { layer: 2, .. }),
        ),
        (
            "unknown module",
            broken("unknown", |t, _| rename(t, "linear_attn.in_proj_qkv", "linear_attn.in_proj_qkvz")),
            |e| matches!(e, AdapterError::UnknownKey { .. }),
        ),
        ("untargeted", broken("untargeted", |_, c| c["layers_to_transform"] = serde_json::json!([0, 1])), |e| {
            matches!(e, AdapterError::NotTargeted { .. })
        }),
        (
            "nan",
            broken("nan", |t, _| {
                let e = t.iter_mut().find(|e| e.0 == q_a).expect("q A");
                e.3[0..4].copy_from_slice(&f32::NAN.to_le_bytes());
            }),
            |e| matches!(e, AdapterError::NonFinite { index: 0, .. }),
        ),
        ("dora", broken("dora", |_, c| c["use_dora"] = true.into()), |e| matches!(e, AdapterError::Unsupported { .. })),
        (
            "dora key",
            broken("dorakey", |t, _| {
                t.push((
                    "base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector".into(),
                    safetensors::Dtype::F32,
                    vec![1],
                    vec![0; 4],
                ))
            }),
            |e| matches!(e, AdapterError::Unsupported { .. }),
        ),
        (
            "lora bias",
            broken("bias", |t, _| {
                t.push((
                    "base_model.model.model.layers.0.mlp.up_proj.lora_B.bias".into(),
                    safetensors::Dtype::F32,
                    vec![1],
                    vec![0; 4],
                ))
            }),
            |e| matches!(e, AdapterError::Unsupported { .. }),
        ),
        (
            "embedding",
            broken("embed", |t, _| {
                t.push((
                    "base_model.model.model.embed_tokens.lora_embedding_A".into(),
                    safetensors::Dtype::F32,
                    vec![1],
                    vec![0; 4],
                ))
            }),
            |e| matches!(e, AdapterError::Unsupported { .. }),
        ),
        ("modules_to_save", broken("mts", |_, c| c["modules_to_save"] = serde_json::json!(["lm_head"])), |e| {
            matches!(e, AdapterError::Unsupported { .. })
        }),
        ("unpaired", broken("pair", |t, _| t.retain(|e| e.0 != q_a)), |e| {
            matches!(e, AdapterError::MissingPair { .. })
        }),
        ("other model", adapter_path("odd_r4"), |e| {
            matches!(
                e,
                AdapterError::ShapeMismatch { .. }
                    | AdapterError::WrongTarget { .. }
                    | AdapterError::LayerOutOfRange { .. }
            )
        }),
        (
            "dtype",
            broken("dtype", |t, _| {
                let e = t.iter_mut().find(|e| e.0 == q_a).expect("q A");
                e.1 = safetensors::Dtype::I32;
            }),
            |e| matches!(e, AdapterError::UnsupportedDtype { .. }),
        ),
    ];
    for (what, path, expected) in cases {
        for result in [b.load_adapter(&path, 1.0).map(|_| ()), b.preload_adapter(&path, None).map(|_| ())] {
            match result {
                Err(BackendError::Adapter(e)) => assert!(expected(&e), "{what}: unexpected error {e}"),
                other => panic!("{what}: expected an adapter error, got {other:?}"),
            }
        }
        let now = b.active_adapter().expect("q").expect("still active");
        assert_eq!((now.id.as_str(), now.scale), (active.as_str(), 0.5), "{what}: active adapter changed");
        assert_eq!(b.list_adapters().expect("list").len(), 1, "{what}: resident set changed");
        assert_eq!(logits(&mut b, &ids), before, "{what}: logits changed");
    }
    assert!(matches!(b.activate_adapter(&active, f32::NAN), Err(BackendError::Adapter(AdapterError::BadScale(_)))));
    assert_eq!(logits(&mut b, &ids), before);
}

#[test]
fn absurd_scales_are_refused_everywhere_and_change_nothing() {
    let Some(mut b) = backend() else { return };
    let r = Reference::load("adapters");
    let ids = r.ids("all12_r8.ids");
    let id = b.load_adapter(&adapter_path("all12_r8"), 1.0).expect("load");
    let before = logits(&mut b, &ids);
    let refused = |res: Result<(), BackendError>, what: &str| {
        assert!(matches!(res, Err(BackendError::Adapter(AdapterError::BadScale(_)))), "{what}: {res:?}");
    };
    for scale in [1e30f32, -1e30, 1e4, f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        refused(b.set_adapter_scale(scale), &format!("set_adapter_scale({scale})"));
        refused(b.activate_adapter(&id, scale), &format!("activate_adapter({scale})"));
        refused(b.load_adapter(&adapter_path("patterns_r16"), scale).map(|_| ()), &format!("load_adapter({scale})"));
        assert_eq!(b.list_adapters().expect("list").len(), 1, "{scale}: a refused load must not stay resident");
        let now = b.active_adapter().expect("query").expect("active");
        assert_eq!((now.id.as_str(), now.scale), (id.as_str(), 1.0), "{scale}");
        assert_eq!(logits(&mut b, &ids), before, "{scale}: logits changed");
    }
    // set_adapter_scale takes effect: alpha 16 at r 8 with scale 2 is peft's s2 reference.
    b.set_adapter_scale(2.0).expect("scale 2");
    let (_, want) = r.f32("all12_r8.s2.logits");
    check_logits("set_adapter_scale(2)", &logits(&mut b, &ids), &want, 256);
    b.set_adapter_scale(qwen35_wgpu::lora::MAX_SCALE).expect("the bound itself is accepted");
}

#[test]
fn empty_adapter_ids_are_refused() {
    let Some(mut b) = backend() else { return };
    for id in ["", "  "] {
        let res = b.preload_adapter(&adapter_path("all12_r8"), Some(id));
        assert!(matches!(res, Err(BackendError::Adapter(AdapterError::BadId { .. }))), "{id:?}: {res:?}");
        let spec = TrainSpec { id: Some(id.into()), ..Default::default() };
        assert!(b.create_trainable_adapter(&spec).is_err(), "trainable id {id:?}");
    }
    assert!(b.list_adapters().expect("list").is_empty());
}

#[test]
fn trainable_adapters_with_absurd_ranks_or_repeated_layers_are_typed_errors() {
    let Some(mut b) = backend() else { return };
    for spec in [
        TrainSpec { rank: usize::MAX, ..Default::default() },
        TrainSpec { rank: 1 << 40, ..Default::default() },
        TrainSpec { layers: Some(vec![7, 7]), ..Default::default() },
    ] {
        let res = b.create_trainable_adapter(&spec);
        assert!(matches!(res, Err(BackendError::Learn(LearnError::BadInput { .. }))), "{spec:?}: {res:?}");
    }
    assert!(b.list_adapters().expect("list").is_empty());
}

#[test]
fn an_adapter_of_a_dropped_model_is_refused_by_a_new_model() {
    let Some(ctx) = gpu() else { return };
    let load = || Model::load(ctx.clone(), &fixture_model("gva_tied_f32")).expect("model");
    let old = Arc::new(load());
    let old_address = Arc::as_ptr(&old) as usize;
    let stale = Arc::new(LoraAdapter::load(&old, &adapter_path("all12_r8")).expect("adapter"));
    // Load the next model while the old one lives, drop the old one, and only then allocate the
    // next one's Arc: the allocator hands back the block just freed (same size), so comparing
    // addresses alone took the stale adapter for the new model's.
    let next = load();
    drop(old);
    let model = Arc::new(next);
    eprintln!("new model at the dropped model's address: {}", Arc::as_ptr(&model) as usize == old_address);
    assert!(!stale.is_for(&model));
    let mut s = Session::new(model, opts()).expect("session");
    let res = s.set_adapter(Some((stale.clone(), 1.0)));
    assert!(matches!(res, Err(AdapterError::WrongModel { .. })), "{res:?}");
}

#[test]
fn set_adapter_scale_changes_the_logits_as_peft_scales_them() {
    let Some(mut b) = backend() else { return };
    let r = Reference::load("adapters");
    let ids = r.ids("all12_r8.ids");
    let vocab = b.model_info().expect("model").config.vocab_size;
    let base = logits(&mut b, &ids);
    let id = b.load_adapter(&adapter_path("all12_r8"), 1.0).expect("load");
    // Every scale the reference has, reached by rescaling the active adapter (never by loading).
    for scale in [0.5, 2.0, -1.0, 1.0] {
        b.set_adapter_scale(scale).expect("scale");
        let active = b.active_adapter().expect("query").expect("active");
        assert_eq!((active.id.as_str(), active.scale), (id.as_str(), scale));
        let key = format!("all12_r8.s{scale}");
        check_logits(&key, &logits(&mut b, &ids), &r.f32(&format!("{key}.logits")).1, vocab);
        let want = r.ids(&format!("{key}.generated"));
        let params = GenerateParams { max_tokens: want.len(), stop_at_eos: false, ..Default::default() };
        assert_eq!(b.generate_ids(&ids, &params).expect("generate"), want, "{key}: greedy after set_adapter_scale");
    }
    // Scale 0 runs the LoRA pipelines, whose expand then adds exact zeros to the base products.
    b.set_adapter_scale(0.0).expect("scale 0");
    let zero = logits(&mut b, &ids);
    assert_eq!(zero, base, "scale 0 must give the base model's logits bit for bit");
    // A refused scale changes nothing; without an active adapter there is nothing to scale.
    for bad in [f32::NAN, f32::INFINITY] {
        assert!(matches!(b.set_adapter_scale(bad), Err(BackendError::Adapter(AdapterError::BadScale(_)))), "{bad}");
        assert_eq!(b.active_adapter().expect("query").map(|a| a.scale), Some(0.0), "{bad}");
    }
    b.deactivate_adapter().expect("deactivate");
    assert!(matches!(b.set_adapter_scale(1.0), Err(BackendError::Adapter(_))));
    assert_eq!(logits(&mut b, &ids), base);
}
