//! Text in, text out on the trained demo model: the engine's chat template, tokenizer and greedy
//! text equal transformers + peft's, for the base model and each adapter.

mod common;

use common::{gpu, root};
use qwen35_wgpu::{
    ChatDelta, ChatMessage, ChatRequest, GenerateParams, LlmBackend, SessionOptions, TextTokenizer, WgpuBackend,
};

fn demo_dir() -> std::path::PathBuf {
    root().join("examples/assets/demo")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(root().join("tests/fixtures/reference/demo.json")).expect("demo.json");
    serde_json::from_str(&text).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// The demo model in a backend with a session per variant (an adapter of the demo's, activated;
/// "base": the session the loaded backend keeps, without one) and the reference's greedy params.
fn sessions_per_variant(
    ctx: std::sync::Arc<qwen35_wgpu::GpuContext>,
    r: &serde_json::Value,
    variants: &[&'static str],
) -> (WgpuBackend, Vec<(qwen35_wgpu::SessionId, &'static str)>, GenerateParams) {
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 256, max_batch: 64 });
    b.load_model(&demo_dir()).expect("demo model");
    let max_tokens = r["max_new_tokens"].as_u64().expect("max") as usize;
    let mut sessions = Vec::new();
    for &variant in variants {
        if variant == "base" {
            sessions.push((b.current_session().expect("session"), variant));
            continue;
        }
        b.preload_adapter(&demo_dir().join("adapters").join(variant), Some(variant)).expect("adapter");
        let id = b.create_session().expect("session");
        b.select_session(id).expect("select");
        b.activate_adapter(variant, 1.0).expect("activate");
        sessions.push((id, variant));
    }
    (b, sessions, GenerateParams { max_tokens, ..Default::default() })
}

#[test]
fn template_and_tokenizer_match_transformers() {
    let tok = TextTokenizer::from_dir(&demo_dir()).expect("tokenizer");
    let r = reference();
    for row in r["outputs"]["base"].as_array().expect("rows") {
        let q = row["question"].as_str().expect("q");
        let prompt = tok.apply_chat_template(&[ChatMessage::new("user", q)]).expect("template");
        assert_eq!(prompt, row["prompt"].as_str().expect("prompt"), "rendered chat template");
        assert_eq!(tok.encode(&prompt).expect("encode"), ids(&row["prompt_ids"]), "prompt ids for {q:?}");
    }
}

#[test]
fn streamed_decoding_never_splits_characters() {
    let tok = TextTokenizer::from_dir(&demo_dir()).expect("tokenizer");
    let text = "Le vélo est à l'école. La météo: éé ü ✓";
    let ids = tok.encode(text).expect("encode");
    let whole = tok.decode(&ids).expect("decode");
    let mut stream = tok.stream();
    let mut joined = String::new();
    let mut held = 0;
    for id in ids {
        match stream.step(id).expect("step") {
            Some(delta) => joined.push_str(&delta),
            None => held += 1,
        }
    }
    assert_eq!(joined, whole);
    assert!(held > 0, "some multi-byte characters span tokens in this text, so some steps must wait");
}

#[test]
fn greedy_text_matches_transformers_for_base_and_each_adapter() {
    let Some(ctx) = gpu() else { return };
    let r = reference();
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 256, max_batch: 64 });
    b.load_model(&demo_dir()).expect("demo model");
    let max_tokens = r["max_new_tokens"].as_u64().expect("max") as usize;
    let mut texts = Vec::new();
    for (variant, rows) in r["outputs"].as_object().expect("outputs") {
        if variant == "base" {
            b.deactivate_adapter().expect("base");
        } else {
            let id = b.preload_adapter(&demo_dir().join("adapters").join(variant), None).expect("adapter");
            b.activate_adapter(&id, 1.0).expect("activate");
        }
        for row in rows.as_array().expect("rows") {
            let q = row["question"].as_str().expect("q");
            let params = GenerateParams { max_tokens, ..Default::default() };
            let got_ids = b.generate_ids(&ids(&row["prompt_ids"]), &params).expect("ids");
            assert_eq!(got_ids, ids(&row["generated_ids"]), "{variant}: {q}");
            let mut streamed = String::new();
            let reply = b
                .chat(&ChatRequest::new(vec![ChatMessage::new("user", q)]), &params, &mut |d| {
                    if let ChatDelta::Content(c) = d {
                        streamed.push_str(c);
                    }
                    true
                })
                .expect("chat");
            assert_eq!(reply.text, row["text"].as_str().expect("text"), "{variant}: {q}");
            assert_eq!(reply.content, reply.text.trim(), "{variant}: no reasoning or tool calls in the demo");
            assert_eq!(streamed, reply.content, "{variant}: streamed deltas");
            texts.push((variant.clone(), q.to_string(), reply.text));
        }
    }
    for (v, q, t) in &texts {
        if v != "base" {
            let base = texts.iter().find(|(bv, bq, _)| bv == "base" && bq == q).expect("base row");
            assert_ne!(&base.2, t, "{v} must answer {q:?} differently from the base model");
        }
    }
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let Some(ctx) = gpu() else { return };
    let r = reference();
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 256, max_batch: 64 });
    b.load_model(&demo_dir()).expect("demo model");
    let row = &r["outputs"]["base"][0];
    let full = row["text"].as_str().expect("text");
    let cut = full.find(' ').expect("a space in the answer");
    let stop = full[cut..cut + 2].to_string();
    let params = GenerateParams { max_tokens: 32, stop: vec![stop], ..Default::default() };
    let request = ChatRequest::new(vec![ChatMessage::new("user", row["question"].as_str().expect("q"))]);
    let reply = b.chat(&request, &params, &mut |_| true);
    assert_eq!(reply.expect("chat").text, full[..cut]);
}

#[test]
fn two_sessions_with_different_adapters_answer_as_transformers_when_interleaved() {
    let Some(ctx) = gpu() else { return };
    let r = reference();
    let (mut b, sessions, params) = sessions_per_variant(ctx, &r, &["shout", "french"]);
    let rows = r["outputs"]["shout"].as_array().expect("rows").len();
    for i in 0..rows {
        for &(id, variant) in &sessions {
            b.select_session(id).expect("select");
            let row = &r["outputs"][variant][i];
            let q = row["question"].as_str().expect("q");
            let reply = b.chat(&ChatRequest::new(vec![ChatMessage::new("user", q)]), &params, &mut |_| true);
            assert_eq!(reply.expect("chat").text, row["text"].as_str().expect("text"), "{variant}: {q}");
        }
    }
}

/// Three sessions (base, shout, french) chat together, one batch per question: every reply is
/// transformers + peft's for its session's adapter, streamed per request; with a stop string
/// each request ends where its session's own chat ends.
#[test]
fn batched_chats_answer_as_transformers_for_each_sessions_adapter() {
    let Some(ctx) = gpu() else { return };
    let r = reference();
    let (mut b, sessions, params) = sessions_per_variant(ctx, &r, &["base", "shout", "french"]);
    let rows = r["outputs"]["base"].as_array().expect("rows").len();
    for i in 0..rows {
        let requests: Vec<ChatRequest> = sessions
            .iter()
            .map(|(_, v)| {
                ChatRequest::new(vec![ChatMessage::new("user", r["outputs"][v][i]["question"].as_str().expect("q"))])
            })
            .collect();
        let asks: Vec<_> = sessions.iter().zip(&requests).map(|((id, _), q)| (*id, q)).collect();
        let mut streamed = vec![String::new(); sessions.len()];
        let replies = b
            .chat_batch(&asks, &params, &mut |k, d| {
                if let ChatDelta::Content(c) = d {
                    streamed[k].push_str(c);
                }
                true
            })
            .expect("batched chat");
        for (k, (_, v)) in sessions.iter().enumerate() {
            let row = &r["outputs"][v][i];
            assert_eq!(replies[k].text, row["text"].as_str().expect("text"), "{v}: {}", row["question"]);
            assert_eq!(streamed[k], replies[k].content, "{v}: streamed deltas");
        }
    }
    let full = r["outputs"]["base"][0]["text"].as_str().expect("text");
    let cut = full.find(' ').expect("a space in the answer");
    let stop = GenerateParams { stop: vec![full[cut..].chars().take(2).collect()], ..params };
    let q = ChatRequest::new(vec![ChatMessage::new("user", r["outputs"]["base"][0]["question"].as_str().expect("q"))]);
    let mut alone = Vec::new();
    for (id, _) in &sessions {
        b.select_session(*id).expect("select");
        alone.push(b.chat(&q, &stop, &mut |_| true).expect("alone").text);
    }
    assert_eq!(alone[0], full[..cut], "the stop string ends the base answer");
    let asks: Vec<_> = sessions.iter().map(|(id, _)| (*id, &q)).collect();
    let replies = b.chat_batch(&asks, &stop, &mut |_, _| true).expect("batched chat with a stop string");
    let texts: Vec<String> = replies.into_iter().map(|reply| reply.text).collect();
    assert_eq!(texts, alone, "each request ends where its session's own chat does");
}
