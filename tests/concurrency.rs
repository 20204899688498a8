//! Concurrent use: one thread generates while another activates, deactivates, swaps and rescales
//! adapters. The backend takes `&mut self`, so an application shares it behind a `Mutex`; a
//! switch *between requests* takes that lock, a switch *between tokens* cannot (the generating
//! thread holds it for the whole request) and goes through a channel that the token callback of
//! [`WgpuBackend::generate_tokens_with`] drains into its [`AdapterSwitch`].
//!
//! What "one of the single-threaded outputs" means, precisely. Let `S` = {base, a at 1, b at 1,
//! a at 0.5} be the adapter states the other thread produces and `N` the tokens per request
//! (greedy, no EOS stop). Between requests, a request that starts in state `X` must give `out(X)`,
//! the single-threaded greedy output in `X`: the set is {out(X) : X ∈ S}. Between tokens, the
//! switching thread sends at most one switch per request (it waits for the previous one to be
//! applied and for a new request to start) and it cycles through `S` in order, so a request that
//! starts in `X` can only receive the switch to the state `Y` that follows `X` in the cycle. If it
//! arrives after the `k`-th token the output must be `out(X, k, Y)`: the first `k` tokens of
//! `out(X)`, then tokens computed with `Y` on caches that hold the prompt and the first `k − 1`
//! tokens as computed with `X` (the `k`-th token is the first input computed with `Y`). A switch
//! after the last token (`k = N`) changes nothing in that request, so the set is {out(X) : X ∈ S}
//! ∪ {out(X, k, Y) : X ∈ S, Y its successor, 1 ≤ k < N}. Every reference is computed single-threaded, before the
//! threads start, token by token with `Session::feed` and `Session::set_adapter` (neither the
//! backend nor `generate` and its run-ahead step): each output must be in the set and, stronger,
//! equal the member named by the (X, k, Y) the generating thread observed (membership alone would
//! miss a switch applied one token late: that output is another member of the set). Last, two
//! backends on one GPU context generate on two threads at once, each in its own state.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{fixture_model, gpu, root, Reference};
use qwen35_wgpu::runtime::argmax;
use qwen35_wgpu::{GenerateParams, LlmBackend, LoraAdapter, Model, Session, SessionOptions, WgpuBackend};

/// Tokens per request.
const N: usize = 8;

/// An adapter state: `None` is the base model, else a resident adapter's id and scale.
type State = Option<(&'static str, f32)>;

/// The states the switching thread cycles through (a swap, a rescale, a deactivation each).
const STATES: [State; 4] = [Some(("a", 1.0)), Some(("a", 0.5)), Some(("b", 1.0)), None];

/// The state the switching thread moves to from `x`.
fn after(x: State) -> State {
    let i = STATES.iter().position(|s| key(*s) == key(x)).expect("a listed state");
    STATES[(i + 1) % STATES.len()]
}

/// A state as a map key (f32 is not `Eq`).
type Key = Option<(&'static str, u32)>;

/// The key of `s`.
fn key(s: State) -> Key {
    s.map(|(id, scale)| (id, scale.to_bits()))
}

fn opts() -> SessionOptions {
    SessionOptions { max_context: 64, max_batch: 16 }
}

fn params() -> GenerateParams {
    GenerateParams { max_tokens: N, stop_at_eos: false, ..Default::default() }
}

fn adapter_path(id: &str) -> std::path::PathBuf {
    let name = if id == "a" { "all12_r8" } else { "patterns_r16" };
    root().join("tests/fixtures/adapters").join(name)
}

/// The single-threaded outputs, computed once for both tests.
struct Outputs {
    prompt: Vec<u32>,
    /// out(X).
    plain: HashMap<Key, Vec<u32>>,
    /// out(X, k, Y).
    switched: HashMap<(Key, usize, Key), Vec<u32>>,
}

impl Outputs {
    /// Every single-threaded output.
    fn set(&self) -> BTreeSet<&Vec<u32>> {
        self.plain.values().chain(self.switched.values()).collect()
    }
}

fn outputs() -> Option<&'static Outputs> {
    static OUT: OnceLock<Outputs> = OnceLock::new();
    let ctx = gpu()?;
    Some(OUT.get_or_init(|| {
        let t0 = Instant::now();
        let model = Arc::new(Model::load(ctx, &fixture_model("gva_tied_f32")).expect("model"));
        let adapters: HashMap<&str, Arc<LoraAdapter>> = ["a", "b"]
            .into_iter()
            .map(|id| (id, Arc::new(LoraAdapter::load(&model, &adapter_path(id)).expect("adapter"))))
            .collect();
        let bind = |s: State| s.map(|(id, scale)| (adapters[id].clone(), scale));
        let prompt = Reference::load("adapters").ids("all12_r8.ids");
        let mut session = Session::new(model.clone(), opts()).expect("session");
        // Greedy by hand: start in `x`; after the k-th token, switch to `y`.
        let mut by_hand = |x: State, switch: Option<(usize, State)>| {
            session.reset();
            session.set_adapter(bind(x)).expect("adapter");
            let mut logits = session.feed(&prompt).expect("prompt");
            let mut out = Vec::new();
            loop {
                let next = argmax(logits.last().expect("a row"));
                out.push(next);
                if out.len() == N {
                    return out;
                }
                if let Some((_, y)) = switch.filter(|(k, _)| *k == out.len()) {
                    session.set_adapter(bind(y)).expect("switch");
                }
                logits = session.feed(&[next]).expect("step");
            }
        };
        let plain: HashMap<_, _> = STATES.iter().map(|&x| (key(x), by_hand(x, None))).collect();
        let mut switched = HashMap::new();
        for x in STATES {
            for k in 1..N {
                switched.insert((key(x), k, key(after(x))), by_hand(x, Some((k, after(x)))));
            }
        }
        eprintln!("single-threaded outputs: {} in {:.2} s", plain.len() + switched.len(), t0.elapsed().as_secs_f32());
        let distinct: BTreeSet<&Vec<u32>> = plain.values().collect();
        assert_eq!(
            distinct.len(),
            STATES.len(),
            "the states must give distinct outputs for the check to mean anything"
        );
        Outputs { prompt, plain, switched }
    }))
}

/// The fixture backend with both adapters resident, none active.
fn backend() -> Option<WgpuBackend> {
    let mut b = WgpuBackend::with_context(gpu()?, opts());
    b.load_model(&fixture_model("gva_tied_f32")).expect("model");
    for id in ["a", "b"] {
        b.preload_adapter(&adapter_path(id), Some(id)).expect("preload");
    }
    Some(b)
}

/// The backend's active state, as one of [`STATES`].
fn active(b: &WgpuBackend) -> State {
    let active = b.active_adapter().expect("query")?;
    let found = STATES.into_iter().flatten().find(|(id, scale)| *id == active.id && *scale == active.scale);
    Some(found.unwrap_or_else(|| panic!("unexpected active adapter {} at {}", active.id, active.scale)))
}

/// Move `b` to state `to` through the backend API (an activation, a swap, a rescale or a
/// deactivation, whichever gets there from `from`).
fn switch_to(b: &mut WgpuBackend, from: State, to: State) {
    match (from, to) {
        (_, None) => b.deactivate_adapter(),
        (Some((f, _)), Some((t, scale))) if f == t => b.set_adapter_scale(scale),
        (_, Some((id, scale))) => b.activate_adapter(id, scale),
    }
    .expect("switch");
}

/// Sets the flag when dropped, so that the other thread stops even when this one panics (else
/// the scope would wait for it forever).
struct Done<'a>(&'a AtomicBool);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[test]
fn generation_while_another_thread_switches_between_requests() {
    let (Some(want), Some(b)) = (outputs(), backend()) else { return };
    let shared = Mutex::new(b);
    let done = AtomicBool::new(false);
    let started = Instant::now();
    let seen = std::thread::scope(|scope| {
        let switcher = scope.spawn(|| {
            let mut switches = 0;
            for to in STATES.iter().cycle() {
                if done.load(Ordering::Acquire) {
                    return switches;
                }
                {
                    let mut b = shared.lock().expect("lock");
                    let from = active(&b);
                    switch_to(&mut b, from, *to);
                }
                switches += 1;
                std::thread::sleep(Duration::from_millis(3));
            }
            switches
        });
        let _done = Done(&done);
        let mut seen = Vec::new();
        let all_seen = |seen: &[(State, Vec<u32>)]| {
            seen.iter().map(|(x, _)| key(*x)).collect::<BTreeSet<_>>().len() == STATES.len()
        };
        while seen.len() < 60 && (seen.len() < 12 || !all_seen(&seen)) {
            let (x, out) = {
                let mut b = shared.lock().expect("lock");
                let x = active(&b);
                (x, b.generate_ids(&want.prompt, &params()).expect("generate"))
            };
            seen.push((x, out));
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(_done);
        let switches = switcher.join().expect("switcher");
        eprintln!("{} requests, {switches} switches", seen.len());
        seen
    });
    let set = want.set();
    for (i, (x, out)) in seen.iter().enumerate() {
        assert!(set.contains(out), "request {i} (started in {x:?}): {out:?} is no single-threaded output");
        assert_eq!(out, &want.plain[&key(*x)], "request {i} started in {x:?}");
    }
    let states: BTreeSet<_> = seen.iter().map(|(x, _)| key(*x)).collect();
    assert_eq!(states.len(), STATES.len(), "requests saw only {states:?}: the switching thread starved");
    eprintln!("between requests: {:.2} s", started.elapsed().as_secs_f32());
}

#[test]
fn generation_while_another_thread_switches_between_tokens() {
    let (Some(want), Some(b)) = (outputs(), backend()) else { return };
    let shared = Mutex::new(b);
    let (tx, rx) = mpsc::channel::<State>();
    let applied = AtomicUsize::new(0);
    let requests = AtomicUsize::new(0);
    let streamed = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    const SWITCHES: usize = 12;
    let started = Instant::now();
    let seen = std::thread::scope(|scope| {
        scope.spawn(|| {
            // Each switch aims at a different token boundary: it is sent once the request has
            // streamed `target` tokens, and lands after that token or a later one.
            for (n, to) in STATES.iter().cycle().take(SWITCHES).enumerate() {
                let target = n * 3 % N;
                let request = requests.load(Ordering::Acquire);
                while requests.load(Ordering::Acquire) == request && !done.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_micros(200));
                }
                while streamed.load(Ordering::Acquire) < target && !done.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_micros(200));
                }
                tx.send(*to).expect("send");
                while applied.load(Ordering::Acquire) == n && !done.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        });
        let _done = Done(&done);
        let mut seen = Vec::new();
        let mut b = shared.lock().expect("lock");
        while applied.load(Ordering::Acquire) < SWITCHES && seen.len() < 10 * SWITCHES {
            let x = active(&b);
            let mut tokens = 0;
            let mut switch = None;
            streamed.store(0, Ordering::Release);
            requests.fetch_add(1, Ordering::AcqRel);
            let out = b
                .generate_tokens_with(&want.prompt, &params(), &mut |_, s| {
                    tokens += 1;
                    streamed.store(tokens, Ordering::Release);
                    if let Ok(to) = rx.try_recv() {
                        match to {
                            Some((id, scale)) => s.activate(id, scale),
                            None => s.deactivate(),
                        }
                        assert!(switch.is_none(), "two switches in one request");
                        switch = Some((tokens, to));
                        applied.fetch_add(1, Ordering::AcqRel);
                    }
                    true
                })
                .expect("generate");
            seen.push((x, switch, out));
        }
        seen
    });
    let set = want.set();
    let mut interior = 0;
    let ks: Vec<usize> = seen.iter().filter_map(|(_, s, _)| s.map(|(k, _)| k)).collect();
    for (i, (x, switch, out)) in seen.iter().enumerate() {
        assert!(
            set.contains(out),
            "request {i} (started in {x:?}, switch {switch:?}): {out:?} is no single-threaded output"
        );
        let expected = match switch {
            Some((k, y)) if *k < N => {
                assert_eq!(key(*y), key(after(*x)), "request {i}: a switch outside the cycle");
                interior += 1;
                &want.switched[&(key(*x), *k, key(*y))]
            }
            _ => &want.plain[&key(*x)],
        };
        assert_eq!(out, expected, "request {i}: started in {x:?}, switch {switch:?}");
    }
    let applied = applied.load(Ordering::Acquire);
    assert_eq!(applied, SWITCHES, "only {applied} of {SWITCHES} switches were applied in {} requests", seen.len());
    assert!(interior >= 3, "only {interior} switches landed between two tokens of a request");
    eprintln!(
        "between tokens: {} requests, {interior} of {SWITCHES} switches inside a request (after tokens {ks:?}), {:.2} s",
        seen.len(),
        started.elapsed().as_secs_f32()
    );
}

#[test]
fn two_backends_on_one_context_generate_in_parallel() {
    // Two applications' backends sharing one device and queue, each in its own state, each
    // generating on its own thread at the same time: every output is its state's out(X).
    let Some(want) = outputs() else { return };
    let started = Instant::now();
    std::thread::scope(|scope| {
        for (i, states) in [[STATES[0], STATES[3]], [STATES[2], STATES[1]]].into_iter().enumerate() {
            scope.spawn(move || {
                let mut b = backend().expect("backend");
                for round in 0..2 {
                    for x in states {
                        let from = active(&b);
                        switch_to(&mut b, from, x);
                        let out = b.generate_ids(&want.prompt, &params()).expect("generate");
                        assert_eq!(out, want.plain[&key(x)], "thread {i}, round {round}, state {x:?}");
                    }
                }
            });
        }
    });
    eprintln!("two backends in parallel: {:.2} s", started.elapsed().as_secs_f32());
}
