//! On-GPU learning against the oracle: LoRA gradients vs PyTorch autograd through transformers +
//! peft, steps that change generation, export/import round trips and failure semantics.

mod common;

use std::path::PathBuf;

use common::tolerance::{CE_MOVE_NATS, DRIFT_NATS, GRAD_NORM_REL, GRAD_REL, LEARN_EFFECT_REL, ORACLE_GRAD_NORM_MIN};
use common::{fixture_model, gpu, rel_and_max, root, Reference};
use qwen35_wgpu::learn::{ModuleGrad, MAX_LR, MAX_TRAIN_RANK};
use qwen35_wgpu::{
    BackendError, LearnError, LearnOptions, LlmBackend, LoadOptions, Proj, SessionOptions, Signal, TokenEvent,
    TrainSpec, WgpuBackend,
};

fn backend(model: &str) -> Option<WgpuBackend> {
    backend_with(model, &LoadOptions::default())
}

fn backend_with(model: &str, load: &LoadOptions) -> Option<WgpuBackend> {
    let ctx = gpu()?;
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 64, max_batch: 16 });
    b.load_model_with(&fixture_model(model), load).expect("model");
    Some(b)
}

fn events(r: &Reference, case: &str, reward: bool) -> Vec<TokenEvent> {
    let (_, scores) = r.f32(&format!("{case}.scores"));
    (0..scores.len())
        .map(|i| TokenEvent {
            prompt: r.ids(&format!("{case}.e{i}.prompt")),
            response: r.ids(&format!("{case}.e{i}.response")),
            signal: if reward { Signal::Score(scores[i]) } else { Signal::Preferred },
        })
        .collect()
}

fn module_key(g: &ModuleGrad) -> String {
    format!("layers.{}.{}", g.layer, g.proj.path())
}

#[test]
fn lora_gradients_match_pytorch_autograd() {
    // The third case splits every weight over bindings of 1,000 bytes, so lm_head, o_proj and the
    // MLP reach the backward kernels as many chunks. The last one learns on a 4-bit base (the
    // backward's dx = dy·W reads the quantized weights) against autograd on the same weights
    // dequantized in f32.
    let split = LoadOptions { max_chunk_bytes: 1000, ..Default::default() };
    let cases = [
        ("learn", "gva_last", "gva_tied_f32", LoadOptions::default()),
        ("learn", "vlm_last", "vlm_bf16_sharded", LoadOptions::default()),
        ("learn", "gva_last", "gva_tied_f32", split),
        ("learn_q4", "q4_last", "mlx_q4_g64", LoadOptions::default()),
    ];
    for (reference, case, model, load) in cases {
        let r = Reference::load(reference);
        let Some(mut b) = backend_with(model, &load) else { return };
        b.import_trainable_adapter(&root().join("tests/fixtures/learn").join(case)).expect("import");
        for (loss, reward) in [("supervised", false), ("reward", true)] {
            let grads = b.learn_gradients(&events(&r, case, reward)).expect("gradients");
            assert_eq!(grads.len(), 7, "{case}: q/k/v/o/gate/up/down");
            for g in &grads {
                for (which, ours) in [("lora_A", &g.a), ("lora_B", &g.b)] {
                    let key = format!("{case}.{loss}.{}.{which}", module_key(g));
                    let (_, want) = r.f32(&key);
                    let (rel, _) = rel_and_max(ours, &want);
                    let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt();
                    assert!(
                        norm > ORACLE_GRAD_NORM_MIN,
                        "{key}: the oracle's gradient is ~0, the check would be empty"
                    );
                    assert!(rel <= GRAD_REL, "{key}: rel {rel:.3e} (≤ {GRAD_REL})");
                }
            }
        }
    }
}

fn logits(b: &mut WgpuBackend, ids: &[u32]) -> Vec<f32> {
    let s = b.session().expect("session");
    s.reset();
    let out = s.feed_all(ids).expect("feed").data;
    s.reset();
    out
}

fn supervised(prompt: &[u32], response: &[u32]) -> TokenEvent {
    TokenEvent { prompt: prompt.to_vec(), response: response.to_vec(), signal: Signal::Preferred }
}

#[test]
fn a_step_changes_the_live_adapter_and_the_export_loads_back_bit_identical() {
    let Some(mut b) = backend("gva_tied_f32") else { return };
    let ids = [3u32, 17, 42, 99, 7, 150, 8];
    let base = logits(&mut b, &ids);
    let id = b.create_trainable_adapter(&TrainSpec::default()).expect("create");
    assert_eq!(b.active_adapter().expect("active").map(|a| a.id), Some(id));
    assert_eq!(logits(&mut b, &ids), base, "B = 0: a new adapter starts as the base model");
    let opts = LearnOptions { lr: 1e-2, ..Default::default() };
    for _ in 0..3 {
        b.learn_tokens(&[supervised(&ids[..4], &ids[4..])], &opts).expect("step");
    }
    let live = logits(&mut b, &ids);
    let (rel, _) = rel_and_max(&live, &base);
    assert!(rel > LEARN_EFFECT_REL, "three steps at lr 1e-2 must change the logits (rel {rel:.2e})");
    let dir = std::env::temp_dir().join(format!("qwen35-learn-export-{}", std::process::id()));
    b.export_trainable_adapter(&dir).expect("export");
    let mut fresh = backend("gva_tied_f32").expect("backend");
    fresh.load_adapter(&dir, 1.0).expect("load the export");
    assert_eq!(logits(&mut fresh, &ids), live, "exported adapter = live adapter, bit for bit");
    fresh.import_trainable_adapter(&dir).expect("import to continue");
    fresh.learn_tokens(&[supervised(&ids[..4], &ids[4..])], &opts).expect("continue training");
    assert_ne!(logits(&mut fresh, &ids), live, "a step after import changes the adapter");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_step_uploads_no_weights() {
    // What a step writes from the host (token ids, row coefficients, dispatch uniforms) does not
    // depend on the adapter's size: the weights are updated on the GPU, never uploaded. A context
    // of its own, so that other tests' uploads are not counted.
    if gpu().is_none() {
        return;
    }
    let ctx = std::sync::Arc::new(qwen35_wgpu::GpuContext::new().expect("second context"));
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 64, max_batch: 16 });
    b.load_model(&fixture_model("gva_tied_f32")).expect("model");
    let mut per_step = Vec::new();
    for rank in [2, 32] {
        b.create_trainable_adapter(&TrainSpec { rank, ..Default::default() }).expect("create");
        let event = [supervised(&[5, 6, 7], &[8, 9])];
        b.learn_tokens(&event, &LearnOptions::default()).expect("warm-up step");
        let before = b.context().bytes_uploaded();
        b.learn_tokens(&event, &LearnOptions::default()).expect("step");
        per_step.push(b.context().bytes_uploaded() - before);
    }
    assert_eq!(per_step[0], per_step[1], "bytes uploaded per step at rank 2 and rank 32");
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let Some(mut b) = backend("gva_tied_f32") else { return };
    b.create_trainable_adapter(&TrainSpec::default()).expect("create");
    let opts = LearnOptions { lr: 1e-2, ..Default::default() };
    b.learn_tokens(&[supervised(&[1, 2, 3], &[4, 5])], &opts).expect("step");
    let ids = [3u32, 17, 42, 99];
    let before = logits(&mut b, &ids);
    let vocab = 256;
    let cases: Vec<(Vec<TokenEvent>, LearnOptions, &str)> = vec![
        (vec![supervised(&[1, 2], &[])], opts.clone(), "events[0].response"),
        (vec![supervised(&[], &[1])], opts.clone(), "events[0].prompt"),
        (vec![supervised(&[1, 2], &[3, vocab])], opts.clone(), "events[0].response[1]"),
        (
            vec![TokenEvent { prompt: vec![1], response: vec![2], signal: Signal::Score(f32::NAN) }],
            opts.clone(),
            "events[0].score",
        ),
        (vec![supervised(&[1], &[2])], LearnOptions { lr: 0.0, ..opts.clone() }, "lr"),
        (vec![supervised(&[1], &[2])], LearnOptions { lr: -1e-3, ..opts.clone() }, "lr"),
        (vec![supervised(&[1; 10], &[2; 10])], opts.clone(), "events[0]"),
        (vec![], opts.clone(), "events"),
    ];
    for (events, o, field) in cases {
        match b.learn_tokens(&events, &o) {
            Err(BackendError::Learn(LearnError::BadInput { name, .. })) => assert_eq!(name, field),
            other => panic!("{field}: expected a BadInput error, got {other:?}"),
        }
        assert_eq!(b.learn_steps(), Some(1), "{field}: no step taken");
        assert_eq!(logits(&mut b, &ids), before, "{field}: the adapter changed");
    }
}

#[test]
fn targets_the_backward_cannot_reach_are_typed_errors() {
    let Some(mut b) = backend("gva_tied_f32") else { return };
    for spec in [
        TrainSpec { targets: vec![Proj::OutProj], ..Default::default() },
        TrainSpec { layers: Some(vec![3]), ..Default::default() },
        TrainSpec { targets: vec![Proj::InProjQkv], ..Default::default() },
    ] {
        match b.create_trainable_adapter(&spec) {
            Err(BackendError::Learn(LearnError::NotLearnable { .. })) => {}
            other => panic!("{spec:?}: expected NotLearnable, got {other:?}"),
        }
    }
    assert!(b.list_adapters().expect("list").is_empty(), "a refused spec leaves nothing resident");
    let all12: PathBuf = root().join("tests/fixtures/adapters/all12_r8");
    assert!(matches!(b.import_trainable_adapter(&all12), Err(BackendError::Learn(LearnError::NotLearnable { .. }))));
    assert!(matches!(
        b.learn_tokens(&[supervised(&[1], &[2])], &LearnOptions::default()),
        Err(BackendError::Learn(LearnError::NoTrainableAdapter))
    ));
}

#[test]
fn hostile_train_specs_and_options_are_refused_at_create_time() {
    let Some(mut b) = backend("gva_tied_f32") else { return };
    let last = b.model_info().expect("model").config.num_layers() - 1;
    let refused = |b: &mut WgpuBackend, spec: TrainSpec, field: &str| match b.create_trainable_adapter(&spec) {
        Err(BackendError::Learn(LearnError::BadInput { name, .. })) => assert_eq!(name, field, "{spec:?}"),
        other => panic!("{spec:?}: expected a BadInput on {field}, got {other:?}"),
    };
    // [last, last] was accepted and export then panicked inside safetensors (duplicate keys).
    refused(&mut b, TrainSpec { layers: Some(vec![last, last]), ..Default::default() }, "layers");
    refused(&mut b, TrainSpec { layers: Some(vec![]), ..Default::default() }, "layers");
    refused(&mut b, TrainSpec { layers: Some(vec![last, 10_000]), ..Default::default() }, "layers[1]");
    refused(&mut b, TrainSpec { layers: Some(vec![usize::MAX]), ..Default::default() }, "layers[0]");
    // Rank 2^40 aborted on allocation, usize::MAX overflowed.
    for rank in [1usize << 40, usize::MAX, MAX_TRAIN_RANK + 1, 0] {
        refused(&mut b, TrainSpec { rank, ..Default::default() }, "rank");
    }
    // alpha / rank past the kernels' scaling bound is refused by the field the caller wrote.
    refused(&mut b, TrainSpec { rank: 1, alpha: 2000.0, ..Default::default() }, "alpha");
    assert!(b.list_adapters().expect("list").is_empty(), "a refused spec leaves nothing resident");

    b.create_trainable_adapter(&TrainSpec::default()).expect("create");
    let ids = [3u32, 17, 42, 99];
    let before = logits(&mut b, &ids);
    let event = [supervised(&[1, 2, 3], &[4, 5])];
    let opts = LearnOptions::default();
    let bad_opts = [
        (LearnOptions { lr: 1e30, ..opts.clone() }, "lr"),
        (LearnOptions { lr: f32::INFINITY, ..opts.clone() }, "lr"),
        (LearnOptions { lr: f32::NAN, ..opts.clone() }, "lr"),
        (LearnOptions { lr: MAX_LR * 2.0, ..opts.clone() }, "lr"),
        (LearnOptions { weight_decay: 1e30, ..opts.clone() }, "weight_decay"),
        (LearnOptions { anchor_l2: f32::INFINITY, ..opts.clone() }, "anchor_l2"),
        (LearnOptions { eps: f32::NAN, ..opts.clone() }, "eps"),
    ];
    for (o, field) in bad_opts {
        match b.learn_tokens(&event, &o) {
            Err(BackendError::Learn(LearnError::BadInput { name, .. })) => assert_eq!(name, field),
            other => panic!("{field}: expected a BadInput error, got {other:?}"),
        }
    }
    assert_eq!(b.learn_steps(), Some(0), "no step taken");
    assert_eq!(logits(&mut b, &ids), before, "the adapter is unchanged");
    let dir = std::env::temp_dir().join(format!("qwen35-learn-hostile-{}", std::process::id()));
    b.export_trainable_adapter(&dir).expect("export");
    std::fs::remove_dir_all(&dir).ok();
}

fn demo() -> Option<WgpuBackend> {
    let ctx = gpu()?;
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 96, max_batch: 48 });
    b.load_model(&root().join("examples/assets/demo")).expect("demo model");
    Some(b)
}

fn greedy(b: &mut WgpuBackend, question: &str) -> String {
    let params = qwen35_wgpu::GenerateParams { max_tokens: 24, ..Default::default() };
    let request = qwen35_wgpu::ChatRequest::new(vec![qwen35_wgpu::ChatMessage::new("user", question)]);
    b.chat(&request, &params, &mut |_| true).expect("chat").text
}

/// Mean cross-entropy of `ev.response` given `ev.prompt`, from the engine's forward logits
/// (independent of the learning code).
fn response_ce(b: &mut WgpuBackend, ev: &TokenEvent) -> f32 {
    let ids: Vec<u32> = ev.prompt.iter().chain(&ev.response).copied().collect();
    let all = logits(b, &ids);
    let vocab = all.len() / ids.len();
    let rows = all.chunks(vocab).skip(ev.prompt.len() - 1);
    let ce: f32 = rows
        .zip(&ev.response)
        .map(|(row, &t)| {
            let max = row.iter().fold(f32::MIN, |m, &v| m.max(v));
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
            lse - row[t as usize]
        })
        .sum();
    ce / ev.response.len() as f32
}

const QUESTION: &str = "What color is the sky?";
const TAUGHT: &str = "The sky is green.";
const OTHERS: [&str; 3] = ["Where is the cat?", "What is the apple?", "What color is the bike?"];

#[test]
fn supervised_feedback_changes_the_greedy_answer_and_little_else() {
    let Some(mut b) = demo() else { return };
    assert_eq!(greedy(&mut b, QUESTION), "The sky is blue.", "the demo model's base answer");
    let before: Vec<String> = OTHERS.iter().map(|q| greedy(&mut b, q)).collect();
    let others: Vec<TokenEvent> = OTHERS
        .iter()
        .zip(&before)
        .map(|(q, a)| {
            let ev =
                qwen35_wgpu::FeedbackEvent { prompt: q.to_string(), response: a.clone(), signal: Signal::Preferred };
            b.tokenize_events(&[ev]).expect("tokenize").remove(0)
        })
        .collect();
    let ce_before: Vec<f32> = others.iter().map(|e| response_ce(&mut b, e)).collect();
    b.create_trainable_adapter(&TrainSpec::default()).expect("create");
    let event =
        qwen35_wgpu::FeedbackEvent { prompt: QUESTION.into(), response: TAUGHT.into(), signal: Signal::Preferred };
    let opts = LearnOptions { lr: 3e-3, ..Default::default() };
    let mut steps = 0;
    while greedy(&mut b, QUESTION) != TAUGHT {
        steps += 1;
        assert!(steps <= 40, "40 steps did not teach the answer (now {:?})", greedy(&mut b, QUESTION));
        b.learn(std::slice::from_ref(&event), &opts).expect("step");
    }
    eprintln!("taught {TAUGHT:?} in {steps} supervised steps");
    for (ev, ce0) in others.iter().zip(&ce_before) {
        let drift = response_ce(&mut b, ev) - ce0;
        eprintln!("untrained prompt: CE of its base answer {ce0:.4} → {:.4}", ce0 + drift);
        assert!(drift <= DRIFT_NATS, "an untrained prompt's answer drifted by {drift:.3} nats/token (≤ {DRIFT_NATS})");
    }
}

#[test]
fn a_low_score_lowers_and_a_high_score_raises_the_likelihood() {
    let Some(mut b) = demo() else { return };
    let ev = |score: f32| qwen35_wgpu::FeedbackEvent {
        prompt: QUESTION.into(),
        response: TAUGHT.into(),
        signal: Signal::Score(score),
    };
    let opts = LearnOptions { lr: 3e-3, ..Default::default() };
    for (score, sign) in [(0.0f32, 1.0f32), (1.0, -1.0)] {
        b.create_trainable_adapter(&TrainSpec::default()).expect("create");
        let tokens = b.tokenize_events(&[ev(score)]).expect("tokenize").remove(0);
        let ce0 = response_ce(&mut b, &tokens);
        for _ in 0..3 {
            b.learn(&[ev(score)], &opts).expect("step");
        }
        let ce1 = response_ce(&mut b, &tokens);
        eprintln!("score {score}: response CE {ce0:.4} → {ce1:.4} nats/token after 3 steps");
        assert!(
            sign * (ce1 - ce0) > CE_MOVE_NATS,
            "score {score}: CE {ce0:.4} → {ce1:.4} (log-likelihood must move the other way)"
        );
    }
}

fn read_tensors(path: &std::path::Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).expect("adapter file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors().into_iter().map(|(k, v)| (k, (v.shape().to_vec(), v.data().to_vec()))).collect()
}

#[test]
fn export_writes_what_peft_itself_saves() {
    // Adapters peft saved (tests/fixtures/learn/gva_last on the text class, vlm_last on the VLM
    // class, whose keys hold `model.language_model.`), imported and exported without a step: the
    // same keys, shapes and f32 bytes, and a config that means the same, so whatever loads peft's
    // own file loads ours.
    for (case, model) in [("gva_last", "gva_tied_f32"), ("vlm_last", "vlm_bf16_sharded")] {
        let Some(mut b) = backend(model) else { return };
        let src = root().join("tests/fixtures/learn").join(case);
        b.import_trainable_adapter(&src).expect("import");
        let dir = std::env::temp_dir().join(format!("qwen35-learn-peft-{case}-{}", std::process::id()));
        b.export_trainable_adapter(&dir).expect("export");
        let ours = read_tensors(&dir.join("adapter_model.safetensors"));
        let theirs = read_tensors(&src.join("adapter_model.safetensors"));
        assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>(), "{case}: tensor keys");
        assert!(ours == theirs, "{case}: tensor shapes and bytes");
        let json = |p: PathBuf| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p).expect("config")).expect("json")
        };
        let (o, t) = (json(dir.join("adapter_config.json")), json(src.join("adapter_config.json")));
        for field in ["peft_type", "r", "layers_to_transform", "use_rslora", "use_dora"] {
            assert_eq!(o[field], t[field], "{case}: {field}");
        }
        assert_eq!(o["lora_alpha"].as_f64(), t["lora_alpha"].as_f64(), "{case}: lora_alpha");
        // Pattern maps: ours names each module in full where peft may have written a suffix; the
        // same values, each key of one a `.`-suffix (or the whole) of a key of the other.
        for field in ["rank_pattern", "alpha_pattern"] {
            let map = |v: &serde_json::Value| -> Vec<(String, f64)> {
                v.as_object().expect("map").iter().map(|(k, x)| (k.clone(), x.as_f64().expect("number"))).collect()
            };
            let (ours, theirs) = (map(&o[field]), map(&t[field]));
            let suffix = |full: &str, key: &str| full == key || full.ends_with(&format!(".{key}"));
            for (k, v) in &ours {
                assert!(theirs.iter().any(|(tk, tv)| suffix(k, tk) && tv == v), "{case}: {field} {k}: {v}");
            }
            for (tk, tv) in &theirs {
                assert!(ours.iter().any(|(k, v)| suffix(k, tk) && tv == v), "{case}: {field} {tk}: {tv}");
            }
        }
        // Each module's rank and scaling as peft's rules give them (`rank_pattern` may name a
        // module by its full name where peft wrote a suffix).
        let config = b.model_info().expect("model").config.clone();
        let per_module = |dir: &std::path::Path| {
            let parsed = qwen35_wgpu::lora::peft::parse(dir, &config).expect("parse");
            let mut m: Vec<_> = parsed.deltas.iter().map(|d| (d.layer, d.proj, d.rank, d.scaling)).collect();
            m.sort_by_key(|&(layer, proj, ..)| (layer, proj.path()));
            m
        };
        assert_eq!(per_module(&dir), per_module(&src), "{case}: rank and scaling per module");
        let names = |v: &serde_json::Value| {
            let mut n: Vec<String> =
                v.as_array().expect("list").iter().map(|x| x.as_str().unwrap_or("").into()).collect();
            n.sort();
            n
        };
        assert_eq!(names(&o["target_modules"]), names(&t["target_modules"]), "{case}: target_modules");
        std::fs::remove_dir_all(&dir).ok();
    }
    let Some(mut b) = backend("gva_tied_f32") else { return };
    b.import_trainable_adapter(&root().join("tests/fixtures/learn/gva_last")).expect("import");
    let dir = std::env::temp_dir().join(format!("qwen35-learn-peft-{}", std::process::id()));
    b.export_trainable_adapter(&dir).expect("export");
    // A failed export (the weights' temporary name taken by a directory) writes no file: no
    // config without its weights, no temporary left.
    let failed = std::env::temp_dir().join(format!("qwen35-learn-peft-failed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&failed);
    std::fs::create_dir_all(failed.join("adapter_model.safetensors.tmp")).expect("blocker");
    assert!(b.export_trainable_adapter(&failed).is_err(), "the weights cannot be written");
    let files: Vec<PathBuf> =
        std::fs::read_dir(&failed).expect("dir").map(|e| e.expect("entry").path()).filter(|p| p.is_file()).collect();
    assert!(files.is_empty(), "a failed export wrote {files:?}");
    std::fs::remove_dir_all(&failed).ok();
    // An export whose config cannot be moved into place (a directory holds its name) puts the
    // earlier weights back: never new weights beside another config, no temporary left.
    let weights = dir.join("adapter_model.safetensors");
    std::fs::write(&weights, b"earlier").expect("sentinel");
    std::fs::remove_file(dir.join("adapter_config.json")).expect("rm config");
    std::fs::create_dir_all(dir.join("adapter_config.json/blocker")).expect("blocker");
    assert!(b.export_trainable_adapter(&dir).is_err(), "the config cannot be moved into place");
    assert!(std::fs::read(&weights).expect("weights") == b"earlier", "the earlier weights are back");
    let mut left: Vec<String> =
        std::fs::read_dir(&dir).expect("dir").map(|e| e.expect("entry").file_name().to_string_lossy().into()).collect();
    left.sort();
    assert_eq!(left, ["adapter_config.json", "adapter_model.safetensors"], "nothing else left");
    std::fs::remove_dir_all(&dir).ok();
}

/// The adapter's weights per module key, read from an export.
fn exported_weights(b: &mut WgpuBackend, tag: &str) -> std::collections::BTreeMap<String, Vec<f32>> {
    let dir = std::env::temp_dir().join(format!("qwen35-learn-{tag}-{}", std::process::id()));
    b.export_trainable_adapter(&dir).expect("export");
    let out = read_tensors(&dir.join("adapter_model.safetensors"))
        .into_iter()
        .map(|(k, (_, bytes))| {
            (k, bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        })
        .collect();
    std::fs::remove_dir_all(&dir).ok();
    out
}

fn grads_by_key(grads: &[ModuleGrad]) -> std::collections::BTreeMap<String, Vec<f32>> {
    let mut out = std::collections::BTreeMap::new();
    for g in grads {
        let key = format!("base_model.model.model.{}", module_key(g));
        out.insert(format!("{key}.lora_A.weight"), g.a.clone());
        out.insert(format!("{key}.lora_B.weight"), g.b.clone());
    }
    out
}

#[test]
fn adamw_with_clipping_and_anchor_matches_a_cpu_reference() {
    use common::tolerance::OPTIM_ABS;
    let Some(mut b) = backend("gva_tied_f32") else { return };
    b.import_trainable_adapter(&root().join("tests/fixtures/learn/gva_last")).expect("import");
    let events = events(&Reference::load("learn"), "gva_last", false);
    let opts = LearnOptions {
        lr: 1e-2,
        beta1: 0.8,
        beta2: 0.95,
        eps: 1e-6,
        weight_decay: 0.1,
        max_grad_norm: 0.05,
        anchor_l2: 0.5,
        ..Default::default()
    };
    let anchor = exported_weights(&mut b, "w0");
    let mut w = anchor.clone();
    let mut m: std::collections::BTreeMap<String, Vec<f64>> =
        w.iter().map(|(k, v)| (k.clone(), vec![0.0; v.len()])).collect();
    let mut v = m.clone();
    for t in 1..=3i32 {
        let g = grads_by_key(&b.learn_gradients(&events).expect("gradients"));
        let norm = g.values().flatten().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let clip = (opts.max_grad_norm as f64 / (norm + 1e-6)).min(1.0);
        assert!(clip < 1.0, "step {t}: the clip must be active for this check (norm {norm:.3})");
        let report = b.learn_tokens(&events, &opts).expect("step");
        assert!(
            (report.grad_norm as f64 - norm).abs() <= f64::from(GRAD_NORM_REL) * norm,
            "reported norm {} vs {norm}",
            report.grad_norm
        );
        let (bc1, bc2) = (1.0 - (opts.beta1 as f64).powi(t), 1.0 - (opts.beta2 as f64).powi(t));
        for (key, wk) in w.iter_mut() {
            let (mk, vk) = (m.get_mut(key).expect("m"), v.get_mut(key).expect("v"));
            for (i, x) in wk.iter_mut().enumerate() {
                let x64 = *x as f64;
                let gi = clip * g[key][i] as f64 + opts.anchor_l2 as f64 * (x64 - anchor[key][i] as f64);
                mk[i] = opts.beta1 as f64 * mk[i] + (1.0 - opts.beta1 as f64) * gi;
                vk[i] = opts.beta2 as f64 * vk[i] + (1.0 - opts.beta2 as f64) * gi * gi;
                let step = (mk[i] / bc1) / ((vk[i] / bc2).sqrt() + opts.eps as f64) + opts.weight_decay as f64 * x64;
                *x = (x64 - opts.lr as f64 * step) as f32;
            }
        }
        let gpu = exported_weights(&mut b, &format!("w{t}"));
        for (key, want) in &w {
            let (_, max) = rel_and_max(&gpu[key], want);
            assert!(max <= OPTIM_ABS, "step {t}, {key}: max |gpu − cpu| {max:.2e} (≤ {OPTIM_ABS})");
        }
    }
}

/// An MLX conversion exports with the module names of the class its `config.json` names: an
/// adapter learned on the conversion of a VLM save loads in peft on `Qwen3_5ForConditionalGeneration`
/// (`model.language_model.layers.N`), one on a text-class conversion on `Qwen3_5ForCausalLM`.
#[test]
fn mlx_conversions_export_the_module_names_of_their_source_class() {
    let Some(ctx) = gpu() else { return };
    for (architecture, prefix) in [
        ("Qwen3_5ForCausalLM", "base_model.model.model.layers."),
        ("Qwen3_5ForConditionalGeneration", "base_model.model.model.language_model.layers."),
    ] {
        let dir = common::scratch_copy(&fixture_model("mlx_q4_g64"), &format!("mlx-class-{architecture}"));
        let path = dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
        cfg["architectures"] = serde_json::json!([architecture]);
        std::fs::write(&path, cfg.to_string()).expect("write");
        let mut b = WgpuBackend::with_context(ctx.clone(), SessionOptions { max_context: 64, max_batch: 16 });
        b.load_model_with(&dir, &LoadOptions::default()).expect("model");
        b.import_trainable_adapter(&root().join("tests/fixtures/learn/q4_last")).expect("import");
        let out = dir.join("export");
        b.export_trainable_adapter(&out).expect("export");
        let keys: Vec<String> = read_tensors(&out.join("adapter_model.safetensors")).into_keys().collect();
        assert!(!keys.is_empty() && keys.iter().all(|k| k.starts_with(prefix)), "{architecture}: {keys:?}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
