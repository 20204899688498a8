//! Tier 3: full-model parity with transformers (fixtures made by `cargo xtask fixtures`).

mod common;

use std::sync::Arc;

use common::tolerance::{HIDDEN_REL, LOGITS_MAX_ABS, LOGITS_REL, PATHS_REL};
use common::{fixture_model, gpu, rel_and_max, Reference};
use qwen35_wgpu::{GenerateParams, LoadOptions, Model, Session, SessionOptions};

const FIXTURES: [&str; 3] = ["gva_tied_f32", "odd_untied_f32", "vlm_bf16_sharded"];
const PROMPTS: usize = 2;

fn load(name: &str, opts: &LoadOptions) -> Option<Arc<Model>> {
    let ctx = gpu()?;
    Some(Arc::new(Model::load_with(ctx, &fixture_model(name), opts).unwrap_or_else(|e| panic!("{name}: {e}"))))
}

fn session(model: &Arc<Model>) -> Session {
    Session::new(model.clone(), SessionOptions { max_context: 64, max_batch: 16 }).expect("session")
}

fn check_logits(what: &str, ours: &[f32], want: &[f32], vocab: usize) -> Result<(), String> {
    common::whole_rows(what, ours, want, vocab)?;
    for (pos, (o, w)) in ours.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let (rel, max) = rel_and_max(o, w);
        if !(rel <= LOGITS_REL && max <= LOGITS_MAX_ABS) {
            return Err(format!(
                "{what} position {pos}: rel {rel:.3e} (≤ {LOGITS_REL}), max abs {max:.3e} (≤ {LOGITS_MAX_ABS})"
            ));
        }
    }
    Ok(())
}

fn first_diverging_layer(ours: &[f32], want: &[f32], layers: usize) -> String {
    let per = want.len() / (layers + 1);
    for l in 0..=layers {
        let (rel, max) = rel_and_max(&ours[l * per..(l + 1) * per], &want[l * per..(l + 1) * per]);
        if rel > HIDDEN_REL {
            let name = if l == 0 { "embeddings".to_string() } else { format!("output of layer {}", l - 1) };
            return format!("first divergence: {name} (rel {rel:.3e}, max abs {max:.3e})");
        }
    }
    "hidden states all agree; divergence is in the final norm or lm_head".into()
}

#[test]
fn prefill_logits_match_transformers() {
    for name in FIXTURES {
        let Some(model) = load(name, &LoadOptions::default()) else {
            return;
        };
        let r = Reference::load(name);
        let vocab = model.config.vocab_size;
        for p in 0..PROMPTS {
            let ids = r.ids(&format!("prompt{p}.ids"));
            let (_, want) = r.f32(&format!("prompt{p}.logits"));
            let (_, want_hidden) = r.f32(&format!("prompt{p}.hidden"));
            let (logits, hidden) = session(&model).feed_debug(&ids).expect("forward");
            assert_eq!(logits.rows, ids.len());
            if let Err(msg) = check_logits(&format!("{name} prompt{p}"), &logits.data, &want, vocab) {
                panic!("{msg}; {}", first_diverging_layer(&hidden, &want_hidden, model.config.num_layers()));
            }
        }
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for name in FIXTURES {
        let Some(model) = load(name, &LoadOptions::default()) else {
            return;
        };
        let r = Reference::load(name);
        for p in 0..PROMPTS {
            let ids = r.ids(&format!("prompt{p}.ids"));
            let want = r.ids(&format!("prompt{p}.generated"));
            let params = GenerateParams { max_tokens: want.len(), stop_at_eos: false, ..Default::default() };
            // Decode with the block norms and SwiGLU folded into the projections, and without.
            for fused in [false, true] {
                let mut streamed = Vec::new();
                let mut s = session(&model);
                s.set_fused_decode(fused);
                let got = s
                    .generate(&ids, &params, |t| {
                        streamed.push(t);
                        true
                    })
                    .expect("generate");
                assert_eq!(got, want, "{name} prompt{p} (fused {fused}): greedy continuation");
                assert_eq!(streamed, got, "{name} prompt{p}: streamed tokens");
            }
        }
    }
}

#[test]
fn decode_after_prefill_matches_full_prefill() {
    for name in FIXTURES {
        let Some(model) = load(name, &LoadOptions::default()) else {
            return;
        };
        let r = Reference::load(name);
        let ids = r.ids("prompt1.ids");
        let vocab = model.config.vocab_size;
        let full = session(&model).feed_all(&ids).expect("prefill");
        for fused in [false, true] {
            let mut s = session(&model);
            s.set_fused_decode(fused);
            let split = 3;
            let head = s.feed_all(&ids[..split]).expect("prefill head");
            let mut ours = head.data;
            for &id in &ids[split..] {
                ours.extend(s.feed(&[id]).expect("decode").data);
            }
            for (pos, (o, w)) in ours.chunks(vocab).zip(full.data.chunks(vocab)).enumerate() {
                let (rel, _) = rel_and_max(o, w);
                assert!(rel <= PATHS_REL, "{name} position {pos} (fused {fused}): decode vs prefill rel {rel:.3e}");
            }
        }
    }
}

#[test]
fn chunked_prefill_matches_one_batch() {
    let name = "gva_tied_f32";
    let Some(model) = load(name, &LoadOptions::default()) else {
        return;
    };
    let ids = Reference::load(name).ids("prompt1.ids");
    let one = session(&model).feed_all(&ids).expect("one batch");
    let mut small = Session::new(model.clone(), SessionOptions { max_context: 64, max_batch: 4 }).expect("session");
    let chunked = small.feed_all(&ids).expect("chunked");
    let (rel, _) = rel_and_max(&chunked.data, &one.data);
    assert!(rel <= PATHS_REL, "chunked prefill rel {rel:.3e}");
}

#[test]
fn weights_split_across_bindings_give_identical_logits() {
    let name = "vlm_bf16_sharded";
    let Some(whole) = load(name, &LoadOptions::default()) else {
        return;
    };
    // 1000 bytes holds 10 rows of the 48-wide bf16 embedding: the table, lm_head and every
    // matrix are split into several bindings, as the 0.8B embedding is at 128 MiB per binding.
    let Some(split) = load(name, &LoadOptions { max_chunk_bytes: 1000, ..Default::default() }) else {
        return;
    };
    assert!(split.embed.chunks.len() > 10);
    let ids = Reference::load(name).ids("prompt1.ids");
    let a = session(&whole).feed_all(&ids).expect("whole");
    let b = session(&split).feed_all(&ids).expect("split");
    assert_eq!(a.data, b.data, "splitting weights must not change a single bit");
}

#[test]
fn reset_forgets_the_sequence() {
    let name = "gva_tied_f32";
    let Some(model) = load(name, &LoadOptions::default()) else {
        return;
    };
    let ids = Reference::load(name).ids("prompt1.ids");
    let mut s = session(&model);
    let first = s.feed_all(&ids).expect("first");
    s.reset();
    let again = s.feed_all(&ids).expect("again");
    assert_eq!(first.data, again.data);
}

#[test]
fn final_hidden_states_are_the_input_of_lm_head() {
    // Embeddings pool these rows; check them against the logits through the tied embedding.
    let name = "gva_tied_f32";
    let Some(model) = load(name, &LoadOptions::default()) else { return };
    let ids = Reference::load(name).ids("prompt1.ids");
    let hidden = session(&model).final_hidden(&ids).expect("hidden");
    let logits = session(&model).feed_all(&ids).expect("logits");
    let ckpt = qwen35_wgpu::model::Checkpoint::open_dir(&fixture_model(name)).expect("checkpoint");
    let (v, h) = (model.config.vocab_size, model.config.hidden_size);
    let table = ckpt.read_f32("model.embed_tokens.weight", &[v, h]).expect("embedding");
    let via_cpu = qwen35_wgpu::reference::linear(&hidden, &table, ids.len(), v, h);
    let (rel, _) = rel_and_max(&via_cpu, &logits.data);
    assert!(rel <= PATHS_REL, "final hidden · Eᵀ vs logits: rel {rel:.3e}");
}

#[test]
fn gpu_greedy_runs_ahead_without_leaking_state() {
    let Some(model) = load("gva_tied_f32", &LoadOptions::default()) else {
        return;
    };
    let prompt = Reference::load("gva_tied_f32").ids("prompt1.ids");
    let params = GenerateParams { max_tokens: 8, stop_at_eos: false, ..Default::default() };
    // The callback stops at the 4th token: the step that ran ahead for a 5th is never committed
    // (run-ahead is the GPU default; CPU adapters run without it).
    let mut s = session(&model);
    s.set_run_ahead(true);
    let mut n = 0;
    let out = s
        .generate(&prompt, &params, |_| {
            n += 1;
            n < 4
        })
        .expect("generate");
    assert_eq!(out.len(), 4);
    assert_eq!(s.position(), prompt.len() + 3, "the session holds the prompt and the tokens fed back");
    let after = s.feed(&out[3..]).expect("continue");
    // The same tokens fed one at a time (the same kernels, so the same bits).
    let mut by_hand = session(&model);
    let mut logits = by_hand.feed(&prompt).expect("prompt");
    for &id in &out[..3] {
        assert_eq!(qwen35_wgpu::runtime::argmax(logits.last().expect("a row")), id, "GPU and CPU greedy agree");
        logits = by_hand.feed(&[id]).expect("step");
    }
    assert_eq!(qwen35_wgpu::runtime::argmax(logits.last().expect("a row")), out[3]);
    let want = by_hand.feed(&out[3..]).expect("continue");
    assert_eq!(after.data, want.data, "logits after a discarded run-ahead step");
}

#[test]
fn greedy_decode_is_one_submit_and_four_bytes_per_token() {
    if gpu().is_none() {
        return;
    }
    // A context of its own: the shared one counts the work of tests running beside this one.
    let ctx = Arc::new(qwen35_wgpu::GpuContext::new().expect("context"));
    let model = Arc::new(Model::load(ctx, &fixture_model("gva_tied_f32")).expect("model"));
    let prompt = Reference::load("gva_tied_f32").ids("prompt1.ids");
    let params = GenerateParams { max_tokens: 6, stop_at_eos: false, ..Default::default() };
    let mut outs = Vec::new();
    for ahead in [true, false] {
        let mut s = session(&model);
        s.set_run_ahead(ahead);
        let before = model.ctx.counters();
        let out = s.generate(&prompt, &params, |_| true).expect("generate");
        let used = model.ctx.counters() - before;
        assert_eq!(out.len(), 6);
        assert_eq!(used.submits, 6, "run-ahead {ahead}: one submit for the prompt, one per further token");
        assert_eq!(used.read_back, 6 * 8, "run-ahead {ahead}: only the chosen ids and their non-finite flags");
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1], "the same tokens with and without the run-ahead step");
}

/// Sampling the way `generate` did before the GPU candidate pass: the whole row read back, the
/// choice made on the CPU.
fn sample_by_hand(model: &Arc<Model>, prompt: &[u32], params: &GenerateParams) -> Vec<u32> {
    let mut s = session(model);
    let mut sampler = qwen35_wgpu::runtime::Sampler::from_params(params).expect("params");
    let mut history = prompt.to_vec();
    let mut logits = s.feed(prompt).expect("prompt");
    let mut out = Vec::new();
    while out.len() < params.max_tokens {
        let next = sampler.sample_after(logits.last().expect("a row"), &history).expect("a row");
        history.push(next);
        out.push(next);
        logits = s.feed(&[next]).expect("step");
    }
    out
}

#[test]
fn sampling_from_gpu_candidates_draws_what_the_whole_row_draws() {
    if gpu().is_none() {
        return;
    }
    // A context of its own, to count what comes back.
    let ctx = Arc::new(qwen35_wgpu::GpuContext::new().expect("context"));
    for name in ["gva_tied_f32", "vlm_bf16_sharded"] {
        let model = Arc::new(Model::load(ctx.clone(), &fixture_model(name)).expect("model"));
        let prompt = Reference::load(name).ids("prompt1.ids");
        let vocab = model.config.vocab_size;
        // Top-k settings, then sampling without top-k (top-p, the temperature alone, a penalty).
        let settings = [
            (0.8, 5, 1.0, 1.0),
            (1.5, 40, 0.9, 1.3),
            (0.6, 1, 1.0, 1.0),
            (1.0, 20, 0.7, 0.9),
            (0.7, 0, 0.8, 1.0),
            (0.5, 0, 1.0, 1.0),
            (1.0, 0, 0.95, 1.2),
        ];
        for (i, (temperature, top_k, top_p, repetition_penalty)) in settings.into_iter().enumerate() {
            let params = GenerateParams {
                max_tokens: 10,
                temperature,
                top_k,
                top_p,
                repetition_penalty,
                seed: 17 + i as u64,
                stop_at_eos: false,
                ..Default::default()
            };
            let before = ctx.counters();
            let out = session(&model).generate(&prompt, &params, |_| true).expect("generate");
            let used = ctx.counters() - before;
            assert_eq!(out, sample_by_hand(&model, &prompt, &params), "{name} {params:?}");
            if top_k == 0 {
                // 64 pairs (at most the vocabulary), the flag and one (max, sum) pair per 4,096
                // logits per token, plus a whole row for each token the candidates left to it:
                // some but not all.
                let per_token = ((2 * vocab.min(64) + 1) * 4 + vocab.div_ceil(4096) * 8) as u64;
                let row = (vocab * 4) as u64;
                if repetition_penalty == 1.0 {
                    let rest = used.read_back - per_token * out.len() as u64;
                    assert_eq!(rest % row, 0, "{name} {params:?}: candidates and whole rows only");
                    assert!(rest / row < out.len() as u64, "{name} {params:?}: every token read its row");
                }
                continue;
            }
            // k + 8 pairs and the non-finite flag per token, and the history's logits with a
            // penalty: never a whole row.
            let pairs = ((2 * (top_k + 8) + 1) * 4 * out.len()) as u64;
            if repetition_penalty == 1.0 {
                assert_eq!(used.read_back, pairs, "{name} {params:?}: only the candidates come back");
            } else {
                let most = pairs + (4 * (prompt.len() + out.len()) * out.len()) as u64;
                assert!(used.read_back <= most, "{name} {params:?}: {} bytes read back", used.read_back);
            }
            assert!(used.read_back < (vocab * 4 * out.len()) as u64);
        }
    }
}

/// `embeddings_ids` is the mean over the prompt's positions of the final norm's output: here
/// transformers' last hidden states through the checkpoint's final RMSNorm (the CPU reference).
/// Ids it refuses leave the conversation's prompt cache as it was.
#[test]
fn embeddings_are_the_mean_of_the_final_norm_of_transformers_states() {
    use qwen35_wgpu::{LlmBackend, WgpuBackend};
    let Some(ctx) = gpu() else { return };
    for name in FIXTURES {
        let dir = fixture_model(name);
        let mut b = WgpuBackend::with_context(ctx.clone(), SessionOptions { max_context: 64, max_batch: 16 });
        b.load_model(&dir).expect("model");
        let r = Reference::load(name);
        let c = qwen35_wgpu::TextConfig::from_dir(&dir).expect("config");
        let ckpt = qwen35_wgpu::model::Checkpoint::open_dir(&dir).expect("checkpoint");
        let h = c.hidden_size;
        let norm = ckpt.read_f32(&format!("{}norm.weight", ckpt.text_prefix()), &[h]).expect("final norm");
        for p in 0..PROMPTS {
            let ids = r.ids(&format!("prompt{p}.ids"));
            let (_, hidden) = r.f32(&format!("prompt{p}.hidden"));
            let t = ids.len();
            let normed = qwen35_wgpu::reference::rms_norm(&hidden[hidden.len() - t * h..], &norm, h, c.rms_norm_eps);
            let want: Vec<f32> = (0..h).map(|j| (0..t).map(|i| normed[i * h + j]).sum::<f32>() / t as f32).collect();
            let got = b.embeddings_ids(&ids).expect("embedding");
            let (rel, max) = rel_and_max(&got, &want);
            assert!(rel <= HIDDEN_REL, "{name} prompt {p} ({t} tokens): rel {rel:.3e}, max abs {max:.3e}");
        }
        let ids = r.ids("prompt1.ids");
        assert!(ids.len() >= 6, "{name}: a prompt of {} tokens", ids.len());
        let params = GenerateParams { max_tokens: 2, stop_at_eos: false, ..Default::default() };
        let first = &ids[..4];
        let reply = b.generate_ids(first, &params).expect("request 1");
        for bad in [&[][..], &[u32::MAX][..]] {
            assert!(b.embeddings_ids(bad).is_err(), "{name}: {bad:?} refused");
        }
        let mut next = [first, &reply[..]].concat();
        next.extend(&ids[4..6]);
        let before = b.prompt_cache().expect("cache").stats();
        b.generate_ids(&next, &params).expect("request 2");
        let reused = b.prompt_cache().expect("cache").stats().reused_tokens - before.reused_tokens;
        assert!(reused >= first.len() as u64, "{name}: request 2 reused {reused} tokens after refused embeddings");
    }
}
