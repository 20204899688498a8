//! Adapter sets (several adapters active at once, per-layer / per-projection factors) against
//! peft with the same adapters active (`xtask/python/make_adapter_sets.py`), and their API.

mod common;

use std::path::PathBuf;

use common::tolerance::{ADAPTER_EFFECT_REL, PATHS_REL, STEP_EFFECT_REL};
use common::{check_logits, fixture_model, gpu, rel_and_max, root, Reference};
use qwen35_wgpu::{
    AdapterError, AdapterWeight, BackendError, GenerateParams, LayerScales, LearnOptions, LlmBackend, Proj, Session,
    SessionOptions, Signal, TokenEvent, TrainSpec, WgpuBackend,
};

const ADAPTERS: [&str; 4] = ["all12_r8", "gdn_mlp_r4_rslora", "patterns_r16", "layers_0_3"];

/// The cases of make_adapter_sets.py, in the same order and with the same factors.
fn cases() -> Vec<(&'static str, Vec<AdapterWeight>)> {
    let w = AdapterWeight::new;
    vec![
        ("pair", vec![w("all12_r8", 1.0), w("gdn_mlp_r4_rslora", 1.0)]),
        ("weighted", vec![w("all12_r8", 0.7), w("gdn_mlp_r4_rslora", -0.5)]),
        ("triple", vec![w("all12_r8", 1.0), w("patterns_r16", 0.5), w("layers_0_3", -1.5)]),
        (
            "layers",
            vec![w("all12_r8", 1.0).with_layers(
                LayerScales::default().layers(0..2, 0.0).projections(&Proj::ATTENTION, 0.0).layers(5..6, 0.5),
            )],
        ),
        (
            "pair_layers",
            vec![
                w("all12_r8", 1.0).with_layers(LayerScales::default().layers(0..6, 0.0)),
                w("gdn_mlp_r4_rslora", 2.0).with_layers(LayerScales::default().projections(&Proj::MLP, 0.0)),
            ],
        ),
    ]
}

fn opts() -> SessionOptions {
    SessionOptions { max_context: 64, max_batch: 16 }
}

/// The gva_tied_f32 fixture with the four adapters resident under their names.
fn backend() -> Option<WgpuBackend> {
    let ctx = gpu()?;
    let mut b = WgpuBackend::with_context(ctx, opts());
    b.load_model(&fixture_model("gva_tied_f32")).expect("model");
    for name in ADAPTERS {
        let path: PathBuf = root().join("tests/fixtures/adapters").join(name);
        b.preload_adapter(&path, Some(name)).expect(name);
    }
    Some(b)
}

fn logits(b: &mut WgpuBackend, ids: &[u32]) -> Vec<f32> {
    let s = b.session().expect("session");
    s.reset();
    s.feed_all(ids).expect("forward").data
}

#[test]
fn adapter_sets_match_peft_with_the_same_adapters_active() {
    let Some(mut b) = backend() else { return };
    let r = Reference::load("adapter_sets");
    let ids = r.ids("ids");
    let vocab = b.model_info().expect("info").config.vocab_size;
    for (case, set) in cases() {
        b.set_adapters(&set).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(b.active_adapters().expect("query"), set, "{case}: the set as given");
        let (_, want) = r.f32(&format!("{case}.logits"));
        let got = logits(&mut b, &ids);
        check_logits(case, &got, &want, vocab);
        // Not just the first adapter alone (or the first at full strength everywhere).
        b.activate_adapter(&set[0].id, set[0].scale).expect("first alone");
        let first = logits(&mut b, &ids);
        let (rel, _) = rel_and_max(&got, &first);
        assert!(rel > ADAPTER_EFFECT_REL, "{case}: the set equals its first adapter (rel {rel:.2e})");
        b.set_adapters(&set).expect("again");
        let gen_want = r.ids(&format!("{case}.generated"));
        let params = GenerateParams { max_tokens: gen_want.len(), stop_at_eos: false, ..Default::default() };
        assert_eq!(b.generate_ids(&ids, &params).expect("generate"), gen_want, "{case}: greedy");
        // Token by token with the norms folded (the default: every block input's shrink but
        // layer 0's written by the residual projection before it, scaled by the set's tables).
        let s = b.session().expect("session");
        s.set_fused_decode(true);
        s.reset();
        let mut steps = Vec::new();
        for &id in &ids {
            steps.extend(s.feed(&[id]).expect("decode").data);
        }
        s.set_fused_decode(false);
        let (rel, _) = rel_and_max(&steps, &got);
        assert!(rel <= PATHS_REL, "{case}: fused decode vs prefill, rel {rel:.3e}");
    }
}

#[test]
fn a_set_is_one_call_idempotent_and_rescaled_without_uploading_weights() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let base = logits(&mut b, &ids);
    let pair = [AdapterWeight::new("all12_r8", 1.0), AdapterWeight::new("gdn_mlp_r4_rslora", 1.0)];
    let ctx = b.context().clone();
    let before = ctx.bytes_uploaded();
    b.set_adapters(&pair).expect("pair");
    let stacked = ctx.bytes_uploaded() - before;
    let sizes: Vec<u64> = b.list_adapters().expect("list").iter().take(2).map(|(_, a)| a.gpu_bytes).collect();
    let adapters: u64 = sizes.iter().sum();
    let smallest = sizes.iter().copied().min().unwrap_or(0);
    assert!(stacked >= adapters, "the stack uploads both adapters' weights once ({stacked} < {adapters} bytes)");
    let with_pair = logits(&mut b, &ids);

    // The same set again, and other scales of the same members: only the scale table is written.
    for set in [pair.to_vec(), vec![AdapterWeight::new("all12_r8", 0.7), AdapterWeight::new("gdn_mlp_r4_rslora", -0.5)]]
    {
        let before = ctx.bytes_uploaded();
        b.set_adapters(&set).expect("set");
        let written = ctx.bytes_uploaded() - before;
        assert!(
            written < smallest,
            "a rescale wrote {written} bytes, an adapter's weights are {smallest}: it must not upload them"
        );
    }
    b.set_adapters(&pair).expect("pair again");
    assert_eq!(logits(&mut b, &ids), with_pair, "setting the same set twice changes nothing");

    // The order of the members does not change the sum (a different stack, the same deltas).
    b.set_adapters(&[pair[1].clone(), pair[0].clone()]).expect("swapped");
    let (rel, _) = rel_and_max(&logits(&mut b, &ids), &with_pair);
    assert!(rel <= PATHS_REL, "member order: rel {rel:.2e}");

    // Scale 0 is off: the set of the other adapter alone, bit for bit; the empty set is the base.
    b.activate_adapter("all12_r8", 1.0).expect("alone");
    let alone = logits(&mut b, &ids);
    b.set_adapters(&[pair[0].clone(), AdapterWeight::new("gdn_mlp_r4_rslora", 0.0)]).expect("one off");
    assert_eq!(logits(&mut b, &ids), alone, "a scale of 0 turns an adapter off");
    b.set_adapters(&[]).expect("none");
    assert_eq!(logits(&mut b, &ids), base, "the empty set is the base model");
    assert!(b.active_adapter().expect("query").is_none());

    // The single-adapter calls work on sets of one; with several active the scale call refuses.
    b.set_adapters(&pair).expect("pair");
    assert!(matches!(b.set_adapter_scale(0.5), Err(BackendError::Adapter(AdapterError::SeveralActive { .. }))));
    b.remove_adapter("gdn_mlp_r4_rslora").expect("remove a member");
    assert_eq!(b.active_adapters().expect("query"), vec![pair[0].clone()]);
    assert_eq!(logits(&mut b, &ids), alone, "removing a member leaves the others active");
}

#[test]
fn bad_sets_are_typed_errors_and_change_nothing() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let good = vec![AdapterWeight::new("all12_r8", 1.0), AdapterWeight::new("patterns_r16", 0.5)];
    b.set_adapters(&good).expect("good");
    let want = logits(&mut b, &ids);
    let w = AdapterWeight::new;
    let bad: Vec<(Vec<AdapterWeight>, &str)> = vec![
        (vec![w("all12_r8", 1.0), w("nope", 1.0)], "UnknownId"),
        (vec![w("all12_r8", f32::NAN)], "BadScale"),
        (vec![w("all12_r8", 1.0), w("layers_0_3", f32::INFINITY)], "BadScale"),
        (vec![w("all12_r8", 1.0), w("all12_r8", 0.5)], "DuplicateInSet"),
        (vec![w("all12_r8", 1.0).with_layers(LayerScales::default().layers(0..9, 0.0))], "BadLayerScales"),
        (
            vec![w("all12_r8", 1.0).with_layers(LayerScales::default().projections(&Proj::MLP, f32::NAN))],
            "BadLayerScales",
        ),
        (vec![w("", 1.0)], "UnknownId"),
    ];
    for (set, kind) in bad {
        let err = b.set_adapters(&set).expect_err(kind);
        assert!(format!("{err:?}").starts_with(&format!("Adapter({kind}")), "{kind}: got {err:?}");
        assert_eq!(b.active_adapters().expect("query"), good, "{kind}: the active set is unchanged");
        assert_eq!(logits(&mut b, &ids), want, "{kind}: the logits are unchanged");
    }
}

#[test]
fn a_learning_step_reaches_every_stack_that_holds_the_trainable_adapter() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let id = b.create_trainable_adapter(&TrainSpec { rank: 4, ..TrainSpec::default() }).expect("trainable");
    let set = [AdapterWeight::new(id.clone(), 1.0), AdapterWeight::new("all12_r8", 1.0)];
    let learner = b.current_session().expect("session");
    b.set_adapters(&set).expect("stack with the trainable adapter");
    // Another session applies the same stack; a third built it, then moved to one adapter.
    let other = b.create_session().expect("other");
    b.select_session(other).expect("select");
    b.set_adapters(&set).expect("set");
    let before = logits(&mut b, &ids);
    let idle = b.create_session().expect("idle");
    b.select_session(idle).expect("select");
    b.set_adapters(&set).expect("set");
    b.activate_adapter("all12_r8", 1.0).expect("one adapter: the stack stays cached");
    b.select_session(learner).expect("select");
    let events: Vec<_> = (0..2)
        .map(|i| TokenEvent {
            prompt: ids[..6 + i].to_vec(),
            response: ids[6 + i..10 + i].to_vec(),
            signal: Signal::Preferred,
        })
        .collect();
    let opts = LearnOptions { lr: 1e-2, ..LearnOptions::default() };
    b.learn_tokens(&events, &opts).expect("step");
    assert_eq!(b.active_adapters().expect("query"), set, "learning keeps the set");
    let fresh = |b: &mut WgpuBackend| {
        b.session().expect("session").forget_stack();
        b.set_adapters(&set).expect("rebuilt");
        logits(b, &ids)
    };
    let after = logits(&mut b, &ids);
    let (rel, _) = rel_and_max(&after, &before);
    assert!(rel > STEP_EFFECT_REL, "the step does not reach the stacked set (rel {rel:.2e})");
    assert_eq!(fresh(&mut b), after, "the learner's stack after the step holds the stepped weights");
    b.select_session(other).expect("select");
    assert_eq!(logits(&mut b, &ids), after, "another session's active stack holds the stepped weights");
    b.select_session(idle).expect("select");
    b.set_adapters(&set).expect("back to the stack");
    assert_eq!(logits(&mut b, &ids), after, "a cached stack not active during the step is not reused stale");
}

#[test]
fn sessions_bind_sets_of_their_own_on_one_model() {
    let Some(mut b) = backend() else { return };
    let r = Reference::load("adapter_sets");
    let ids = r.ids("ids");
    let vocab = b.model_info().expect("info").config.vocab_size;
    let (_, want) = r.f32("pair.logits");
    b.set_adapters(&[AdapterWeight::new("all12_r8", 1.0), AdapterWeight::new("gdn_mlp_r4_rslora", 1.0)]).expect("pair");
    let stack = b.session().expect("session").adapters().to_vec();
    let model = b.session().expect("session").model().clone();
    let mut s = Session::new(model, opts()).expect("second session");
    s.set_adapters(stack).expect("the same set in another session");
    check_logits("second session", &s.feed_all(&ids).expect("forward").data, &want, vocab);
}

/// Three requests of a growing conversation (each prompt extends the previous prompt and its
/// reply), greedy.
fn conversation(b: &mut WgpuBackend, ids: &[u32], turns: usize) -> Vec<Vec<u32>> {
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    let mut prompt = ids[..6].to_vec();
    let mut replies = Vec::new();
    for turn in 0..turns {
        let reply = b.generate_ids(&prompt, &params).expect("generate");
        prompt.extend(&reply);
        prompt.extend(&ids[6 + turn..8 + turn]);
        replies.push(reply);
    }
    replies
}

#[test]
fn interleaved_sessions_with_different_sets_each_answer_as_alone() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let pair = [AdapterWeight::new("all12_r8", 1.0), AdapterWeight::new("gdn_mlp_r4_rslora", 1.0)];
    // Alone: each conversation in a backend of its own.
    let want_a = {
        let mut a = backend().expect("backend");
        a.activate_adapter("all12_r8", 1.0).expect("a");
        conversation(&mut a, &ids, 3)
    };
    let want_b = {
        let mut a = backend().expect("backend");
        a.set_adapters(&pair).expect("pair");
        conversation(&mut a, &ids, 3)
    };
    let want_base = conversation(&mut backend().expect("backend"), &ids, 3);
    assert_ne!(want_a, want_b, "the two sets must answer differently for this test to mean anything");
    // Interleaved on one model: turn by turn, three sessions (one without an adapter).
    let first = b.current_session().expect("a session");
    b.activate_adapter("all12_r8", 1.0).expect("a");
    let second = b.create_session().expect("second");
    let third = b.create_session().expect("third");
    b.select_session(second).expect("select");
    assert!(b.active_adapters().expect("query").is_empty(), "a new session starts without adapters");
    b.set_adapters(&pair).expect("pair");
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    let mut prompts = [ids[..6].to_vec(), ids[..6].to_vec(), ids[..6].to_vec()];
    let mut got: [Vec<Vec<u32>>; 3] = Default::default();
    for turn in 0..3 {
        for (k, sid) in [first, second, third].into_iter().enumerate() {
            b.select_session(sid).expect("select");
            let reply = b.generate_ids(&prompts[k], &params).expect("generate");
            prompts[k].extend(&reply);
            prompts[k].extend(&ids[6 + turn..8 + turn]);
            got[k].push(reply);
        }
    }
    assert_eq!(got[0], want_a, "session 1 (all12_r8)");
    assert_eq!(got[1], want_b, "session 2 (the pair)");
    assert_eq!(got[2], want_base, "session 3 (no adapter)");
    // Each session kept its own prompt cache across the others' requests.
    b.select_session(first).expect("select");
    let stats = b.prompt_cache().expect("cache").stats();
    assert!(stats.reused_tokens > stats.prefilled_tokens, "session 1 reused its state: {stats:?}");
    assert_eq!(b.active_adapters().expect("query"), vec![AdapterWeight::new("all12_r8", 1.0)]);
    // Removing an adapter takes it out of every session's set.
    b.remove_adapter("gdn_mlp_r4_rslora").expect("remove");
    b.select_session(second).expect("select");
    assert_eq!(b.active_adapters().expect("query"), vec![pair[0].clone()]);
}

#[test]
fn session_ids_and_limits_are_typed_errors() {
    let Some(mut b) = backend() else { return };
    let first = b.current_session().expect("a session");
    assert!(matches!(b.close_session(first), Err(BackendError::Sessions { .. })), "the last session stays");
    let second = b.create_session().expect("second");
    b.select_session(second).expect("select");
    b.close_session(second).expect("close the current one");
    assert_eq!(b.current_session(), Some(first), "the first remaining one is current");
    assert!(matches!(b.select_session(second), Err(BackendError::UnknownSession { id, .. }) if id == second));
    assert!(matches!(b.close_session(999), Err(BackendError::UnknownSession { .. })));
    let mut opened = vec![first];
    loop {
        match b.create_session() {
            Ok(id) => {
                assert!(!opened.contains(&id) && id != second, "ids are never reused");
                opened.push(id);
            }
            Err(BackendError::Sessions { .. }) => break,
            Err(e) => panic!("{e}"),
        }
        assert!(opened.len() <= qwen35_wgpu::MAX_SESSIONS, "the limit holds");
    }
    assert_eq!(b.sessions(), opened, "a refused session changes nothing");
    assert_eq!(b.current_session(), Some(first));
    // A model loaded again (or after an unload) opens its sessions under new ids: an id kept from
    // before names none of them.
    let dir = b.model_info().expect("a model").path;
    for reload in [false, true] {
        if reload {
            b.unload_model();
        }
        b.load_model(&dir).expect("load again");
        let now = b.current_session().expect("a session");
        assert!(!opened.contains(&now), "session {now} was an id of the earlier model");
        assert!(matches!(b.select_session(first), Err(BackendError::UnknownSession { .. })));
        opened.push(now);
    }
}

/// The thread-safety README documents, checked by the compiler: the backend and a session move
/// between threads; the model, resident adapters and the GPU context are shared between them.
#[test]
fn thread_safety_is_as_documented() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<WgpuBackend>();
    send::<Session>();
    send_sync::<qwen35_wgpu::Model>();
    send_sync::<qwen35_wgpu::LoraAdapter>();
    send_sync::<qwen35_wgpu::GpuContext>();
}

/// A removed adapter's GPU memory is not kept alive by the bind groups a session cached for it,
/// nor a replaced stack's by the groups cached for the stack: those groups go with them (the
/// rest stay, so nothing is rebuilt for the adapters still in use).
#[test]
fn removed_adapters_and_replaced_stacks_leave_no_bind_group_behind() {
    let Some(mut b) = backend() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    let groups = |b: &mut WgpuBackend| b.session().expect("session").cached_bind_groups();
    // A stack of two, decoded with; then another pair: the first stack goes.
    b.set_adapters(&[AdapterWeight::new(ADAPTERS[0], 1.0), AdapterWeight::new(ADAPTERS[1], 0.5)]).expect("pair");
    b.generate_ids(&ids[..4], &params).expect("with the stack");
    let with_stack = groups(&mut b);
    b.set_adapters(&[AdapterWeight::new(ADAPTERS[0], 1.0), AdapterWeight::new(ADAPTERS[2], 0.5)]).expect("pair");
    let replaced = groups(&mut b);
    assert!(replaced < with_stack, "the first stack's bind groups go: {with_stack} -> {replaced}");
    // One adapter, decoded with, then switched off and removed.
    b.set_adapters(&[AdapterWeight::new(ADAPTERS[3], 1.0)]).expect("one");
    b.generate_ids(&ids[..4], &params).expect("with the adapter");
    b.set_adapters(&[]).expect("none");
    let with_adapter = groups(&mut b);
    b.remove_adapter(ADAPTERS[3]).expect("remove");
    let removed = groups(&mut b);
    assert!(removed < with_adapter, "the removed adapter's bind groups go: {with_adapter} -> {removed}");
    // What stays still decodes as a fresh backend does.
    b.set_adapters(&[AdapterWeight::new(ADAPTERS[0], 1.0), AdapterWeight::new(ADAPTERS[2], 0.5)]).expect("pair");
    let got = b.generate_ids(&ids[..5], &params).expect("after");
    let mut fresh = backend().expect("backend");
    fresh.set_adapters(&[AdapterWeight::new(ADAPTERS[0], 1.0), AdapterWeight::new(ADAPTERS[2], 0.5)]).expect("pair");
    assert_eq!(got, fresh.generate_ids(&ids[..5], &params).expect("fresh"));
}
