//! Batched decode: several sessions, each with its own adapter set (one with none), stepped
//! together equal each session stepped alone.

mod common;

use std::sync::Arc;

use common::tolerance::PATHS_REL;
use common::{fixture_model, gpu, rel_and_max, root, Reference};
use qwen35_wgpu::{
    ActiveAdapter, Batch, GenerateParams, LayerScales, LoraAdapter, Model, Proj, RunError, Session, SessionOptions,
};

fn opts() -> SessionOptions {
    SessionOptions { max_context: 64, max_batch: 16 }
}

struct Fixture {
    model: Arc<Model>,
    adapters: Vec<Arc<LoraAdapter>>,
    ids: Vec<u32>,
}

fn fixture() -> Option<Fixture> {
    Some(fixture_with_eos(gpu()?, None))
}

/// The fixture, with `eos` (when given) as the model's EOS ids.
fn fixture_with_eos(ctx: Arc<qwen35_wgpu::GpuContext>, eos: Option<Vec<u32>>) -> Fixture {
    let mut model = Model::load(ctx, &fixture_model("gva_tied_f32")).expect("model");
    if let Some(eos) = eos {
        model.eos_token_ids = eos;
    }
    let model = Arc::new(model);
    let adapters = ["all12_r8", "gdn_mlp_r4_rslora", "patterns_r16"]
        .iter()
        .map(|n| Arc::new(LoraAdapter::load(&model, &root().join("tests/fixtures/adapters").join(n)).expect("adapter")))
        .collect();
    Fixture { model, adapters, ids: Reference::load("adapter_sets").ids("ids") }
}

/// Four sets: one adapter, a stacked pair, none, and an adapter with layer factors.
fn sets(f: &Fixture) -> Vec<Vec<ActiveAdapter>> {
    let a = |i: usize, s: f32| ActiveAdapter::new(f.adapters[i].clone(), s);
    vec![
        vec![a(0, 1.0)],
        vec![a(0, 0.7), a(1, -0.5)],
        vec![],
        vec![a(2, 0.5).with_layers(LayerScales::default().layers(0..2, 0.0).projections(&Proj::ATTENTION, 2.0))],
    ]
}

fn session(f: &Fixture, set: &[ActiveAdapter]) -> Session {
    let mut s = Session::new(f.model.clone(), opts()).expect("session");
    s.set_adapters(set.to_vec()).expect("set");
    s
}

/// The fixture model on a context of its own, for tests that count the engine's work (the
/// shared context counts the work of tests running beside them).
fn model_on_own_context() -> Option<Arc<Model>> {
    gpu()?;
    let ctx = Arc::new(qwen35_wgpu::GpuContext::new().expect("context"));
    Some(Arc::new(Model::load(ctx, &fixture_model("gva_tied_f32")).expect("model")))
}

/// A backend on the fixture model with the named fixture adapters resident, each under its name.
fn fixture_backend(ctx: &Arc<qwen35_wgpu::GpuContext>, adapters: &[&str]) -> qwen35_wgpu::WgpuBackend {
    use qwen35_wgpu::LlmBackend;
    let mut b = qwen35_wgpu::WgpuBackend::with_context(ctx.clone(), opts());
    b.load_model(&fixture_model("gva_tied_f32")).expect("model");
    for name in adapters {
        b.preload_adapter(&root().join("tests/fixtures/adapters").join(name), Some(name)).expect(name);
    }
    b
}

/// What each set's session generates from its prompt on its own.
fn alone(f: &Fixture, sets: &[Vec<ActiveAdapter>], prompts: &[Vec<u32>], params: &GenerateParams) -> Vec<Vec<u32>> {
    sets.iter().zip(prompts).map(|(set, p)| session(f, set).generate(p, params, |_| true).expect("alone")).collect()
}

#[test]
fn a_batched_step_equals_each_session_stepped_alone() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    // Prompts of different lengths: the sessions are at different positions.
    let prompts: Vec<&[u32]> = (0..sets.len()).map(|i| &f.ids[..3 + 2 * i]).collect();
    let mut batch = Batch::new(f.model.clone(), 16).expect("batch");
    // 9 and more rows take the tiled matmul (a per-row scale table in its LoRA K steps).
    for n in [1, 2, 4, 9] {
        let mut alone = Vec::new();
        let mut together: Vec<Session> = Vec::new();
        for (k, set) in sets.iter().cycle().take(n).enumerate() {
            let prompt = prompts[k % prompts.len()];
            let mut s = session(&f, set);
            s.feed(&prompt[..prompt.len() - 1]).expect("prefill");
            let mut t = session(&f, set);
            t.feed(&prompt[..prompt.len() - 1]).expect("prefill");
            alone.push(s.feed(&prompt[prompt.len() - 1..]).expect("alone").data);
            together.push(t);
        }
        let last: Vec<u32> = (0..n).map(|k| *prompts[k % prompts.len()].last().expect("id")).collect();
        let mut rows: Vec<&mut Session> = together.iter_mut().collect();
        let got = batch.step(&mut rows, &last).expect("batched step");
        for (k, want) in alone.iter().enumerate() {
            let (rel, _) = rel_and_max(got.row(k).expect("a row"), want);
            assert!(rel <= PATHS_REL, "n {n}, session {k}: rel {rel:.2e}");
        }
        for (k, s) in together.iter().enumerate() {
            assert_eq!(s.position(), prompts[k % prompts.len()].len(), "the step is committed");
        }
    }
}

/// A snapshot a session's run-ahead step took, the step then discarded (its generation stopped
/// after one token), is not handed over by the batched step that next runs at that position with
/// another token: every snapshot the session hands over restores the states of the tokens it
/// holds.
#[test]
fn a_batched_step_after_a_discarded_run_ahead_keeps_none_of_its_snapshots() {
    let Some(f) = fixture() else { return };
    let prompt = &f.ids[..6];
    let mut s = session(&f, &[]);
    s.set_run_ahead(true);
    s.snapshot_at(prompt.len() + 1, None).expect("a snapshot after the first generated token");
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    let out = s.generate(prompt, &params, |_| false).expect("one token");
    assert_eq!((out.len(), s.position()), (1, prompt.len()), "the run-ahead step is discarded");
    let other = (out[0] + 1) % f.model.config.vocab_size as u32;
    let mut t = session(&f, &[]);
    t.feed(&f.ids[..3]).expect("another session");
    let mut batch = Batch::new(f.model.clone(), 2).expect("batch");
    batch.step(&mut [&mut s, &mut t], &[other, f.ids[3]]).expect("batched step");
    let mut held = prompt.to_vec();
    held.push(other);
    let next = f.ids[7];
    for snap in s.take_snapshots() {
        s.restore(&snap).expect("restore");
        let got = s.feed(&[next]).expect("after the snapshot");
        let want = session(&f, &[]).feed(&[&held[..snap.position()], &[next][..]].concat()).expect("fresh");
        let (rel, _) = rel_and_max(got.last().expect("a row"), want.last().expect("a row"));
        assert!(rel <= PATHS_REL, "snapshot at {}: rel {rel:.2e} against the tokens held", snap.position());
    }
}

#[test]
fn batched_generation_equals_each_session_generating_alone() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    let params = GenerateParams { max_tokens: 6, stop_at_eos: false, ..Default::default() };
    let prompts: Vec<Vec<u32>> = (0..sets.len()).map(|i| f.ids[..4 + i].to_vec()).collect();
    let want = alone(&f, &sets, &prompts, &params);
    assert!(want.iter().any(|w| w != &want[2]), "the sets must change the text for this test to mean anything");
    let mut sessions: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let mut batch = Batch::new(f.model.clone(), 4).expect("batch");
    let got = batch.generate(&mut rows, &refs, &[0; 4], &params).expect("batched");
    assert_eq!(got, want, "batched greedy ids");
    // One row's context holds 2 tokens past its prompt, so it stops after 3 (the last one is
    // chosen from the full context, as alone): the others go on with the kept stack (its
    // adapters' factors zeroed for the finished row).
    let mut sessions: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
    let short = SessionOptions { max_context: prompts[1].len() + 2, max_batch: 16 };
    sessions[1] = Session::new(f.model.clone(), short).expect("session");
    sessions[1].set_adapters(sets[1].clone()).expect("set");
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    let got = batch.generate(&mut rows, &refs, &[0; 4], &params).expect("batched");
    let mut expect = want.clone();
    expect[1].truncate(3);
    assert_eq!(got, expect, "one row stops early, the others as alone");
}

/// Greedy batches with run-ahead off and on (CPU adapters default to off): rows that finish at
/// different steps (one at an EOS, one at its full context, the others at `max_tokens`) get the
/// ids each session gets alone, and every session holds exactly its prompt and the tokens
/// returned but the last (a run-ahead step past a row's end is not committed): continuing it
/// gives what continuing alone gives.
#[test]
fn greedy_batches_run_ahead_and_leave_each_session_holding_its_tokens() {
    let Some(ctx) = gpu() else { return };
    let plain = fixture_with_eos(ctx.clone(), None);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| plain.ids[..4 + i].to_vec()).collect();
    let free = GenerateParams { max_tokens: 6, stop_at_eos: false, ..Default::default() };
    let unstopped = alone(&plain, &sets(&plain), &prompts, &free);
    // Row 0's third token becomes an EOS id.
    let f = fixture_with_eos(ctx, Some(vec![unstopped[0][2]]));
    let sets = sets(&f);
    let params = GenerateParams { stop_at_eos: true, ..free };
    let mut want = alone(&f, &sets, &prompts, &params);
    assert!(want[0].len() <= 3, "row 0 stops at its EOS: {want:?}");
    // Row 1's context holds 2 tokens past its prompt: it stops after 3 (alone: ContextFull).
    want[1].truncate(3);
    assert!(want.iter().any(|w| w.len() == 6), "a row goes on to max_tokens: {want:?}");
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let more = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    for run_ahead in [false, true] {
        let mut sessions: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
        let short = SessionOptions { max_context: prompts[1].len() + 2, max_batch: 16 };
        sessions[1] = Session::new(f.model.clone(), short).expect("session");
        sessions[1].set_adapters(sets[1].clone()).expect("set");
        let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
        let mut batch = Batch::new(f.model.clone(), 4).expect("batch");
        batch.set_run_ahead(run_ahead);
        let got = batch.generate(&mut rows, &refs, &[0; 4], &params).expect("batched");
        assert_eq!(got, want, "batched greedy ids, run-ahead {run_ahead}");
        for (i, s) in sessions.iter_mut().enumerate() {
            let held: Vec<u32> = prompts[i].iter().chain(&got[i]).copied().collect();
            assert_eq!(s.position(), held.len() - 1, "row {i} holds its prompt and tokens but the last");
            if i == 1 {
                continue;
            }
            let went_on = s.generate_from_with(&held, held.len() - 1, &more, |_, _| Ok::<_, RunError>(true));
            let expect = session(&f, &sets[i]).generate(&held, &more, |_| true).expect("alone");
            assert_eq!(went_on.expect("continued"), expect, "row {i} continued, run-ahead {run_ahead}");
        }
    }
}

/// Sessions far apart in their caches (3 to 140 positions: one to three splits of the pooled
/// attention's 64 keys, the grid's splits those of the furthest row) generate together what
/// each generates alone, and the positions the batch wrote go back into each session's cache:
/// continuing alone gives what continuing the session that generated alone gives. The pool
/// holds 256 positions per slot, the sessions' caches 512 (the strides differ). Released pools
/// come back for the next generation, and a generation without a token limit runs each row to
/// its full context.
#[test]
fn batched_generation_over_caches_of_several_splits_equals_each_session_alone() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    let long = SessionOptions { max_context: 512, max_batch: 16 };
    let prompts: Vec<Vec<u32>> =
        [3, 140, 70, 66].iter().map(|&n| f.ids.iter().cycle().take(n).copied().collect()).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    let more = GenerateParams { max_tokens: 3, ..params.clone() };
    let new_session = |set: &[ActiveAdapter]| {
        let mut s = Session::new(f.model.clone(), long.clone()).expect("session");
        s.set_adapters(set.to_vec()).expect("set");
        s
    };
    let mut want = Vec::new();
    let mut went_on = Vec::new();
    for (set, prompt) in sets.iter().zip(&prompts) {
        let mut s = new_session(set);
        let ids = s.generate(prompt, &params, |_| true).expect("alone");
        let held: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
        let next = s.generate_from_with(&held, held.len() - 1, &more, |_, _| Ok::<_, RunError>(true));
        went_on.push(next.expect("alone, continued"));
        want.push(ids);
    }
    let mut sessions: Vec<Session> = sets.iter().map(|set| new_session(set)).collect();
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    let mut batch = Batch::new(f.model.clone(), 4).expect("batch");
    let got = batch.generate(&mut rows, &refs, &[0; 4], &params).expect("batched");
    assert_eq!(got, want, "batched greedy ids");
    for (i, s) in sessions.iter_mut().enumerate() {
        let held: Vec<u32> = prompts[i].iter().chain(&got[i]).copied().collect();
        let next = s.generate_from_with(&held, held.len() - 1, &more, |_, _| Ok::<_, RunError>(true));
        assert_eq!(next.expect("continued"), went_on[i], "row {i} continued after the batch");
    }
    batch.release_pools();
    assert_eq!(batch.cached_bind_groups(), 0, "the released pools' bind groups went with them");
    // Contexts ending 2 to 5 tokens past the prompts: without a token limit each row stops at
    // its full context with 3 to 6 tokens, what a limit past every row's room gives.
    let run = |max_tokens: usize, batch: &mut Batch| {
        let mut sessions: Vec<Session> = sets
            .iter()
            .zip(&prompts)
            .enumerate()
            .map(|(i, (set, p))| {
                let mut s =
                    Session::new(f.model.clone(), SessionOptions { max_context: p.len() + 2 + i, max_batch: 16 })
                        .expect("session");
                s.set_adapters(set.to_vec()).expect("set");
                s
            })
            .collect();
        let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
        batch.generate(&mut rows, &refs, &[0; 4], &GenerateParams { max_tokens, ..params.clone() }).expect("batched")
    };
    let unlimited = run(usize::MAX, &mut batch);
    assert_eq!(unlimited.iter().map(Vec::len).collect::<Vec<_>>(), [3, 4, 5, 6], "each row to its full context");
    assert_eq!(unlimited, run(10, &mut batch), "no limit is a limit past every row's room");
}

/// A batch of one runs its session's own generation (single-token steps with the block norms
/// folded into the projections: as many dispatches as the session alone, fewer than a batched
/// step's), under the batch's run-ahead, and stops where a batch stops a row whose context is
/// full instead of failing with `ContextFull` as the session alone does.
#[test]
fn a_batch_of_one_is_its_sessions_own_generation() {
    let Some(model) = model_on_own_context() else { return };
    let adapter = LoraAdapter::load(&model, &root().join("tests/fixtures/adapters/all12_r8")).expect("adapter");
    let set = vec![ActiveAdapter::new(Arc::new(adapter), 1.0)];
    let ids = Reference::load("adapter_sets").ids("ids");
    let prompt = &ids[..5];
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    let new_session = |opts: SessionOptions, run_ahead: bool| {
        let mut s = Session::new(model.clone(), opts).expect("session");
        s.set_adapters(set.clone()).expect("set");
        s.set_run_ahead(run_ahead);
        s
    };
    let mut batch = Batch::new(model.clone(), 2).expect("batch");
    for run_ahead in [false, true] {
        let mut s = new_session(opts(), run_ahead);
        let before = model.ctx.counters();
        let want = s.generate(prompt, &params, |_| true).expect("alone");
        let alone = (model.ctx.counters() - before).dispatches;
        batch.set_run_ahead(run_ahead);
        let mut one = new_session(opts(), !run_ahead);
        let before = model.ctx.counters();
        let got = batch.generate(&mut [&mut one], &[prompt], &[0], &params).expect("batch of one");
        assert_eq!((model.ctx.counters() - before).dispatches, alone, "the session's own steps, run-ahead {run_ahead}");
        assert_eq!(got, vec![want.clone()], "run-ahead {run_ahead}");
        assert_eq!(one.run_ahead(), !run_ahead, "the session keeps its own run-ahead setting");
        assert_eq!(one.position(), prompt.len() + want.len() - 1);
        // Two batched rows take more dispatches per step than the one row did in all.
        let mut pair = [new_session(opts(), false), new_session(opts(), false)];
        let mut rows: Vec<&mut Session> = pair.iter_mut().collect();
        let before = model.ctx.counters();
        let two = batch.generate(&mut rows, &[prompt, prompt], &[0, 0], &params).expect("batch of two");
        assert_eq!(two, vec![want.clone(), want.clone()]);
        assert!((model.ctx.counters() - before).dispatches > alone, "the batched step is the slower path for one row");
        // Room for 2 tokens past the prompt: the batch returns 3, the session alone fails.
        let short = SessionOptions { max_context: prompt.len() + 2, max_batch: 16 };
        let err = new_session(short.clone(), run_ahead).generate(prompt, &params, |_| true);
        assert!(matches!(err, Err(RunError::ContextFull { .. })), "{err:?}");
        let got = batch.generate(&mut [&mut new_session(short, run_ahead)], &[prompt], &[0], &params).expect("short");
        assert_eq!(got, vec![want[..3].to_vec()], "run-ahead {run_ahead}");
    }
}

#[test]
fn greedy_batches_choose_on_the_gpu_and_read_back_eight_bytes_a_row() {
    let Some(model) = model_on_own_context() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let params = GenerateParams { max_tokens: 5, stop_at_eos: false, ..Default::default() };
    let prompts: Vec<&[u32]> = (0..3).map(|i| &ids[..4 + i]).collect();
    let mut sessions: Vec<Session> = (0..3).map(|_| Session::new(model.clone(), opts()).expect("session")).collect();
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    let mut batch = Batch::new(model.clone(), 3).expect("batch");
    let before = model.ctx.counters();
    let got = batch.generate(&mut rows, &prompts, &[0; 3], &params).expect("batched");
    let used = model.ctx.counters() - before;
    assert!(got.iter().all(|g| g.len() == 5));
    assert_eq!(used.read_back, 5 * 3 * 8, "per step and row only the chosen id and its non-finite flag");
}

#[test]
fn a_profiled_batch_times_every_dispatch_of_its_steps() {
    let Some(model) = model_on_own_context() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let mut sessions: Vec<Session> = (0..3).map(|_| Session::new(model.clone(), opts()).expect("session")).collect();
    let mut batch = Batch::new(model.clone(), 3).expect("batch");
    let has = model.ctx.features.contains(wgpu::Features::TIMESTAMP_QUERY);
    assert_eq!(batch.start_profile(), has, "profiling needs timestamps");
    let mut counted = 0;
    for step in 0..2 {
        let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
        let before = model.ctx.counters();
        batch.step(&mut rows, &ids[step..step + 3]).expect("step");
        counted += (model.ctx.counters() - before).dispatches;
    }
    let profile = batch.take_profile();
    assert!(batch.take_profile().is_none(), "taking the profile stops profiling");
    if !has {
        assert!(profile.is_none());
        return;
    }
    let profile = profile.expect("profiled");
    assert_eq!(profile.submits.len(), 2, "one list per step");
    let timed: Vec<_> = profile.submits.iter().flatten().collect();
    assert_eq!(timed.len() as u64, counted, "every dispatch the engine counted is timed");
    assert!(timed.iter().all(|t| t.ns.is_finite() && t.ns >= 0.0));
    assert!(timed.iter().any(|t| t.family == "matvec_batch" && t.weight_bytes > 0), "the projections of 3 rows");
}

/// `Batch::generate` steps a GDN layer of all its rows in one `gdn_decode` dispatch (on the
/// batch's pooled states) and attends an attention layer of all its rows in one `attend_rows`
/// dispatch and its merge (on the batch's pooled caches), where `Batch::step` dispatches each
/// once per session.
#[test]
fn batched_generation_steps_each_mixer_layer_of_all_rows_together() {
    let Some(model) = model_on_own_context() else { return };
    let count = |linear: bool| {
        let is = |t: &&qwen35_wgpu::model::LayerType| matches!(t, qwen35_wgpu::model::LayerType::Linear) == linear;
        model.config.layer_types.iter().filter(is).count()
    };
    let (gdn_layers, attn_layers) = (count(true), count(false));
    assert!(gdn_layers > 0 && attn_layers > 0, "the fixture has both kinds of layers");
    let ids = Reference::load("adapter_sets").ids("ids");
    let mut sessions: Vec<Session> = (0..3).map(|_| Session::new(model.clone(), opts()).expect("session")).collect();
    let mut batch = Batch::new(model.clone(), 3).expect("batch");
    if !batch.start_profile() {
        return;
    }
    let gdn = |submit: &Vec<qwen35_wgpu::gpu::Timed>| submit.iter().filter(|t| t.family == "gdn_decode").count();
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    batch.step(&mut rows, &ids[..3]).expect("step");
    let prompts: Vec<&[u32]> = (0..3).map(|i| &ids[3 + i..4 + i]).collect();
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    batch.generate(&mut rows, &prompts, &[0; 3], &params).expect("generate");
    let profile = batch.take_profile().expect("profiled");
    let per_submit: Vec<usize> = profile.submits.iter().map(gdn).collect();
    assert_eq!(per_submit, [3 * gdn_layers, gdn_layers, gdn_layers, gdn_layers], "a step, then 3 pooled steps");
    let attend = |family: &'static str| {
        move |submit: &Vec<qwen35_wgpu::gpu::Timed>| submit.iter().filter(|t| t.family == family).count()
    };
    let one: Vec<usize> = profile.submits.iter().map(attend("attend_one")).collect();
    let rows: Vec<usize> = profile.submits.iter().map(attend("attend_rows")).collect();
    assert_eq!(one, [3 * attn_layers, 0, 0, 0], "a step attends per session");
    assert_eq!(rows, [0, attn_layers, attn_layers, attn_layers], "the pooled steps attend all rows at once");
}

/// A batched step of 2 to 8 rows runs each layer's input projections (q|k|v, or GDN's qkv, z, b
/// and a) in one batched matvec dispatch with every row's LoRA segments, whatever the rows'
/// adapter sets: per layer that, the mixer's output projection, gate|up with SwiGLU and
/// down_proj; and lm_head once. The block norms have no dispatch of their own.
#[test]
fn a_batched_step_projects_each_layers_inputs_in_one_dispatch() {
    let Some(_) = gpu() else { return };
    // A context of its own: the profile counts only this test's work.
    let f = fixture_with_eos(Arc::new(qwen35_wgpu::GpuContext::new().expect("context")), None);
    let model = f.model.clone();
    let mut sessions: Vec<Session> = sets(&f).iter().map(|set| session(&f, set)).collect();
    let mut batch = Batch::new(model.clone(), 4).expect("batch");
    if !batch.start_profile() {
        return;
    }
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    batch.step(&mut rows, &f.ids[..4]).expect("step");
    let profile = batch.take_profile().expect("profiled");
    let mut families = std::collections::BTreeMap::new();
    for t in &profile.submits[0] {
        *families.entry(t.family).or_insert(0) += 1;
    }
    // Every layer's projections are adapted by some row (the first set's adapter is on all 12).
    let count = |k: &str| families.get(k).copied().unwrap_or(0);
    assert_eq!(
        (count("matvec_batch_lora"), count("matvec_batch")),
        (4 * model.layers.len(), 1),
        "batched matvec dispatches per step: {families:?}"
    );
    // The block norms and the final norm fold into the projections that read them (and their
    // shrinks): no norm dispatch.
    assert_eq!(count("rms_norm") + count("rms_norm_shrink"), 0, "norm dispatches per step: {families:?}");
}

/// A batched generation's pooled steps shrink each mixer layer's output (o_proj's / out_proj's
/// LoRA input) in the mixer's own dispatch, every row's parts split by head and summed by the
/// projection: the shrinks left are each layer's mixer input, MLP input and down_proj input.
#[test]
fn a_batched_generation_shrinks_each_mixer_output_in_the_mixer_dispatch() {
    let Some(_) = gpu() else { return };
    // A context of its own: the profile counts only this test's work.
    let f = fixture_with_eos(Arc::new(qwen35_wgpu::GpuContext::new().expect("context")), None);
    let c = &f.model.config;
    let gdn_layers = c.layer_types.iter().filter(|t| matches!(t, qwen35_wgpu::model::LayerType::Linear)).count();
    let attn_layers = c.layer_types.len() - gdn_layers;
    let mut sessions: Vec<Session> = sets(&f).iter().map(|set| session(&f, set)).collect();
    let mut batch = Batch::new(f.model.clone(), 4).expect("batch");
    if !batch.start_profile() {
        return;
    }
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    let prompts: Vec<&[u32]> = (0..4).map(|i| &f.ids[i..i + 1]).collect();
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    batch.generate(&mut rows, &prompts, &[0; 4], &params).expect("generate");
    let profile = batch.take_profile().expect("profiled");
    let mut pooled = 0;
    for submit in &profile.submits {
        let count = |family: &str| submit.iter().filter(|t| t.family == family).count();
        if count("gdn_decode_lora") == 0 {
            continue;
        }
        pooled += 1;
        let got = (count("gdn_decode_lora"), count("gdn_decode"), count("attend_rows_merge_lora"));
        assert_eq!(got, (gdn_layers, 0, attn_layers), "the mixers write the shrink parts");
        assert_eq!(count("attend_rows_merge"), 0, "every attention layer's merge writes them");
        assert_eq!(count("lora_shrink"), 3 * c.layer_types.len(), "shrinks per pooled step");
    }
    assert_eq!(pooled, 3, "each pooled step of the generation");
}

#[test]
fn sampled_batched_generation_draws_what_each_session_draws_alone() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    // Qwen 3.5's non-thinking settings, and a repetition penalty without top-k (the whole row).
    let settings = [
        GenerateParams { temperature: 0.7, top_k: 20, top_p: 0.8, seed: 11, ..Default::default() },
        GenerateParams { temperature: 1.0, top_p: 0.9, repetition_penalty: 1.3, seed: 5, ..Default::default() },
    ];
    for base in settings {
        let params = GenerateParams { max_tokens: 6, stop_at_eos: false, ..base };
        let prompts: Vec<Vec<u32>> = (0..sets.len()).map(|i| f.ids[..4 + i].to_vec()).collect();
        let want = alone(&f, &sets, &prompts, &params);
        let mut sessions: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
        let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
        let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
        let got = Batch::new(f.model.clone(), 4).expect("batch").generate(&mut rows, &refs, &[0; 4], &params);
        assert_eq!(got.expect("batched"), want, "sampled ids with {params:?}");
    }
}

/// `generate_with`'s callback sees every row's tokens as they come, and a `false` ends that row
/// there (the token stays its last, the session holding the tokens before it, as at an EOS:
/// continuing it gives what continuing alone gives), greedy with run-ahead off and on, and
/// sampled, while the other rows go on as alone; a batch of one stops the same way.
#[test]
fn a_batch_ends_a_row_where_its_callback_says_and_the_others_go_on() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    let prompts: Vec<Vec<u32>> = (0..sets.len()).map(|i| f.ids[..4 + i].to_vec()).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    // Row 1 ends after its second token, row 3 after its first.
    let ends = [None, Some(2), None, Some(1)];
    let greedy = GenerateParams { max_tokens: 5, stop_at_eos: false, ..Default::default() };
    let sampled = GenerateParams { temperature: 0.7, top_k: 20, seed: 3, ..greedy.clone() };
    let more = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    for (params, run_ahead) in [(&greedy, false), (&greedy, true), (&sampled, false)] {
        let mut batch = Batch::new(f.model.clone(), 4).expect("batch");
        batch.set_run_ahead(run_ahead);
        let want = alone(&f, &sets, &prompts, params);
        let mut sessions: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
        let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
        let mut seen: Vec<Vec<u32>> = vec![Vec::new(); sets.len()];
        let got = batch
            .generate_with(&mut rows, &refs, &[0; 4], params, &mut |i, id| {
                seen[i].push(id);
                ends[i].is_none_or(|end| seen[i].len() < end)
            })
            .expect("batched");
        assert_eq!(seen, got, "the callback saw every token of every row, in order");
        for (k, end) in ends.iter().enumerate() {
            let mut expect = want[k].clone();
            expect.truncate(end.unwrap_or(expect.len()));
            assert_eq!(got[k], expect, "row {k} with {params:?}, run-ahead {run_ahead}");
            let held: Vec<u32> = prompts[k].iter().chain(&got[k]).copied().collect();
            assert_eq!(sessions[k].position(), held.len() - 1, "row {k} holds its tokens but the last");
            let went_on = sessions[k].generate_from_with(&held, held.len() - 1, &more, |_, _| Ok::<_, RunError>(true));
            let fresh = session(&f, &sets[k]).generate(&held, &more, |_| true).expect("alone");
            assert_eq!(went_on.expect("continued"), fresh, "row {k} continued, run-ahead {run_ahead}");
        }
        let mut one = session(&f, &sets[0]);
        let mut calls = 0;
        let got = batch
            .generate_with(&mut [&mut one], &refs[..1], &[0], params, &mut |_, _| {
                calls += 1;
                calls < 2
            })
            .expect("a batch of one");
        assert_eq!(got, vec![want[0][..2].to_vec()], "a batch of one with {params:?}");
        assert_eq!(one.position(), prompts[0].len() + 1, "the batch of one's session holds its tokens but the last");
    }
}

#[test]
fn sampled_batches_read_back_each_rows_candidates_as_a_session_alone_does() {
    let Some(model) = model_on_own_context() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let prompts: Vec<&[u32]> = (0..3).map(|i| &ids[..4 + i]).collect();
    let settings = [
        GenerateParams { temperature: 0.7, top_k: 20, top_p: 0.8, seed: 11, ..Default::default() },
        GenerateParams { temperature: 1.0, top_p: 0.9, repetition_penalty: 1.3, seed: 5, ..Default::default() },
    ];
    for base in settings {
        let params = GenerateParams { max_tokens: 5, stop_at_eos: false, ..base };
        let before = model.ctx.counters();
        let mut want = Vec::new();
        for p in &prompts {
            let mut s = Session::new(model.clone(), opts()).expect("session");
            want.push(s.generate(p, &params, |_| true).expect("alone"));
        }
        let alone = model.ctx.counters() - before;
        let mut sessions: Vec<Session> =
            (0..3).map(|_| Session::new(model.clone(), opts()).expect("session")).collect();
        let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
        let mut batch = Batch::new(model.clone(), 3).expect("batch");
        let before = model.ctx.counters();
        let got = batch.generate(&mut rows, &prompts, &[0; 3], &params).expect("batched");
        let used = model.ctx.counters() - before;
        assert_eq!(got, want, "sampled ids with {params:?}");
        // Alone, a step reads back its candidates (and the whole row only where they cannot
        // decide); a batch reading every row whole would differ.
        assert_eq!(used.read_back, alone.read_back, "bytes read back with {params:?}");
    }
}

#[test]
fn batches_with_and_without_adapters_in_turn_build_nothing_new() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    let mut batch = Batch::new(f.model.clone(), 2).expect("batch");
    let mut with = session(&f, &sets[0]);
    let mut without = session(&f, &sets[2]);
    let mut kept = Vec::new();
    for round in 0..5 {
        let mut rows = vec![&mut with, &mut without];
        batch.step(&mut rows, &f.ids[round..round + 2]).expect("rows with an adapter");
        let mut rows = vec![&mut without];
        batch.step(&mut rows, &f.ids[round..round + 1]).expect("rows without");
        kept.push(batch.cached_bind_groups());
    }
    // The first rounds built every bind group the two kinds of steps use (the uniform arena may
    // grow once, rebuilding them); later rounds reuse them (a LoRA buffer made anew per switch
    // would add bind groups, each keeping its buffer alive).
    assert!(kept[2..].iter().all(|&k| k == kept[1]), "bind groups kept after each round: {kept:?}");
}

/// 33 sessions generate together (the pools' 64 slots; two `attend_rows` pairs per attention
/// layer, the second for row 32) what each generates alone, whatever its adapter set and
/// position.
#[test]
fn a_generation_of_more_rows_than_one_attention_dispatch_takes_equals_each_alone() {
    let Some(f) = fixture() else { return };
    let sets = sets(&f);
    let n = qwen35_wgpu::kernels::attention::ATTN_MAX_ROWS + 1;
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    let row_sets: Vec<Vec<ActiveAdapter>> = sets.iter().cycle().take(n).cloned().collect();
    let prompts: Vec<Vec<u32>> =
        (0..n).map(|i| f.ids.iter().cycle().skip(i).take(2 + i % 7).copied().collect()).collect();
    let want = alone(&f, &row_sets, &prompts, &params);
    let mut sessions: Vec<Session> = row_sets.iter().map(|set| session(&f, set)).collect();
    let mut rows: Vec<&mut Session> = sessions.iter_mut().collect();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let mut batch = Batch::new(f.model.clone(), n).expect("batch");
    let got = batch.generate(&mut rows, &refs, &vec![0; n], &params).expect("batched");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "row {i}");
    }
}

#[test]
fn bad_batches_are_typed_errors_and_change_nothing() {
    let Some(f) = fixture() else { return };
    let mut batch = Batch::new(f.model.clone(), 2).expect("batch");
    let mut a = session(&f, &[]);
    let mut b = session(&f, &[]);
    a.feed(&f.ids[..3]).expect("prefill");
    let other = Arc::new(Model::load(f.model.ctx.clone(), &fixture_model("gva_tied_f32")).expect("model"));
    let mut foreign = Session::new(other, opts()).expect("session");
    let mut c = session(&f, &[]);
    let mut rows = vec![&mut a, &mut b];
    assert!(matches!(batch.step(&mut rows, &[1]), Err(RunError::BadParam { .. })), "one id per session");
    let mut rows = vec![&mut a, &mut foreign];
    assert!(matches!(batch.step(&mut rows, &[1, 2]), Err(RunError::BadParam { .. })), "a session of another model");
    let mut rows = vec![&mut a, &mut b, &mut c];
    assert!(matches!(batch.step(&mut rows, &[1, 2, 3]), Err(RunError::BadParam { .. })), "more rows than the batch");
    let mut rows = vec![&mut a, &mut b];
    assert!(matches!(batch.step(&mut rows, &[1, u32::MAX]), Err(RunError::TokenOutOfRange { .. })));
    assert_eq!((a.position(), b.position()), (3, 0), "refused steps change no session");
    // A prompt whose held part (fed) has an id past the vocabulary: refused, not indexed with.
    let mut held = f.ids[..4].to_vec();
    held[1] = u32::MAX;
    let sampled =
        GenerateParams { temperature: 100.0, top_p: 0.9, repetition_penalty: 1.1, max_tokens: 2, ..Default::default() };
    let mut rows = vec![&mut a, &mut b];
    let refused = batch.generate(&mut rows, &[&held, &f.ids[..2]], &[3, 0], &sampled);
    assert!(matches!(refused, Err(RunError::TokenOutOfRange { index: 1, .. })), "{refused:?}");
    let alone = a.generate_from_with(&held, 3, &sampled, |_, _| Ok::<_, RunError>(true));
    assert!(matches!(alone, Err(RunError::TokenOutOfRange { index: 1, .. })), "{alone:?}");
    assert_eq!((a.position(), b.position()), (3, 0), "refused requests change no session");
    assert!(matches!(Batch::new(f.model.clone(), 0), Err(RunError::BadParam { .. })));
}

#[test]
fn the_backend_decodes_its_sessions_together_with_their_prompt_caches() {
    use qwen35_wgpu::{AdapterWeight, BackendError, LlmBackend};
    let Some(ctx) = gpu() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let make = || fixture_backend(&ctx, &["all12_r8", "gdn_mlp_r4_rslora"]);
    let sets = [
        vec![AdapterWeight::new("all12_r8", 1.0)],
        vec![],
        vec![AdapterWeight::new("all12_r8", 0.5), AdapterWeight::new("gdn_mlp_r4_rslora", 1.0)],
    ];
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    // Two requests per session: the second prompt extends the first and its reply.
    let turns = |first: &[u32], reply: &[u32], k: usize| -> Vec<u32> {
        let mut p = first.to_vec();
        p.extend(reply);
        p.extend(&ids[k..k + 2]);
        p
    };
    let mut want = Vec::new();
    for (k, set) in sets.iter().enumerate() {
        let mut b = make();
        b.set_adapters(set).expect("set");
        let first = &ids[..3 + k];
        let r1 = b.generate_ids(first, &params).expect("alone");
        let r2 = b.generate_ids(&turns(first, &r1, k), &params).expect("alone");
        want.push((r1, r2));
    }
    let mut b = make();
    let mut sids = vec![b.current_session().expect("session")];
    sids.extend((1..sets.len()).map(|_| b.create_session().expect("session")));
    for (sid, set) in sids.iter().zip(&sets) {
        b.select_session(*sid).expect("select");
        b.set_adapters(set).expect("set");
    }
    let firsts: Vec<&[u32]> = (0..sets.len()).map(|k| &ids[..3 + k]).collect();
    let requests: Vec<_> = sids.iter().copied().zip(firsts.iter().copied()).collect();
    let r1 = b.generate_batch(&requests, &params).expect("batch 1");
    let seconds: Vec<Vec<u32>> = (0..sets.len()).map(|k| turns(firsts[k], &r1[k], k)).collect();
    let requests: Vec<_> = sids.iter().copied().zip(seconds.iter().map(|p| p.as_slice())).collect();
    let r2 = b.generate_batch(&requests, &params).expect("batch 2");
    for k in 0..sets.len() {
        assert_eq!((&r1[k], &r2[k]), (&want[k].0, &want[k].1), "session {k}");
        b.select_session(sids[k]).expect("select");
        let stats = b.prompt_cache().expect("cache").stats();
        assert!(stats.reused_tokens > 0, "session {k}: the second request reused the first: {stats:?}");
    }
    let twice = [(sids[0], firsts[0]), (sids[0], firsts[0])];
    assert!(matches!(b.generate_batch(&twice, &params), Err(BackendError::Sessions { .. })));
    assert!(matches!(b.generate_batch(&[(999, firsts[0])], &params), Err(BackendError::UnknownSession { .. })));
    // Stop strings need text: refused, not ignored.
    let stop = GenerateParams { stop: vec!["x".into()], ..params.clone() };
    let refused = b.generate_batch(&[(sids[0], firsts[0])], &stop);
    assert!(matches!(refused, Err(BackendError::Run(RunError::BadParam { name: "stop", .. }))), "{refused:?}");
    // A refused request (a token outside the vocabulary) leaves the session's cache: the next
    // request goes on from it.
    b.select_session(sids[0]).expect("select");
    let mut next = seconds[0].clone();
    next.extend(&r2[0]);
    let mut bad = next.clone();
    bad.push(u32::MAX);
    let refused = b.generate_ids(&bad, &params);
    assert!(matches!(refused, Err(BackendError::Run(RunError::TokenOutOfRange { .. }))), "{refused:?}");
    let before = b.prompt_cache().expect("cache").stats();
    next.extend(&ids[..2]);
    b.generate_ids(&next, &params).expect("after a refused request");
    let after = b.prompt_cache().expect("cache").stats();
    assert!(
        after.reused_tokens - before.reused_tokens >= seconds[0].len() as u64,
        "reused {} of {} tokens",
        after.reused_tokens - before.reused_tokens,
        next.len()
    );
}

/// Sessions applying more distinct adapters together than one step binds (`MAX_SET`) still run in
/// one call: as consecutive batches, each request generating what it generates alone, its tokens
/// handed to the callback under its own index.
#[test]
fn a_batch_of_more_adapters_than_one_step_binds_runs_as_several() {
    use qwen35_wgpu::{AdapterWeight, LlmBackend};
    let Some(ctx) = gpu() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let n = qwen35_wgpu::lora::MAX_SET + 3;
    let path = root().join("tests/fixtures/adapters/all12_r8");
    let scale = |k: usize| 0.25 + 0.1 * k as f32;
    let prompt = |k: usize| &ids[..2 + k % 5];
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    let mut alone = fixture_backend(&ctx, &["all12_r8"]);
    let want: Vec<Vec<u32>> = (0..n)
        .map(|k| {
            alone.set_adapters(&[AdapterWeight::new("all12_r8", scale(k))]).expect("set");
            alone.generate_ids(prompt(k), &params).expect("alone")
        })
        .collect();
    let mut b = fixture_backend(&ctx, &[]);
    let mut sids = vec![b.current_session().expect("session")];
    sids.extend((1..n).map(|_| b.create_session().expect("session")));
    for (k, sid) in sids.iter().enumerate() {
        // Each session its own resident copy: n distinct adapters in all.
        let id = b.preload_adapter(&path, Some(&format!("copy{k}"))).expect("copy");
        b.select_session(*sid).expect("select");
        b.set_adapters(&[AdapterWeight::new(&id, scale(k))]).expect("set");
    }
    let requests: Vec<_> = sids.iter().enumerate().map(|(k, &sid)| (sid, prompt(k))).collect();
    let mut streamed = vec![Vec::new(); n];
    let got = b
        .generate_batch_with(&requests, &params, &mut |i, token| {
            streamed[i].push(token);
            true
        })
        .expect("a batch past MAX_SET adapters");
    assert_eq!(got, want, "each request as alone");
    assert_eq!(streamed, want, "the callback's tokens under each request's index");
}

/// A request its callback stopped early leaves its session's prompt cache holding what it
/// generated: the next batch, whose prompt extends that prompt and its tokens, prefills only the
/// new tokens and generates what a fresh backend generates from the whole prompt.
#[test]
fn a_request_stopped_in_a_batch_keeps_its_prompt_cache() {
    use qwen35_wgpu::{AdapterWeight, LlmBackend};
    let Some(ctx) = gpu() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let make = || fixture_backend(&ctx, &["all12_r8"]);
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    let mut b = make();
    let sids = [b.current_session().expect("session"), b.create_session().expect("session")];
    b.select_session(sids[1]).expect("select");
    b.set_adapters(&[AdapterWeight::new("all12_r8", 1.0)]).expect("set");
    let firsts = [&ids[..4], &ids[..5]];
    let requests: Vec<_> = sids.iter().copied().zip(firsts).collect();
    // Request 0 stops after its first token.
    let r1 = b.generate_batch_with(&requests, &params, &mut |i, _| i != 0).expect("batch 1");
    assert_eq!(r1[0].len(), 1, "request 0 stopped after one token");
    assert_eq!(r1[1].len(), 4, "request 1 went on");
    let seconds: Vec<Vec<u32>> = (0..2).map(|k| [firsts[k], &r1[k], &ids[6..8]].concat()).collect();
    let before: Vec<u64> = sids
        .iter()
        .map(|&sid| {
            b.select_session(sid).expect("select");
            b.prompt_cache().expect("cache").stats().reused_tokens
        })
        .collect();
    let requests: Vec<_> = sids.iter().copied().zip(seconds.iter().map(|p| p.as_slice())).collect();
    let r2 = b.generate_batch(&requests, &params).expect("batch 2");
    for k in 0..2 {
        b.select_session(sids[k]).expect("select");
        let reused = b.prompt_cache().expect("cache").stats().reused_tokens - before[k];
        assert!(reused >= firsts[k].len() as u64, "session {k} reused {reused} tokens");
        let mut fresh = make();
        if k == 1 {
            fresh.set_adapters(&[AdapterWeight::new("all12_r8", 1.0)]).expect("set");
        }
        assert_eq!(r2[k], fresh.generate_ids(&seconds[k], &params).expect("alone"), "session {k}");
    }
}

#[test]
fn a_learning_step_between_batches_reaches_the_next_batch() {
    use qwen35_wgpu::{LearnOptions, LlmBackend, Signal, TokenEvent, TrainSpec};
    let Some(ctx) = gpu() else { return };
    let ids = Reference::load("adapter_sets").ids("ids");
    let mut b = fixture_backend(&ctx, &["all12_r8"]);
    let learner = b.current_session().expect("session");
    b.create_trainable_adapter(&TrainSpec { rank: 4, ..TrainSpec::default() }).expect("trainable");
    let other = b.create_session().expect("session");
    b.select_session(other).expect("select");
    b.activate_adapter("all12_r8", 1.0).expect("all12_r8");
    let params = GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() };
    let prompt = &ids[..5];
    let before = b.generate_batch(&[(learner, prompt), (other, prompt)], &params).expect("batch 1");
    b.select_session(learner).expect("select");
    let events = [TokenEvent { prompt: ids[..4].to_vec(), response: ids[4..8].to_vec(), signal: Signal::Preferred }];
    for _ in 0..5 {
        b.learn_tokens(&events, &LearnOptions { lr: 5e-2, ..LearnOptions::default() }).expect("step");
    }
    let want = b.generate_ids(prompt, &params).expect("alone after the steps");
    assert_ne!(want, before[0], "the steps must change the greedy tokens for this test to mean anything");
    // A closed session drops the batch's buffers; the next batch makes new ones.
    let gone = b.create_session().expect("session");
    b.close_session(gone).expect("close");
    let got = b.generate_batch(&[(learner, prompt), (other, prompt)], &params).expect("batch 2");
    assert_eq!(got[0], want, "the batch decodes with the stepped weights");
}

/// A `CancelFlag` in the params stops a generation at the next token it chooses (handed to the
/// callback, and the last), whoever raises it and whether or not a callback would stop: a
/// session's greedy (run-ahead off and on) and sampled generation, every row of a batch, and
/// the backend's token generation; a flag raised before the first choice stops the prefill
/// between chunks and chooses nothing.
#[test]
fn a_raised_cancel_flag_ends_generation_at_its_next_token() {
    use qwen35_wgpu::{CancelFlag, LlmBackend};
    let Some(f) = fixture() else { return };
    let prompt = &f.ids[..5];
    let flagged = |flag: &CancelFlag, sampled: bool| GenerateParams {
        max_tokens: 8,
        stop_at_eos: false,
        temperature: if sampled { 0.8 } else { 0.0 },
        top_k: if sampled { 20 } else { 0 },
        seed: 3,
        cancel: Some(flag.clone()),
        ..Default::default()
    };
    for (run_ahead, sampled) in [(false, false), (true, false), (false, true)] {
        let flag = CancelFlag::new();
        let mut s = session(&f, &sets(&f)[0]);
        s.set_run_ahead(run_ahead);
        let mut seen = 0;
        let out = s
            .generate(prompt, &flagged(&flag, sampled), |_| {
                seen += 1;
                if seen == 2 {
                    flag.raise();
                }
                true
            })
            .expect("generate");
        assert_eq!((out.len(), seen), (2, 2), "run-ahead {run_ahead}, sampled {sampled}");
        assert_eq!(s.position(), prompt.len() + 1, "the session holds the tokens before the last");
        // A clone armed after the raise counts only later raises.
        let again = s.generate(&[out[1]], &flagged(&flag.armed(), sampled), |_| true).expect("armed");
        assert_eq!(again.len(), 8, "an armed clone runs to max_tokens");
    }
    // A batch: raised at row 0's first token, every row ends at its next one.
    let flag = CancelFlag::new();
    let sets = sets(&f);
    let mut rows: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
    let prompts: Vec<&[u32]> = (0..rows.len()).map(|k| &f.ids[..3 + k]).collect();
    let mut batch = Batch::new(f.model.clone(), rows.len()).expect("batch");
    let mut refs: Vec<&mut Session> = rows.iter_mut().collect();
    let fed = vec![0; prompts.len()];
    let out = batch
        .generate_with(&mut refs, &prompts, &fed, &flagged(&flag, false), &mut |i, _| {
            if i == 0 {
                flag.raise();
            }
            true
        })
        .expect("batch");
    assert!(out.iter().all(|o| !o.is_empty() && o.len() <= 2), "rows end at their next token: {out:?}");
    // Raised before the generation starts: nothing runs, also where the prompt spans several
    // prefill chunks (max_batch 16), greedy, sampled and batched.
    let long: Vec<u32> = f.ids.iter().cycle().take(40).copied().collect();
    for sampled in [false, true] {
        let flag = CancelFlag::new();
        flag.raise();
        let mut s = session(&f, &sets[0]);
        let out = s.generate(&long, &flagged(&flag, sampled), |_| true).expect("generate");
        assert_eq!((out.len(), s.position()), (0, 0), "raised before a {}-token prompt, sampled {sampled}", long.len());
    }
    let flag = CancelFlag::new();
    flag.raise();
    let mut rows: Vec<Session> = sets.iter().map(|set| session(&f, set)).collect();
    let mut refs: Vec<&mut Session> = rows.iter_mut().collect();
    let prompts = vec![long.as_slice(); refs.len()];
    let out = batch.generate_with(&mut refs, &prompts, &fed, &flagged(&flag, false), &mut |_, _| true).expect("batch");
    assert!(out.iter().all(Vec::is_empty), "a batch raised before it starts: {out:?}");
    assert!(rows.iter().all(|r| r.position() == 0), "no row ran a chunk");
    // prefill_until runs every chunk while the flag is down, the state prefill's own, and none
    // once it is raised.
    let flag = CancelFlag::new();
    let (mut a, mut b) = (session(&f, &sets[0]), session(&f, &sets[0]));
    assert_eq!(a.prefill_until(&long, Some(&flag)).expect("prefill_until"), long.len());
    b.prefill(&long).expect("prefill");
    let (la, lb) = (a.feed(&long[..1]).expect("feed"), b.feed(&long[..1]).expect("feed"));
    assert_eq!(la.data, lb.data, "the same state as prefill's");
    flag.raise();
    assert_eq!(a.prefill_until(&long[..20], Some(&flag)).expect("raised"), 0);
    assert_eq!(a.position(), long.len() + 1, "nothing ran after the raise");
    // The backend: a flag raised before the call runs nothing.
    let Some(ctx) = gpu() else { return };
    let mut b = fixture_backend(&ctx, &[]);
    let flag = CancelFlag::new();
    flag.raise();
    let got = b.generate_ids(prompt, &flagged(&flag.clone(), false)).expect("backend");
    assert!(got.is_empty(), "raised before the call: no token, found {got:?}");
}
