//! Hostile sizes and garbage numbers at run time: a session far larger than any cache can be, and
//! weights that overflow the logits, give typed errors, never a panic, an abort or tokens chosen
//! from NaN.

mod common;

use std::sync::Arc;

use common::{damaged_model, gpu, Tensors};
use qwen35_wgpu::runtime::{MAX_BATCH, MAX_CONTEXT};
use qwen35_wgpu::{GenerateParams, Model, RunError, Session, SessionOptions};

const BASE: &str = "odd_untied_f32";

fn opts() -> SessionOptions {
    SessionOptions { max_context: 64, max_batch: 16 }
}

#[test]
fn absurd_session_sizes_are_typed_errors() {
    let Some(ctx) = gpu() else { return };
    let model = Arc::new(Model::load(ctx, &common::fixture_model(BASE)).expect("model"));
    // 2^58 overflowed the RoPE table's capacity ("capacity overflow" panic).
    for max_context in [1usize << 58, usize::MAX, MAX_CONTEXT + 1] {
        let e = Session::new(model.clone(), SessionOptions { max_context, max_batch: 16 }).err().expect("refused");
        assert!(
            matches!(&e, RunError::BadParam { name: "max_context", value, .. } if *value == max_context.to_string()),
            "{e}"
        );
    }
    for max_batch in [1usize << 40, MAX_BATCH + 1] {
        let e = Session::new(model.clone(), SessionOptions { max_context: 64, max_batch }).err().expect("refused");
        assert!(matches!(&e, RunError::BadParam { name: "max_batch", .. }), "{e}");
    }
    Session::new(model, opts()).expect("a sane session still opens");
}

/// The fixture with `lm_head.weight` changed by `f` (element index, value) → value.
fn head_edited(tag: &str, f: impl Fn(usize, f32) -> f32) -> Arc<Model> {
    let ctx = gpu().expect("checked by the caller");
    let dir = damaged_model(BASE, tag, |t: &mut Tensors| {
        let head = t.iter_mut().find(|(n, ..)| n == "lm_head.weight").expect("untied lm_head");
        assert_eq!(head.1, safetensors::Dtype::F32);
        let v: Vec<f32> = head.3.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        head.3 = v.iter().enumerate().flat_map(|(i, &x)| f(i, x).to_le_bytes()).collect();
    });
    Arc::new(Model::load(ctx, &dir).expect("the file is well-formed; only its numbers are garbage"))
}

/// Every generation path: GPU greedy, GPU top-k candidates, CPU sampling without top-k, greedy
/// with a repetition penalty (CPU), and a temperature so small that it is greedy.
fn paths() -> Vec<(&'static str, GenerateParams)> {
    let p = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    vec![
        ("greedy", p.clone()),
        ("top-k", GenerateParams { temperature: 0.8, top_k: 5, seed: 1, ..p.clone() }),
        ("top-p", GenerateParams { temperature: 0.8, top_p: 0.9, seed: 1, ..p.clone() }),
        ("penalty", GenerateParams { repetition_penalty: 1.3, ..p.clone() }),
        ("top-k penalty", GenerateParams { temperature: 0.8, top_k: 5, repetition_penalty: 1.3, ..p.clone() }),
        ("tiny temperature", GenerateParams { temperature: 1e-40, ..p }),
    ]
}

#[test]
fn non_finite_logits_stop_generation_with_a_typed_error() {
    let Some(_) = gpu() else { return };
    let prompt = [3u32, 17, 42];
    // Infinite weights: every logit is ±inf or NaN. One NaN row: only that token's logit is NaN
    // (the greedy argmax alone would never pick it and return tokens as if nothing happened).
    let inf = head_edited("head-inf", |i, _| if i % 2 == 0 { f32::INFINITY } else { -f32::INFINITY });
    let hidden = inf.config.hidden_size;
    let one_nan = head_edited("head-nan-row", move |i, x| if i / hidden == 7 { f32::NAN } else { x });
    for (what, model) in [("infinite weights", &inf), ("one NaN row", &one_nan)] {
        for (path, params) in paths() {
            let mut s = Session::new(model.clone(), opts()).expect("session");
            let mut streamed = Vec::new();
            let e = s.generate(&prompt, &params, |t| {
                streamed.push(t);
                true
            });
            match e {
                Err(RunError::NonFiniteLogits { position }) => assert_eq!(position, 2, "{what}, {path}"),
                other => panic!("{what}, {path}: expected NonFiniteLogits, got {other:?}"),
            }
            assert!(streamed.is_empty(), "{what}, {path}: tokens {streamed:?} streamed from non-finite logits");
        }
    }
}

#[test]
fn a_tiny_temperature_is_greedy() {
    let Some(ctx) = gpu() else { return };
    let model = Arc::new(Model::load(ctx, &common::fixture_model(BASE)).expect("model"));
    let prompt = [3u32, 17, 42];
    let run = |params: GenerateParams| {
        let mut s = Session::new(model.clone(), opts()).expect("session");
        s.generate(&prompt, &params, |_| true).expect("generate")
    };
    let p = GenerateParams { max_tokens: 6, stop_at_eos: false, ..Default::default() };
    let greedy = run(p.clone());
    for t in [1e-40, 1e-30, 9e-6] {
        for top_k in [0, 5] {
            assert_eq!(run(GenerateParams { temperature: t, top_k, seed: 9, ..p.clone() }), greedy, "temperature {t}");
        }
    }
}
