//! The fuzz worker: a child process that loads inputs `from..to` one after another and writes a
//! journal line before (`B i`) and after (`E i {json}`) each, so that the parent can name the
//! input a crash happened in. A watchdog thread ends the process (`H i`) when one input runs past
//! the timeout; a panic is reported and the process exits for a fresh start.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use qwen35_wgpu::{BackendError, GpuContext, LlmBackend, RunError, SessionOptions, WgpuBackend};
use serde_json::{json, Value};

use super::alloc;
use super::inputs::{build, Built, Domain};
use super::sources::BASES;

/// The prompt whose logits are compared.
const PROMPT: [u32; 4] = [1, 17, 42, 5];

/// Exit status after a reported panic or changed adapter state (the parent restarts after the
/// input, so one fault does not cascade into the next inputs' checks).
pub const EXIT_RESTART: i32 = 87;
/// Exit status of the watchdog.
pub const EXIT_HANG: i32 = 86;

/// Worker arguments.
pub struct Args {
    pub domain: Domain,
    pub seed: u64,
    pub from: u64,
    pub to: u64,
    pub fixtures: PathBuf,
    pub work: PathBuf,
    pub timeout: Duration,
    pub check_every: u64,
}

impl Args {
    /// As the parent passes them.
    pub fn to_cli(&self) -> Vec<String> {
        vec![
            "--domain".into(),
            self.domain.name().into(),
            "--seed".into(),
            self.seed.to_string(),
            "--from".into(),
            self.from.to_string(),
            "--to".into(),
            self.to.to_string(),
            "--fixtures".into(),
            self.fixtures.display().to_string(),
            "--work".into(),
            self.work.display().to_string(),
            "--timeout-ms".into(),
            self.timeout.as_millis().to_string(),
            "--check-every".into(),
            self.check_every.to_string(),
        ]
    }

    fn parse(args: &[String]) -> Result<Self> {
        let get = |k: &str| -> Result<&str> {
            let i = args.iter().position(|a| a == k).with_context(|| format!("fuzz-worker needs {k}"))?;
            args.get(i + 1).map(String::as_str).with_context(|| format!("{k} needs a value"))
        };
        Ok(Self {
            domain: Domain::parse(get("--domain")?).context("--domain adapter|model")?,
            seed: get("--seed")?.parse()?,
            from: get("--from")?.parse()?,
            to: get("--to")?.parse()?,
            fixtures: get("--fixtures")?.into(),
            work: get("--work")?.into(),
            timeout: Duration::from_millis(get("--timeout-ms")?.parse()?),
            check_every: get("--check-every")?.parse::<u64>()?.max(1),
        })
    }
}

static ARMED: AtomicU64 = AtomicU64::new(0);
static ARMED_AT_MS: AtomicU64 = AtomicU64::new(0);
static PANIC: Mutex<Option<String>> = Mutex::new(None);

fn now_ms() -> u64 {
    static T0: OnceLock<Instant> = OnceLock::new();
    T0.get_or_init(Instant::now).elapsed().as_millis() as u64
}

fn watchdog(timeout: Duration) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(50));
        let armed = ARMED.load(SeqCst);
        if armed != 0 && now_ms().saturating_sub(ARMED_AT_MS.load(SeqCst)) > timeout.as_millis() as u64 {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "H {}", armed - 1);
            let _ = out.flush();
            // SAFETY: _exit ends the process without running handlers that could block on the
            // stuck thread.
            unsafe { libc::_exit(EXIT_HANG) };
        }
    });
}

fn line(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

/// The ceiling of one allocation: 64 MiB plus 8× the input's bytes.
pub fn limit_for(justified: u64) -> usize {
    (64u64 << 20).saturating_add(justified.saturating_mul(8)).min(usize::MAX as u64) as usize
}

fn session_opts() -> SessionOptions {
    SessionOptions { max_context: 64, max_batch: 16 }
}

/// The enum path of an error (`Adapter(BadSafetensors`), for counting.
pub fn variant(e: &BackendError) -> String {
    let d = format!("{e:?}");
    let mut out = String::new();
    let mut depth = 0;
    for c in d.chars() {
        match c {
            '(' if depth < 2 => {
                out.push(c);
                depth += 1;
            }
            c if c.is_alphanumeric() || c == '_' => out.push(c),
            _ => break,
        }
    }
    out
}

fn logits(b: &mut WgpuBackend) -> Result<Vec<f32>, BackendError> {
    let s = b.session()?;
    s.reset();
    let l = s.feed(&PROMPT)?;
    s.reset();
    l.last().map(<[f32]>::to_vec).ok_or_else(|| RunError::EmptyInput.into())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A base model with its good adapter active, and what must not change.
struct Base {
    name: &'static str,
    backend: WgpuBackend,
    good: PathBuf,
    id: String,
    baseline: Vec<u32>,
}

impl Base {
    fn state(&self) -> Result<(String, u32, Vec<String>), BackendError> {
        let active = self.backend.active_adapter()?;
        let (id, scale) = active.map_or((String::new(), 0), |a| (a.id, a.scale.to_bits()));
        Ok((id, scale, self.backend.list_adapters()?.into_iter().map(|(i, _)| i).collect()))
    }
}

fn open_bases(ctx: &Arc<GpuContext>, fixtures: &Path) -> Result<Vec<Base>> {
    let mut bases = Vec::new();
    for (model, good) in BASES {
        let mut backend = WgpuBackend::with_context(ctx.clone(), session_opts());
        backend.load_model(&fixtures.join("models").join(model)).with_context(|| format!("loading {model}"))?;
        let good = fixtures.join(good);
        let id = backend.load_adapter(&good, 1.0).with_context(|| format!("loading {}", good.display()))?;
        let baseline = bits(&logits(&mut backend)?);
        bases.push(Base { name: model, backend, good, id, baseline });
    }
    Ok(bases)
}

/// What happened inside the measured window.
enum Attempt {
    /// Loaded; the logits with it (or the error computing them).
    Loaded(Result<Vec<f32>, BackendError>),
}

fn attempt_adapter(base: &mut Base, built: &Built, via_load: bool) -> Result<Attempt, BackendError> {
    let b = &mut base.backend;
    if via_load {
        b.load_adapter(&built.target, built.scale)?;
    } else {
        let id = b.preload_adapter(&built.target, Some("fuzz"))?;
        if let Err(e) = b.activate_adapter(&id, built.scale) {
            let _ = b.remove_adapter(&id);
            return Err(e);
        }
    }
    Ok(Attempt::Loaded(logits(b)))
}

/// Put the good adapter back after a successful load; `None` when that worked.
fn restore(base: &mut Base, via_load: bool) -> Option<String> {
    let b = &mut base.backend;
    let r = if via_load {
        b.load_adapter(&base.good, 1.0).map(|id| (id != base.id).then(|| format!("good adapter came back as {id:?}")))
    } else {
        b.activate_adapter(&base.id, 1.0).and_then(|_| b.remove_adapter("fuzz")).map(|_| None)
    };
    match r {
        Ok(None) => None,
        Ok(Some(m)) => Some(m),
        Err(e) => Some(e.to_string()),
    }
}

fn short(s: &str) -> String {
    let s: String = s.chars().take(300).collect();
    s.replace('\n', " ")
}

/// The injections `QWEN35_FUZZ_INJECT` asks for at input `i`.
fn injected(i: u64) -> Vec<String> {
    let Ok(spec) = std::env::var("QWEN35_FUZZ_INJECT") else { return Vec::new() };
    spec.split(',')
        .filter_map(|item| item.split_once('@'))
        .filter(|(_, at)| at.parse() == Ok(i))
        .map(|(what, _)| what.to_string())
        .collect()
}

fn inject_state(i: u64) -> bool {
    injected(i).iter().any(|w| w == "state")
}

/// `QWEN35_FUZZ_INJECT=abort@I,hang@J,panic@K,alloc@L,state@M`: make input I abort, J hang, K
/// panic, L allocate 1 TiB and M fail after changing the active adapter's scale, to check the
/// harness itself (each must be reported as that fault; M a multiple of --check-every also
/// gives logits-changed).
fn inject(i: u64) -> bool {
    for what in injected(i) {
        match what.as_str() {
            "abort" => std::process::abort(),
            "hang" => std::thread::sleep(Duration::from_secs(3600)),
            "panic" => panic!("injected panic"),
            "alloc" => {
                let v = vec![1u8; 1 << 40];
                std::hint::black_box(&v);
            }
            _ => {}
        }
    }
    false
}

/// Run the worker (`cargo xtask fuzz-worker …`, started by `cargo xtask fuzz`).
pub fn run(args: &[String]) -> Result<()> {
    let a = Args::parse(args)?;
    std::panic::set_hook(Box::new(|info| {
        let msg = match info.payload().downcast_ref::<&str>() {
            Some(s) => s.to_string(),
            None => info.payload().downcast_ref::<String>().cloned().unwrap_or_default(),
        };
        let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        if let Ok(mut p) = PANIC.lock() {
            *p = Some(format!("{msg}{at}"));
        }
    }));
    watchdog(a.timeout);
    let ctx = Arc::new(GpuContext::new()?);
    let mut bases = match a.domain {
        Domain::Adapter => open_bases(&ctx, &a.fixtures)?,
        Domain::Model => Vec::new(),
    };
    line(&format!("READY {}", ctx.info.name));
    let dir = a.work.join(format!("{}-in", a.domain.name()));
    for i in a.from..a.to {
        let built = match build(a.domain, a.seed, i, &a.fixtures, &dir) {
            Ok(b) => b,
            Err(e) => bail!("building input {i}: {e}"),
        };
        let via_load = i % 2 == 1 || built.class == "api-scale";
        let base_ix = bases.iter().position(|b| b.name == built.source.base);
        line(&format!("B {i}"));
        let limit = limit_for(built.justified);
        ARMED_AT_MS.store(now_ms(), SeqCst);
        ARMED.store(i + 1, SeqCst);
        let live = alloc::begin(limit);
        let t = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| match (a.domain, base_ix) {
            _ if inject(i) => unreachable!("inject returns only when nothing is injected"),
            (Domain::Adapter, Some(ix)) if inject_state(i) => {
                // A failed load that changed the state anyway: the checks after it must see it.
                bases[ix].backend.set_adapter_scale(0.5)?;
                Err(BackendError::NoModel)
            }
            (Domain::Adapter, Some(ix)) => attempt_adapter(&mut bases[ix], &built, via_load),
            _ => {
                let mut b = WgpuBackend::with_context(ctx.clone(), session_opts());
                b.load_model(&built.target)?;
                Ok(Attempt::Loaded(logits(&mut b)))
            }
        }));
        let usage = alloc::end(live);
        let ms = t.elapsed().as_secs_f64() * 1e3;
        ARMED.store(0, SeqCst);
        let mut faults: Vec<(&str, String)> = Vec::new();
        let (outcome, error, message, loaded) = match &result {
            Err(_) => {
                let msg = PANIC.lock().ok().and_then(|mut p| p.take()).unwrap_or_default();
                faults.push(("panic", msg.clone()));
                ("fault", String::new(), msg, false)
            }
            Ok(Err(e)) => ("typed", variant(e), e.to_string(), false),
            Ok(Ok(Attempt::Loaded(Ok(l)))) => {
                if let Some((k, v)) = l.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                    faults.push(("nonfinite-logits", format!("logit {k} is {v}")));
                }
                ("ok", String::new(), String::new(), true)
            }
            Ok(Ok(Attempt::Loaded(Err(e)))) => ("typed-at-run", variant(e), e.to_string(), true),
        };
        if loaded && built.must_fail {
            faults.push(("accepted-corrupt", "the format forbids this file, yet it loaded".into()));
        }
        if usage.refused > 0 {
            faults.push(("alloc-over-limit", format!("tried to allocate {} bytes (limit {limit})", usage.refused)));
        }
        if usage.peak > limit {
            faults.push(("peak-over-limit", format!("{} live bytes at peak (limit {limit})", usage.peak)));
        }
        let panicked = result.is_err();
        if let (Domain::Adapter, Some(ix), false) = (a.domain, base_ix, panicked) {
            let base = &mut bases[ix];
            if loaded {
                if let Some(m) = restore(base, via_load) {
                    faults.push(("restore-failed", m));
                }
            }
            match base.state() {
                Ok((id, scale, resident))
                    if id == base.id && scale == 1f32.to_bits() && resident == [base.id.clone()] => {}
                Ok(s) => faults.push(("state-changed", format!("active/scale/resident now {s:?}"))),
                Err(e) => faults.push(("state-changed", e.to_string())),
            }
            if loaded || i % a.check_every == 0 {
                match logits(&mut base.backend) {
                    Ok(l) if bits(&l) == base.baseline => {}
                    Ok(_) => faults.push(("logits-changed", "the active adapter's logits differ from before".into())),
                    Err(e) => faults.push(("logits-changed", format!("logits failed: {e}"))),
                }
            }
        }
        let record = json!({
            "i": i,
            "source": built.source.name,
            "kind": built.source.kind.name(),
            "class": built.class,
            "detail": short(&built.detail),
            "outcome": if faults.is_empty() { outcome } else { "fault" },
            "result": outcome,
            "error": error,
            "message": short(&message),
            "faults": faults.iter().map(|(k, m)| json!({"symptom": k, "message": short(m)})).collect::<Vec<Value>>(),
            "ms": (ms * 10.0).round() / 10.0,
            "peak": usage.peak,
            "largest": usage.largest,
            "justified": built.justified,
            "via_load": via_load,
        });
        let dirty = faults.iter().any(|(k, _)| ["state-changed", "logits-changed", "restore-failed"].contains(k));
        line(&format!("E {i} {record}"));
        if panicked || dirty {
            std::process::exit(EXIT_RESTART);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
