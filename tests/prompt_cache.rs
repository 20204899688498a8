//! The prompt cache: a chat that grows turn by turn prefills only what is new, gives the same
//! tokens as starting from scratch, and starts over whenever the adapter, its scale or its
//! weights change.

mod common;

use std::path::PathBuf;

use common::{gpu, root};
use qwen35_wgpu::runtime::PromptCacheStats;
use qwen35_wgpu::{
    ChatMessage, ChatRequest, GenerateParams, LlmBackend, SessionOptions, TextTokenizer, TrainSpec, WgpuBackend,
};

fn demo_dir() -> PathBuf {
    root().join("examples/assets/demo")
}

/// The demo model on the shared context, sessions of `max_context` tokens (8 a step), and its
/// tokenizer.
fn demo_model(max_context: usize) -> Option<(std::sync::Arc<qwen35_wgpu::Model>, SessionOptions, TextTokenizer)> {
    let model = qwen35_wgpu::Model::load(gpu()?, &demo_dir()).expect("demo");
    let tok = TextTokenizer::from_dir(&demo_dir()).expect("tokenizer");
    Some((std::sync::Arc::new(model), SessionOptions { max_context, max_batch: 8 }, tok))
}

fn backend(cache: bool) -> Option<WgpuBackend> {
    let ctx = gpu()?;
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 256, max_batch: 64 });
    b.load_model(&demo_dir()).expect("demo model");
    b.prompt_cache().expect("loaded").set_enabled(cache);
    Some(b)
}

const QUESTIONS: [&str; 4] =
    ["What color is the sky?", "Where is the cat?", "What is the apple?", "What color is the sky?"];

fn params() -> GenerateParams {
    GenerateParams { max_tokens: 12, ..Default::default() }
}

/// A 4-turn chat: each turn's prompt is the whole conversation so far. Returns every reply and
/// the cache's counters after each turn.
fn chat(b: &mut WgpuBackend, params: &GenerateParams) -> (Vec<String>, Vec<PromptCacheStats>) {
    let mut messages = Vec::new();
    let (mut replies, mut stats) = (Vec::new(), Vec::new());
    for q in QUESTIONS {
        messages.push(ChatMessage::new("user", q));
        let reply = b.chat(&ChatRequest::new(messages.clone()), params, &mut |_| true).expect("chat");
        messages.push(ChatMessage::new("assistant", &reply.content));
        replies.push(reply.text);
        stats.push(b.prompt_cache().expect("loaded").stats());
    }
    (replies, stats)
}

fn prompt_len(messages: &[ChatMessage]) -> u64 {
    let tok = TextTokenizer::from_dir(&demo_dir()).expect("tokenizer");
    tok.encode_prompt(&tok.apply_chat_template(messages).expect("render")).expect("encode").len() as u64
}

#[test]
fn a_growing_chat_prefills_only_the_new_turn_and_answers_as_without_the_cache() {
    let (Some(mut cached), Some(mut fresh)) = (backend(true), backend(false)) else { return };
    for p in [params(), GenerateParams { temperature: 0.8, top_k: 5, seed: 3, ..params() }] {
        let (with, stats) = chat(&mut cached, &p);
        let (without, fresh_stats) = chat(&mut fresh, &p);
        assert_eq!(with, without, "replies with and without the cache");
        assert!(with.iter().all(|r| !r.is_empty()));
        assert_eq!(fresh_stats.last().expect("4").reused_tokens, 0);
        // Turn 1 of the first chat starts from nothing; every later turn reuses everything up to
        // the previous turn's assistant header, so it prefills that answer and the new question.
        for t in 1..4 {
            let reused = stats[t].reused_tokens - stats[t - 1].reused_tokens;
            let prefilled = stats[t].prefilled_tokens - stats[t - 1].prefilled_tokens;
            assert!(reused > prefilled, "turn {}: reused {reused}, prefilled {prefilled}", t + 1);
        }
    }
}

/// Something done to the backend between two turns.
type Change<'a> = Box<dyn Fn(&mut WgpuBackend) + 'a>;

#[test]
fn another_adapter_scale_or_a_learning_step_starts_over() {
    let Some(mut b) = backend(true) else { return };
    let id = b.preload_adapter(&demo_dir().join("adapters/shout"), None).expect("adapter");
    let q1 = vec![ChatMessage::new("user", QUESTIONS[0])];
    let turn2 = |b: &mut WgpuBackend| {
        let reply = b.chat(&ChatRequest::new(q1.clone()), &params(), &mut |_| true).expect("turn 1");
        let mut m = q1.clone();
        m.push(ChatMessage::new("assistant", &reply.content));
        m.push(ChatMessage::new("user", QUESTIONS[1]));
        m
    };
    let stats = |b: &mut WgpuBackend| b.prompt_cache().expect("loaded").stats();
    let shout = demo_dir().join("adapters/shout");
    let changes: [(&str, Change); 7] = [
        ("nothing", Box::new(|_| {})),
        ("activate", Box::new(|b| b.activate_adapter(&id, 1.0).expect("activate"))),
        ("scale", Box::new(|b| b.set_adapter_scale(0.5).expect("scale"))),
        ("deactivate", Box::new(|b| b.deactivate_adapter().expect("off"))),
        ("load", Box::new(|b| drop(b.load_adapter(&shout, 1.0).expect("load")))),
        (
            "remove",
            Box::new(|b| {
                let active = b.active_adapter().expect("query").expect("active").id;
                b.remove_adapter(&active).expect("remove")
            }),
        ),
        // Direct use of the session: the backend cannot know what it changed.
        (
            "session()",
            Box::new(|b| {
                let a = b.session().expect("session").model().clone();
                let adapter = std::sync::Arc::new(qwen35_wgpu::LoraAdapter::load(&a, &shout).expect("adapter"));
                b.session().expect("session").set_adapter(Some((adapter, 1.0))).expect("bind");
            }),
        ),
    ];
    for (what, change) in changes {
        let m = turn2(&mut b);
        change(&mut b);
        let before = stats(&mut b);
        b.chat(&ChatRequest::new(m.clone()), &params(), &mut |_| true).expect("turn 2");
        let after = stats(&mut b);
        let (reused, prefilled) =
            (after.reused_tokens - before.reused_tokens, after.prefilled_tokens - before.prefilled_tokens);
        if what == "nothing" {
            assert!(reused > 0, "{what}: the unchanged state is reused");
        } else {
            assert_eq!((reused, prefilled), (0, prompt_len(&m)), "{what}: the whole prompt is prefilled again");
        }
    }
    // A learning step changes the weights the cached tokens were computed with.
    b.create_trainable_adapter(&TrainSpec::default()).expect("trainable");
    let m = turn2(&mut b);
    let events = [qwen35_wgpu::FeedbackEvent {
        prompt: QUESTIONS[0].into(),
        response: "The sky is green.".into(),
        signal: qwen35_wgpu::Signal::Preferred,
    }];
    // A refused step (a learning rate that is not a number) changes nothing: the cache stays.
    let bad = qwen35_wgpu::LearnOptions { lr: f32::NAN, ..Default::default() };
    assert!(b.learn(&events, &bad).is_err(), "a NaN learning rate");
    let before = stats(&mut b);
    b.chat(&ChatRequest::new(m.clone()), &params(), &mut |_| true).expect("after a refused step");
    let after = stats(&mut b);
    assert!(after.reused_tokens > before.reused_tokens, "a refused step keeps the cache");
    let m = turn2(&mut b);
    b.learn(&events, &Default::default()).expect("step");
    let before = stats(&mut b);
    b.chat(&ChatRequest::new(m.clone()), &params(), &mut |_| true).expect("after learning");
    let after = stats(&mut b);
    assert_eq!(after.reused_tokens, before.reused_tokens, "a learning step invalidates the cache");
}

/// Adapters loaded into and removed from another session leave this session's prompt cache as it
/// was: its next turn goes on from its snapshots (the app edited the reply, so the held tokens
/// do not lead into the new prompt).
#[test]
fn another_sessions_adapters_coming_and_going_keep_this_sessions_snapshots() {
    let Some(mut b) = backend(true) else { return };
    let q1 = vec![ChatMessage::new("user", QUESTIONS[0])];
    let reply = b.chat(&ChatRequest::new(q1.clone()), &params(), &mut |_| true).expect("turn 1");
    let mut m = q1;
    m.push(ChatMessage::new("assistant", &format!("Edited. {}", reply.content)));
    m.push(ChatMessage::new("user", QUESTIONS[1]));
    let this = b.current_session().expect("session");
    let other = b.create_session().expect("another session");
    b.select_session(other).expect("select");
    let shout = demo_dir().join("adapters/shout");
    b.load_adapter(&shout, 1.0).expect("load in the other session");
    b.unload_adapter().expect("unload");
    let id = b.preload_adapter(&shout, Some("shout")).expect("preload");
    b.set_adapters(&[qwen35_wgpu::AdapterWeight::new(&id, 0.5)]).expect("set");
    b.set_adapters(&[]).expect("none");
    b.remove_adapter(&id).expect("remove");
    b.select_session(this).expect("back");
    let before = b.prompt_cache().expect("loaded").stats();
    let cached = b.chat(&ChatRequest::new(m.clone()), &params(), &mut |_| true).expect("turn 2");
    let after = b.prompt_cache().expect("loaded").stats();
    assert!(after.reused_tokens > before.reused_tokens, "turn 2 goes on from turn 1: {before:?} -> {after:?}");
    let mut fresh = backend(true).expect("backend");
    let want = fresh.chat(&ChatRequest::new(m), &params(), &mut |_| true).expect("without the cache");
    assert_eq!(cached.text, want.text);
}

/// A backend on a context of its own (its counters count only this test's work).
fn backend_on_own_context(cache: bool) -> Option<WgpuBackend> {
    gpu()?;
    let ctx = std::sync::Arc::new(qwen35_wgpu::GpuContext::new().expect("context"));
    let mut b = WgpuBackend::with_context(ctx, SessionOptions { max_context: 256, max_batch: 64 });
    b.load_model(&demo_dir()).expect("demo model");
    b.prompt_cache().expect("loaded").set_enabled(cache);
    Some(b)
}

/// A new turn's tokens run as one step: the snapshots at its turn start and before its last
/// token are taken inside it (its GDN dispatches split there), not by steps and copies of their
/// own, so the cached turn (going on from the tokens the session holds) submits fewer command
/// buffers than the same turn from scratch (a reset, then its prompt as one step too), and
/// answers the same. Prefilling up to the last token before the request, as the cache did,
/// makes them equal.
#[test]
fn a_cached_turn_takes_its_snapshots_inside_its_one_prompt_step() {
    let (Some(mut cached), Some(mut fresh)) = (backend_on_own_context(true), backend_on_own_context(false)) else {
        return;
    };
    let mut messages = vec![ChatMessage::new("user", QUESTIONS[0])];
    let reply = cached.chat(&ChatRequest::new(messages.clone()), &params(), &mut |_| true).expect("turn 1");
    messages.push(ChatMessage::new("assistant", &reply.content));
    messages.push(ChatMessage::new("user", QUESTIONS[1]));
    assert!(prompt_len(&messages) <= 64, "the whole conversation fits one step");
    let request = ChatRequest::new(messages);
    let submits = |b: &mut WgpuBackend| {
        let before = b.context().counters();
        let reply = b.chat(&request, &params(), &mut |_| true).expect("turn 2");
        (reply.text, (b.context().counters() - before).submits)
    };
    let before = cached.prompt_cache().expect("loaded").stats();
    let (with, cached_submits) = submits(&mut cached);
    let (without, fresh_submits) = submits(&mut fresh);
    let stats = cached.prompt_cache().expect("loaded").stats();
    assert_eq!(with, without, "the same reply");
    assert!(stats.reused_tokens > before.reused_tokens, "turn 2 reused turn 1");
    assert_eq!(cached.prompt_cache().expect("loaded").snapshot_count(), 4, "two snapshots a turn");
    assert!(
        cached_submits < fresh_submits,
        "submits with the cache {cached_submits}, from scratch {fresh_submits}: a snapshot point ran a step of its own"
    );
}

#[test]
fn a_prompt_that_leaves_the_held_tokens_midway_goes_back_to_a_snapshot() {
    let (Some(mut cached), Some(mut fresh)) = (backend(true), backend(false)) else { return };
    let tok = TextTokenizer::from_dir(&demo_dir()).expect("tokenizer");
    let first =
        tok.encode_prompt(&tok.apply_chat_template(&[ChatMessage::new("user", QUESTIONS[0])]).expect("r")).expect("e");
    let out = cached.generate_ids(&first, &params()).expect("turn 1");
    assert!(out.len() > 3);
    // The next prompt keeps the first two generated tokens, then goes elsewhere.
    let mut next = first.clone();
    next.extend_from_slice(&out[..2]);
    next.extend(
        tok.encode_prompt("<|im_end|>\n<|im_start|>user\nWhere is the cat?<|im_end|>\n<|im_start|>assistant\n")
            .expect("e"),
    );
    let before = cached.prompt_cache().expect("loaded").stats();
    let got = cached.generate_ids(&next, &params()).expect("turn 2");
    let after = cached.prompt_cache().expect("loaded").stats();
    assert_eq!(got, fresh.generate_ids(&next, &params()).expect("fresh"), "same tokens as from scratch");
    let reused = after.reused_tokens - before.reused_tokens;
    assert!(
        reused > 0 && reused < first.len() as u64,
        "restored to the snapshot before request 1's last token: {reused}"
    );
}

#[test]
fn a_restored_snapshot_gives_the_logits_of_a_full_prefill() {
    let Some((model, opts, tok)) = demo_model(256) else { return };
    let turn_start = tok.token_id("<|im_start|>");
    let ids = |text: &str| tok.encode_prompt(text).expect("encode");
    let first = ids("<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\nThe sky");
    let mut s = qwen35_wgpu::Session::new(model.clone(), opts.clone()).expect("session");
    let mut cache = qwen35_wgpu::runtime::PromptCache::default();
    // Request 1, then three more tokens: the session is well past both snapshots.
    // Nothing held: prepare prefills nothing, and the request's own steps (8 tokens each) take
    // both snapshots on their way.
    let fed = cache.prepare(&mut s, &first, turn_start).expect("prepare");
    assert_eq!((fed, s.position()), (0, 0), "nothing prefilled before the request");
    s.feed(&first[fed..]).expect("the prompt");
    s.feed(&ids(" is blue")).expect("more");
    cache.finish(&mut s, &first, &[]);
    assert_eq!(cache.snapshot_count(), 2, "the turn start's and the last token's");
    // Request 2 leaves request 1 inside its assistant turn: back to the snapshot before
    // `<|im_start|>assistant`, whose GDN states must be those of that position.
    let start = first.iter().rposition(|&t| Some(t) == turn_start).expect("turn start");
    let mut second = first[..start].to_vec();
    second.extend(ids("<|im_start|>user\nWhere is the cat?<|im_end|>\n<|im_start|>assistant\n"));
    let fed = cache.prepare(&mut s, &second, turn_start).expect("prepare");
    assert!(fed >= start, "reused up to the turn start at least: {fed}");
    let got = s.feed(&second[fed..]).expect("rest");
    let mut full = qwen35_wgpu::Session::new(model, opts).expect("session");
    let want = full.feed(&second).expect("full prefill");
    let (rel, _) = common::rel_and_max(got.last().expect("a row"), want.last().expect("a row"));
    assert!(rel <= common::tolerance::PATHS_REL, "restored vs full prefill: rel {rel:.3e}");
}

#[test]
fn a_snapshot_restores_only_into_the_session_that_still_holds_its_tokens() {
    let Some((model, opts, tok)) = demo_model(64) else { return };
    let ids = tok.encode_prompt("What color is the sky? The sky is blue, and the cat is on the mat.").expect("ids");
    let mut s = qwen35_wgpu::Session::new(model.clone(), opts.clone()).expect("session");
    let mut other = qwen35_wgpu::Session::new(model, opts).expect("session");
    s.prefill(&ids[..4]).expect("prefill");
    let early = s.snapshot(None).expect("snapshot");
    s.prefill(&ids[4..8]).expect("prefill");
    let late = s.snapshot(None).expect("snapshot");
    s.prefill(&ids[8..10]).expect("prefill");
    // Back to each, as often as wanted, while the tokens below them are the ones they saw.
    s.restore(&late).expect("late");
    s.restore(&late).expect("late again");
    s.restore(&early).expect("early");
    // Another session's snapshot, one past the position, one whose tokens were rewritten (back
    // to 4, then other tokens to 8), one after a reset: refused, the position unchanged.
    other.prefill(&ids[..8]).expect("prefill");
    assert!(other.restore(&early).is_err(), "another session's snapshot");
    assert!(s.restore(&late).is_err(), "a snapshot past the position");
    s.prefill(&ids[20..24]).expect("other tokens");
    assert!(s.restore(&late).is_err(), "a snapshot whose tokens were rewritten");
    assert_eq!(s.position(), 8);
    s.restore(&early).expect("early still holds");
    s.reset();
    s.prefill(&ids[20..26]).expect("after a reset");
    assert!(s.restore(&early).is_err(), "a snapshot from before a reset");
    assert_eq!(s.position(), 6);
    // Snapshots hold the states of the adapters bound when they were taken.
    let now = s.snapshot(None).expect("snapshot");
    s.set_adapters(Vec::new()).expect("the same (empty) set again");
    assert!(s.restore(&now).is_err(), "a snapshot from before an adapter change");
}

/// A step that writes a snapshot's states binds its buffers for that step only: requests whose
/// snapshots replace each other leave the session's cached bind groups as they were (a cached
/// group would keep a dropped snapshot's GPU memory alive), and the snapshots stay right.
#[test]
fn snapshots_taken_inside_steps_leave_no_bind_group_behind() {
    let Some((model, opts, tok)) = demo_model(64) else { return };
    let base = tok.encode_prompt("What color is the sky? The sky is blue, and the cat is on the mat.").expect("ids");
    assert!(base.len() > 9 && base.len() % 8 != 0, "the snapshot before the last token is inside a step");
    let mut s = qwen35_wgpu::Session::new(model.clone(), opts.clone()).expect("session");
    let mut cache = qwen35_wgpu::runtime::PromptCache::default();
    let mut groups = Vec::new();
    // Prompts of one length with nothing in common: each request starts over and replaces the
    // snapshot the one before took.
    for first in 0..4u32 {
        let mut prompt = base.clone();
        prompt[0] = 100 + first;
        let fed = cache.prepare(&mut s, &prompt, None).expect("prepare");
        assert_eq!(fed, 0);
        s.feed(&prompt).expect("the prompt");
        cache.finish(&mut s, &prompt, &[]);
        assert_eq!(cache.snapshot_count(), 1, "request {first}");
        groups.push(s.cached_bind_groups());
    }
    assert!(groups.iter().all(|&g| g == groups[0]), "cached bind groups after each request: {groups:?}");
    // The last snapshot (taken inside the last step) holds the states before the last token.
    let mut prompt = base.clone();
    prompt[0] = 103;
    let fed = cache.prepare(&mut s, &prompt, None).expect("prepare");
    assert_eq!(fed, prompt.len() - 1, "back to the snapshot before the last token");
    let got = s.feed(&prompt[fed..]).expect("the last token");
    let want = qwen35_wgpu::Session::new(model, opts).expect("session").feed(&prompt).expect("full prefill");
    let (rel, _) = common::rel_and_max(got.last().expect("a row"), want.last().expect("a row"));
    assert!(rel <= common::tolerance::PATHS_REL, "restored vs full prefill: rel {rel:.3e}");
}

#[test]
fn held_tokens_are_reused_only_while_nothing_else_ran_on_the_session() {
    let Some((model, opts, tok)) = demo_model(64) else { return };
    let ids = |text: &str| tok.encode_prompt(text).expect("encode");
    let mut s = qwen35_wgpu::Session::new(model.clone(), opts.clone()).expect("session");
    let mut cache = qwen35_wgpu::runtime::PromptCache::default();
    let first = ids("What color is the sky?");
    let fed = cache.prepare(&mut s, &first, None).expect("prepare");
    s.feed(&first[fed..]).expect("last token");
    cache.finish(&mut s, &first, &[]);
    // Other tokens run on the session between the two requests: the cache cannot trust the
    // tokens it recorded, and goes back to its snapshot instead.
    s.feed(&ids(" Hello there")).expect("something else");
    let mut second = first.clone();
    second.extend(ids(" The sky is"));
    let before = cache.stats().reused_tokens;
    let fed = cache.prepare(&mut s, &second, None).expect("prepare");
    let reused = cache.stats().reused_tokens - before;
    assert!(reused < first.len() as u64, "reused {reused} of the {} recorded tokens", first.len());
    let got = s.feed(&second[fed..]).expect("rest");
    let want = qwen35_wgpu::Session::new(model, opts).expect("session").feed(&second).expect("full prefill");
    let (rel, _) = common::rel_and_max(got.last().expect("a row"), want.last().expect("a row"));
    assert!(rel <= common::tolerance::PATHS_REL, "vs a full prefill: rel {rel:.3e}");
}

/// An adapter set changed on the session itself, with no `PromptCache::clear` after it: the cache
/// serves nothing computed under the set before (neither its held tokens nor its snapshots), and
/// the request prefills from scratch under the new set.
#[test]
fn an_adapter_set_changed_without_clearing_the_cache_is_not_served_from_it() {
    let Some((model, opts, tok)) = demo_model(64) else { return };
    let ids = |text: &str| tok.encode_prompt(text).expect("encode");
    let french = std::sync::Arc::new(
        qwen35_wgpu::LoraAdapter::load(&model, &demo_dir().join("adapters/french")).expect("french"),
    );
    let mut s = qwen35_wgpu::Session::new(model.clone(), opts.clone()).expect("session");
    let mut cache = qwen35_wgpu::runtime::PromptCache::default();
    let first = ids("What color is the sky?");
    let fed = cache.prepare(&mut s, &first, None).expect("prepare");
    s.feed(&first[fed..]).expect("prompt");
    cache.finish(&mut s, &first, &[]);
    assert!(cache.snapshot_count() > 0, "the request left snapshots");
    s.set_adapter(Some((french.clone(), 1.0))).expect("french");
    let mut second = first.clone();
    second.extend(ids(" The sky is"));
    let fed = cache.prepare(&mut s, &second, None).expect("prepare after the change");
    assert_eq!(fed, 0, "nothing of the base model's states is reused");
    let got = s.feed(&second).expect("the whole prompt");
    let mut fresh = qwen35_wgpu::Session::new(model, opts).expect("session");
    fresh.set_adapter(Some((french, 1.0))).expect("french");
    let want = fresh.feed(&second).expect("full prefill");
    let (rel, _) = common::rel_and_max(got.last().expect("a row"), want.last().expect("a row"));
    assert!(rel <= common::tolerance::PATHS_REL, "vs a fresh session under the adapter: rel {rel:.3e}");
}

/// The snapshots of all sessions stay within the backend's budget, freed from the least recently
/// used session first (the request's own last), and the replies do not change.
#[test]
fn all_sessions_snapshots_fit_the_budget_least_recently_used_first() {
    let (Some(mut b), Some(mut fresh)) = (backend(true), backend(false)) else { return };
    let count = |b: &mut WgpuBackend, id| {
        let back = b.current_session().expect("a session");
        b.select_session(id).expect("select");
        let n = b.prompt_cache().expect("loaded").snapshot_count();
        b.select_session(back).expect("select back");
        n
    };
    let first = b.current_session().expect("a session");
    let second = b.create_session().expect("a second session");
    let mut talks = [(first, Vec::new()), (second, Vec::new())];
    let mut budget = None;
    for turn in 0..3 {
        for (who, (id, messages)) in talks.iter_mut().enumerate() {
            b.select_session(*id).expect("select");
            messages.push(ChatMessage::new("user", QUESTIONS[(2 * turn + who) % 4]));
            let request = ChatRequest::new(messages.clone());
            let reply = b.chat(&request, &params(), &mut |_| true).expect("chat");
            let want = fresh.chat(&request, &params(), &mut |_| true).expect("fresh");
            assert_eq!(reply.text, want.text, "turn {turn} of session {id}");
            messages.push(ChatMessage::new("assistant", &reply.content));
            // From the first request on: room for what one request keeps (two snapshots).
            let room = *budget.get_or_insert_with(|| {
                assert_eq!(b.prompt_cache().expect("loaded").snapshot_count(), 2, "a first request keeps two");
                let bytes = b.snapshot_bytes();
                b.set_snapshot_budget(bytes);
                bytes
            });
            assert!(b.snapshot_bytes() <= room, "turn {turn} of session {id}: {} > {room} bytes", b.snapshot_bytes());
            if turn == 0 && who == 1 {
                // The second session's first request took two snapshots: the first session's,
                // used longer ago, were freed, not its own.
                assert_eq!((count(&mut b, first), count(&mut b, second)), (0, 2), "snapshots per session");
            }
        }
    }
    b.set_snapshot_budget(0);
    assert_eq!(b.snapshot_bytes(), 0, "a zero budget keeps nothing");
}
