//! The sampler's distribution against transformers' (tier 1, no GPU): for fixed logit rows and
//! histories, the tokens [`Sampler::distribution`] keeps after the repetition penalty,
//! temperature, top-k and top-p, and their probabilities, are the ones transformers' logits
//! processors leave (`tests/fixtures/reference/sampling.json`, from `make_sampling.py`).

mod common;

use common::root;
use common::tolerance::SAMPLING_PROB_ABS;
use qwen35_wgpu::{GenerateParams, Sampler};
use serde_json::Value;

#[test]
fn kept_tokens_and_probabilities_match_transformers() {
    let path = root().join("tests/fixtures/reference/sampling.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("json");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "no cases");
    let floats =
        |v: &Value| -> Vec<f64> { v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect() };
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let params = GenerateParams {
            temperature: case["temperature"].as_f64().expect("temperature") as f32,
            top_k: case["top_k"].as_u64().expect("top_k") as usize,
            top_p: case["top_p"].as_f64().expect("top_p") as f32,
            repetition_penalty: case["repetition_penalty"].as_f64().expect("penalty") as f32,
            ..Default::default()
        };
        let logits: Vec<f32> = floats(&case["logits"]).into_iter().map(|v| v as f32).collect();
        let history: Vec<u32> =
            case["history"].as_array().expect("history").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        let want = floats(&case["probs"]);
        assert_eq!(want.len(), logits.len(), "{name}");
        let got =
            Sampler::from_params(&params).expect("sampler").distribution(&logits, &history).expect("distribution");
        let mut kept: Vec<u32> = got.iter().map(|&(id, _)| id).collect();
        kept.sort_unstable();
        let want_kept: Vec<u32> = (0..want.len() as u32).filter(|&i| want[i as usize] > 0.0).collect();
        assert_eq!(kept, want_kept, "{name}: the tokens kept");
        for &(id, p) in &got {
            let w = want[id as usize];
            assert!((p - w).abs() <= SAMPLING_PROB_ABS, "{name}: token {id} probability {p} vs transformers' {w}");
        }
        let total: f64 = got.iter().map(|&(_, p)| p).sum();
        assert!((total - 1.0).abs() <= SAMPLING_PROB_ABS, "{name}: probabilities sum to {total}");
    }
}
