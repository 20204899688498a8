//! Decoding to the context limit: a session filled one token at a time up to `max_context` gives
//! finite logits at every position and the logits of a full prefill of the same ids, and past
//! the limit feeding and generating are typed `ContextFull` errors that change nothing; and a
//! 1,024-token prompt's logits and continuation are transformers'.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::tolerance::LONG_DECODE_REL;
use common::{check_logits, fixture_model, gpu, rel_and_max, Reference};
use qwen35_wgpu::{GenerateParams, Model, RunError, Session, SessionOptions};

/// The smallest fixture model (4 layers, 2 of them attention, hidden 38, vocabulary 101).
const MODEL: &str = "odd_untied_f32";

/// Fixed pseudo-random ids (xorshift), so that the sequence is not a greedy loop on a few tokens.
fn ids(n: usize, vocab: usize) -> Vec<u32> {
    let mut x = 0x2545_f491_u32;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % vocab as u32
        })
        .collect()
}

fn is_context_full<T: std::fmt::Debug>(what: &str, r: Result<T, RunError>, needed: usize, capacity: usize) {
    match r {
        Err(RunError::ContextFull { needed: n, capacity: c }) if (n, c) == (needed, capacity) => {}
        other => panic!("{what}: want ContextFull {{ needed: {needed}, capacity: {capacity} }}, got {other:?}"),
    }
}

fn decode_to_the_limit(limit: usize) {
    let Some(ctx) = gpu() else { return };
    let started = Instant::now();
    let model = Arc::new(Model::load(ctx, &fixture_model(MODEL)).expect("model"));
    let vocab = model.config.vocab_size;
    let opts = SessionOptions { max_context: limit, max_batch: 128 };
    let ids = ids(limit, vocab);

    let mut s = Session::new(model.clone(), opts.clone()).expect("session");
    let mut decoded = Vec::with_capacity(limit * vocab);
    for (pos, &id) in ids.iter().enumerate() {
        let logits = s.feed(&[id]).expect("decode step");
        if let Some(bad) = logits.data.iter().position(|v| !v.is_finite()) {
            panic!("position {pos}: logit {bad} is {}", logits.data[bad]);
        }
        decoded.extend(logits.data);
    }
    let decode_s = started.elapsed().as_secs_f32();
    assert_eq!(s.position(), limit);

    // Past the limit: a typed error, and the session is unchanged.
    is_context_full("feed past the limit", s.feed(&[1]), limit + 1, limit);
    is_context_full(
        "generate past the limit",
        s.generate(&[1], &GenerateParams::default(), |_| true),
        limit + 1,
        limit,
    );
    assert_eq!(s.position(), limit, "a refused step must not advance the session");

    let full = Session::new(model, opts).expect("session").feed_all(&ids).expect("prefill");
    let mut worst = (0.0f32, 0);
    for (pos, (d, p)) in decoded.chunks(vocab).zip(full.data.chunks(vocab)).enumerate() {
        let (rel, _) = rel_and_max(d, p);
        if rel > worst.0 {
            worst = (rel, pos);
        }
    }
    let (last, _) = rel_and_max(&decoded[(limit - 1) * vocab..], full.last().expect("a row"));
    eprintln!(
        "{limit} tokens: decode {decode_s:.1} s, total {:.1} s; decode vs prefill rel: last {last:.2e}, worst {:.2e} at {}",
        started.elapsed().as_secs_f32(),
        worst.0,
        worst.1
    );
    assert!(
        worst.0 <= LONG_DECODE_REL,
        "decode vs prefill: rel {:.3e} at position {} (≤ {LONG_DECODE_REL})",
        worst.0,
        worst.1
    );
}

#[test]
fn decode_to_a_1024_token_context_limit_matches_prefill() {
    decode_to_the_limit(1024);
}

#[test]
#[ignore = "4,096 decode steps and a 4,096-token prefill: 65 s (release) to 100 s (test build) on lavapipe; run by `cargo xtask test-long`"]
fn decode_to_a_4096_token_context_limit_matches_prefill() {
    decode_to_the_limit(4096);
}

/// A 1,024-token prompt against transformers (`reference/long_context.safetensors` from
/// `make_long_context.py`): the logits of a full prefill at every 16th position and the last 16,
/// and the greedy continuation through the caches, with the fused decode and without.
#[test]
fn a_long_prompt_matches_transformers() {
    let Some(ctx) = gpu() else { return };
    let model = Arc::new(Model::load(ctx, &fixture_model(MODEL)).expect("model"));
    let vocab = model.config.vocab_size;
    let r = Reference::load("long_context");
    let ids = r.ids("ids");
    let positions = r.ids("positions");
    let (_, want) = r.f32("logits");
    let generated = r.ids("generated");
    let opts = SessionOptions { max_context: ids.len() + generated.len(), max_batch: 128 };
    let full = Session::new(model.clone(), opts.clone()).expect("session").feed_all(&ids).expect("prefill");
    assert_eq!(full.rows, ids.len());
    let ours: Vec<f32> =
        positions.iter().flat_map(|&p| full.data[p as usize * vocab..(p as usize + 1) * vocab].to_vec()).collect();
    check_logits(&format!("{} positions of {}", positions.len(), ids.len()), &ours, &want, vocab);
    let params = GenerateParams { max_tokens: generated.len(), stop_at_eos: false, ..Default::default() };
    for fused in [false, true] {
        let mut s = Session::new(model.clone(), opts.clone()).expect("session");
        s.set_fused_decode(fused);
        assert_eq!(s.generate(&ids, &params, |_| true).expect("generate"), generated, "fused {fused}: greedy ids");
    }
}

#[test]
fn generation_stops_with_a_typed_error_at_the_context_limit() {
    let Some(ctx) = gpu() else { return };
    let model = Arc::new(Model::load(ctx, &fixture_model(MODEL)).expect("model"));
    let limit = 24;
    let prompt = ids(limit - 4, model.config.vocab_size);
    // Greedy (GPU choice, with and without a run-ahead step), top-k (GPU candidates), plain
    // temperature (the candidates, or the whole row).
    let samplers = [(0.0, 0, true), (0.0, 0, false), (0.8, 5, true), (0.8, 0, true)];
    for (temperature, top_k, ahead) in samplers {
        let what = format!("temperature {temperature}, top-k {top_k}, run-ahead {ahead}");
        let params = |max_tokens| GenerateParams {
            max_tokens,
            temperature,
            top_k,
            seed: 3,
            stop_at_eos: false,
            ..Default::default()
        };
        let mut s = Session::new(model.clone(), SessionOptions { max_context: limit, max_batch: 8 }).expect("session");
        s.set_run_ahead(ahead);
        // A prompt of P tokens and T new ones need P + T − 1 positions (the last token is not fed).
        let fits = s.generate(&prompt, &params(5), |_| true).expect("five tokens fit");
        assert_eq!((fits.len(), s.position()), (5, limit), "{what}");
        s.reset();
        let mut streamed = Vec::new();
        let past = s.generate(&prompt, &params(6), |t| {
            streamed.push(t);
            true
        });
        is_context_full(&format!("{what}: a sixth token"), past, limit + 1, limit);
        assert_eq!(streamed, fits, "{what}: the tokens that fit are streamed before the error");
        assert_eq!(s.position(), limit, "{what}");
        s.reset();
        is_context_full(&what, s.generate(&ids(limit + 1, 101), &params(1), |_| true), limit + 1, limit);
        assert_eq!(s.position(), 0, "{what}: a prompt longer than the context must not be fed in part");
    }
}
