//! Hostile sizes and garbage numbers at run time: a session far larger than any cache can be,
//! weights out of range, and an adapter whose products overflow the logits give typed errors,
//! never a panic, an abort or tokens chosen from NaN.

mod common;

use std::sync::Arc;

use common::{damaged_model, gpu, Tensors};
use qwen35_wgpu::runtime::{MAX_BATCH, MAX_CONTEXT};
use qwen35_wgpu::{GenerateParams, LoraAdapter, Model, RunError, Session, SessionOptions};

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
    // The public table builder bounds its own size the same way.
    for positions in [usize::MAX, MAX_CONTEXT + 1] {
        let e = qwen35_wgpu::runtime::rope_table(&model.config, positions).expect_err("refused");
        assert!(matches!(&e, RunError::BadParam { name: "positions", .. }), "{e}");
    }
    assert_eq!(qwen35_wgpu::runtime::rope_table(&model.config, 3).expect("table").len(), 3 * model.config.rotary_dim);
    Session::new(model, opts()).expect("a sane session still opens");
}

/// The RoPE table against its formula in f64, cos and sin of p · θ^(−2i/R) at every position
/// and frequency, for the fixture's config and the published Qwen 3.5 one (R = 64 of a 256-wide
/// head, θ = 10^7), over 4,096 positions (further than any reference fixture reaches).
#[test]
fn the_rope_table_is_its_formula() {
    use common::tolerance::{ROPE_ABS_ULPS, ROPE_ULPS_PER_POSITION};
    let fixture = qwen35_wgpu::TextConfig::from_dir(&common::fixture_model("odd_untied_f32")).expect("config");
    let mut published = fixture.clone();
    (published.head_dim, published.rotary_dim, published.rope_theta) = (256, 64, 1e7);
    let positions = 4096;
    for c in [fixture, published] {
        let table = qwen35_wgpu::runtime::rope_table(&c, positions).expect("table");
        let half = c.rotary_dim / 2;
        assert_eq!(table.len(), positions * half * 2, "[positions, R/2] of (cos, sin)");
        let ulp = (-24f64).exp2();
        for p in 0..positions {
            for i in 0..half {
                let angle = p as f64 * c.rope_theta.powf(-((2 * i) as f64) / c.rotary_dim as f64);
                let bound = (ROPE_ULPS_PER_POSITION * p as f64 + ROPE_ABS_ULPS) * ulp;
                let at = 2 * (p * half + i);
                for (what, got, want) in [("cos", table[at], angle.cos()), ("sin", table[at + 1], angle.sin())] {
                    let err = (got as f64 - want).abs();
                    assert!(err <= bound, "R {} θ {}: {what} at position {p}, frequency {i}: {got} vs {want} (err {err:.2e} > {bound:.2e})", c.rotary_dim, c.rope_theta);
                }
            }
        }
    }
}

/// The fixture with `lm_head.weight` changed by `f` (element index, value) → value.
fn head_edited_dir(tag: &str, f: impl Fn(usize, f32) -> f32) -> std::path::PathBuf {
    damaged_model(BASE, tag, |t: &mut Tensors| {
        let head = t.iter_mut().find(|(n, ..)| n == "lm_head.weight").expect("untied lm_head");
        assert_eq!(head.1, safetensors::Dtype::F32);
        let v: Vec<f32> = head.3.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        head.3 = v.iter().enumerate().flat_map(|(i, &x)| f(i, x).to_le_bytes()).collect();
    })
}

/// A rank-16 adapter on every MLP projection at the edge of every load bound (|w| = 10⁴,
/// alpha / r = 10³; applied at scale 10³): each bound is sane on its own, but the products
/// overflow f32 inside the MLP, so the logits come out NaN or infinite.
fn overflowing_adapter(config: &qwen35_wgpu::TextConfig) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("qwen35-test-overflowing-adapter-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let r = 16;
    let (h, i) = (config.hidden_size, config.intermediate_size);
    let mut tensors: Tensors = Vec::new();
    for layer in 0..config.num_layers() {
        for (proj, inp, out) in [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)] {
            let key = format!("base_model.model.model.layers.{layer}.mlp.{proj}");
            let ones = |n: usize| (0..n).flat_map(|_| 1e4f32.to_le_bytes()).collect::<Vec<u8>>();
            tensors.push((format!("{key}.lora_A.weight"), safetensors::Dtype::F32, vec![r, inp], ones(r * inp)));
            tensors.push((format!("{key}.lora_B.weight"), safetensors::Dtype::F32, vec![out, r], ones(out * r)));
        }
    }
    common::write_tensors(&dir.join("adapter_model.safetensors"), tensors);
    let config = serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": 16_000,
        "target_modules": ["gate_proj", "up_proj", "down_proj"]});
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).expect("config");
    dir
}

#[test]
fn non_finite_and_absurd_weights_are_refused_at_load_naming_the_tensor() {
    let Some(ctx) = gpu() else { return };
    for (tag, bad) in
        [("w-nan", f32::NAN), ("w-inf", f32::INFINITY), ("w-neg-inf", f32::NEG_INFINITY), ("w-huge", -1e38)]
    {
        let dir = head_edited_dir(tag, move |i, x| if i == 5 { bad } else { x });
        match Model::load(ctx.clone(), &dir) {
            Err(qwen35_wgpu::ModelError::WeightOutOfRange { tensor, index, .. }) => {
                assert_eq!((tensor.as_str(), index), ("lm_head.weight", 5), "{tag}")
            }
            other => panic!("{tag}: expected WeightOutOfRange, got {:?}", other.err()),
        }
    }
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
    let Some(ctx) = gpu() else { return };
    let prompt = [3u32, 17, 42];
    let model = Arc::new(Model::load(ctx, &common::fixture_model(BASE)).expect("model"));
    let adapter = Arc::new(LoraAdapter::load(&model, &overflowing_adapter(&model.config)).expect("within every bound"));
    {
        let what = "an adapter whose products overflow";
        for (path, params) in paths() {
            let mut s = Session::new(model.clone(), opts()).expect("session");
            s.set_adapter(Some((adapter.clone(), qwen35_wgpu::lora::MAX_SCALE))).expect("the largest scale");
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
