//! `cargo xtask fuzz`: hostile adapters and checkpoints (see HELP in main.rs). The parent builds
//! nothing itself: it runs a worker child ([`worker`]) over an index range, reads its journal,
//! and when the child dies (abort, stack overflow, watchdog) names the input from the journal's
//! last `B` line, records it, rebuilds the input as a reproducer, and restarts after it. A
//! journal finds the culprit in one step where re-running a batch one input at a time would cost
//! one GPU start per input.

pub mod alloc;
mod inputs;
mod mutate_json;
mod mutate_st;
mod rng;
mod sources;
mod st;
mod worker;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

pub use worker::run as worker;

use inputs::Domain;

/// Options of `cargo xtask fuzz`.
struct Options {
    adapters: u64,
    models: u64,
    seed: u64,
    short: bool,
    timeout: Duration,
    check_every: u64,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self> {
        let short = args.iter().any(|a| a == "--short");
        let num = |k: &str, default: u64| -> Result<u64> {
            match args.iter().position(|a| a == k) {
                Some(i) => {
                    args.get(i + 1).with_context(|| format!("{k} needs a number"))?.parse().context(k.to_string())
                }
                None => Ok(default),
            }
        };
        Ok(Self {
            adapters: num("--adapters", if short { 3_000 } else { 100_000 })?,
            models: num("--models", if short { 100 } else { 2_000 })?,
            seed: num("--seed", 1)?,
            short,
            timeout: Duration::from_secs(num("--timeout", 10)?),
            check_every: num("--check-every", 32)?,
        })
    }
}

/// Counts of one group of inputs.
#[derive(Default)]
struct Counts {
    inputs: u64,
    ok: u64,
    typed: u64,
    faults: u64,
}

impl Counts {
    fn add(&mut self, outcome: &str) {
        self.inputs += 1;
        match outcome {
            "ok" => self.ok += 1,
            "fault" => self.faults += 1,
            _ => self.typed += 1,
        }
    }

    fn json(&self) -> Value {
        json!({"inputs": self.inputs, "ok": self.ok, "typed_error": self.typed, "fault": self.faults})
    }
}

/// The inputs that showed one fault.
struct FaultGroup {
    symptom: String,
    domain: &'static str,
    kind: String,
    class: String,
    message: String,
    count: u64,
    examples: Vec<Value>,
    reproducers: Vec<String>,
}

/// A domain's run.
#[derive(Default)]
struct Tally {
    total: Counts,
    by_class: BTreeMap<String, Counts>,
    by_kind: BTreeMap<String, Counts>,
    errors: BTreeMap<String, u64>,
    restarts: u64,
    seconds: f64,
    input_ms: f64,
    slowest: Vec<(f64, u64, String)>,
}

struct Fuzz {
    root: PathBuf,
    out: PathBuf,
    opts: Options,
    faults: BTreeMap<String, FaultGroup>,
}

/// A fault's grouping key: symptom, domain, input kind, class and the message with its numbers
/// and paths blurred.
fn signature(symptom: &str, domain: Domain, kind: &str, class: &str, message: &str) -> String {
    let mut m = String::new();
    let mut last_digit = false;
    for c in message.chars().take(90) {
        if c.is_ascii_digit() {
            if !last_digit {
                m.push('#');
            }
            last_digit = true;
        } else {
            m.push(c);
            last_digit = false;
        }
    }
    format!("{symptom} | {} {kind} {class} | {m}", domain.name())
}

fn slug(s: &str) -> String {
    let mut out: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    while out.contains("--") {
        out = out.replace("--", "-");
    }
    // Signatures can share their first 72 characters: a hash of the whole keeps them apart.
    let hash = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    format!("{}-{:08x}", out.chars().take(72).collect::<String>().trim_matches('-'), hash as u32)
}

impl Fuzz {
    fn worker_args(&self, domain: Domain, from: u64, to: u64) -> worker::Args {
        worker::Args {
            domain,
            seed: self.opts.seed,
            from,
            to,
            fixtures: self.root.join("tests/fixtures"),
            work: self.out.join("work"),
            timeout: self.opts.timeout,
            check_every: self.opts.check_every,
        }
    }

    /// Record one journal entry (or a crash the parent saw).
    fn record(&mut self, domain: Domain, tally: &mut Tally, rec: &Value) {
        let s = |k: &str| rec.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let outcome = s("outcome");
        tally.total.add(&outcome);
        tally.by_class.entry(s("class")).or_default().add(&outcome);
        tally.by_kind.entry(s("kind")).or_default().add(&outcome);
        let err = s("error");
        if !err.is_empty() {
            *tally.errors.entry(err).or_default() += 1;
        }
        let ms = rec.get("ms").and_then(Value::as_f64).unwrap_or(0.0);
        let i = rec.get("i").and_then(Value::as_u64).unwrap_or(0);
        tally.input_ms += ms;
        tally.slowest.push((ms, i, format!("{} {}: {}", s("class"), s("source"), s("detail"))));
        tally.slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
        tally.slowest.truncate(5);
        let empty = Vec::new();
        for f in rec.get("faults").and_then(Value::as_array).unwrap_or(&empty) {
            let symptom = f.get("symptom").and_then(Value::as_str).unwrap_or("?");
            let message = f.get("message").and_then(Value::as_str).unwrap_or("");
            let sig = signature(symptom, domain, &s("kind"), &s("class"), message);
            let group = self.faults.entry(sig.clone()).or_insert_with(|| FaultGroup {
                symptom: symptom.into(),
                domain: domain.name(),
                kind: s("kind"),
                class: s("class"),
                message: message.into(),
                count: 0,
                examples: Vec::new(),
                reproducers: Vec::new(),
            });
            group.count += 1;
            if group.examples.len() < 3 {
                group.examples.push(rec.clone());
                let dir = self.out.join("faults").join(slug(&sig)).join(format!("{}-{i}", domain.name()));
                match self.reproducer(domain, i, &dir, rec) {
                    Ok(()) => {
                        if let Some(g) = self.faults.get_mut(&sig) {
                            g.reproducers.push(dir.display().to_string());
                        }
                    }
                    Err(e) => eprintln!("could not save the reproducer of input {i}: {e}"),
                }
            }
        }
    }

    /// Rebuild input `i` under `dir` with an info.json saying how it was made and what it did.
    fn reproducer(&self, domain: Domain, i: u64, dir: &Path, rec: &Value) -> Result<()> {
        let built = inputs::build(domain, self.opts.seed, i, &self.root.join("tests/fixtures"), dir)?;
        let info = json!({
            "target": built.target,
            "base_model": if built.source.base.is_empty() { Value::Null } else { json!(format!("tests/fixtures/models/{}", built.source.base)) },
            "scale": built.scale,
            "record": rec,
            "rerun": format!(
                "cargo xtask fuzz-worker {}",
                self.worker_args(domain, i, i + 1).to_cli().join(" ")
            ),
        });
        std::fs::write(dir.join("info.json"), serde_json::to_string_pretty(&info)?)?;
        Ok(())
    }

    /// Run `n` inputs of `domain` through as many workers as crashes need.
    fn drive(&mut self, domain: Domain, n: u64) -> Result<Tally> {
        let mut tally = Tally::default();
        let started = Instant::now();
        let mut next = 0;
        let exe = std::env::current_exe()?;
        while next < n {
            let mut child = Command::new(&exe)
                .arg("fuzz-worker")
                .args(self.worker_args(domain, next, n).to_cli())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting the fuzz worker")?;
            let (tx, rx) = mpsc::channel::<String>();
            let stdout = child.stdout.take().context("worker stdout")?;
            std::thread::spawn(move || {
                for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
            let tail = Arc::new(Mutex::new(String::new()));
            let mut stderr = child.stderr.take().context("worker stderr")?;
            let tail_w = tail.clone();
            let err_thread = std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(k) = stderr.read(&mut buf) {
                    if k == 0 {
                        break;
                    }
                    if let Ok(mut t) = tail_w.lock() {
                        t.push_str(&String::from_utf8_lossy(&buf[..k]));
                        let cut = t.len().saturating_sub(8192);
                        let cut = (cut..t.len()).find(|&c| t.is_char_boundary(c)).unwrap_or(0);
                        t.drain(..cut);
                    }
                }
            });
            let mut ready = false;
            let mut current: Option<u64> = None;
            let mut hung: Option<u64> = None;
            let mut killed = false;
            loop {
                // Startup loads three models; an input has the worker's own watchdog, this is the
                // backstop for a worker that stops answering altogether.
                let wait = if ready { self.opts.timeout * 3 } else { Duration::from_secs(300) };
                match rx.recv_timeout(wait) {
                    Ok(l) => {
                        let (tag, rest) = l.split_once(' ').unwrap_or((&l, ""));
                        match tag {
                            "READY" => ready = true,
                            "B" => current = rest.parse().ok(),
                            "E" => {
                                let (_, js) = rest.split_once(' ').unwrap_or(("", "{}"));
                                let rec: Value = serde_json::from_str(js).unwrap_or(json!({}));
                                self.record(domain, &mut tally, &rec);
                                current = None;
                                next = rec.get("i").and_then(Value::as_u64).map_or(next, |i| i + 1);
                                let done = tally.total.inputs;
                                if done % 500 == 0 {
                                    eprintln!(
                                        "fuzz {}: {done}/{n} inputs, {} faults, {:.0} s",
                                        domain.name(),
                                        tally.total.faults,
                                        started.elapsed().as_secs_f64()
                                    );
                                }
                            }
                            "H" => hung = rest.parse().ok(),
                            _ => {}
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let _ = child.kill();
                        killed = true;
                        hung = current;
                        break;
                    }
                }
            }
            let status = child.wait()?;
            let _ = err_thread.join();
            let stderr_tail = tail.lock().map(|t| t.clone()).unwrap_or_default();
            let crashed = hung.or(current);
            match crashed {
                Some(i) => {
                    let (symptom, message) = if hung.is_some() {
                        (
                            "hang",
                            format!(
                                "no answer within {:?}{}",
                                self.opts.timeout,
                                if killed { " (killed by the parent)" } else { "" }
                            ),
                        )
                    } else {
                        crash_kind(&stderr_tail, &status)
                    };
                    let mut rec = self.describe(domain, i);
                    rec["outcome"] = json!("fault");
                    rec["faults"] = json!([{ "symptom": symptom, "message": message }]);
                    rec["stderr_tail"] = json!(stderr_tail
                        .chars()
                        .rev()
                        .take(1500)
                        .collect::<String>()
                        .chars()
                        .rev()
                        .collect::<String>());
                    self.record(domain, &mut tally, &rec);
                    tally.restarts += 1;
                    next = i + 1;
                }
                None if !ready => bail!("the fuzz worker did not start ({status}):\n{stderr_tail}"),
                None if status.code() == Some(worker::EXIT_RESTART) => tally.restarts += 1,
                None if !status.success() => bail!("the fuzz worker failed between inputs ({status}):\n{stderr_tail}"),
                None => {}
            }
        }
        tally.seconds = started.elapsed().as_secs_f64();
        Ok(tally)
    }

    /// The record of input `i` as the parent can rebuild it (for a crash that left none).
    fn describe(&self, domain: Domain, i: u64) -> Value {
        let dir = self.out.join("work").join("describe");
        let r = match inputs::build(domain, self.opts.seed, i, &self.root.join("tests/fixtures"), &dir) {
            Ok(b) => {
                json!({"i": i, "source": b.source.name, "kind": b.source.kind.name(), "class": b.class, "detail": b.detail, "justified": b.justified})
            }
            Err(e) => json!({"i": i, "source": "?", "kind": "?", "class": "?", "detail": e.to_string()}),
        };
        let _ = std::fs::remove_dir_all(&dir);
        r
    }
}

/// What killed a worker, from its stderr and exit status.
fn crash_kind(stderr: &str, status: &std::process::ExitStatus) -> (&'static str, String) {
    use std::os::unix::process::ExitStatusExt;
    let last = |pat: &str| stderr.lines().rev().find(|l| l.contains(pat)).map(str::to_string);
    if let Some(l) = last("memory allocation of") {
        return ("abort-alloc", l);
    }
    if let Some(l) = last("overflowed its stack") {
        return ("stack-overflow", l);
    }
    if let Some(l) = last("panicked") {
        return ("abort-panic", l);
    }
    let how = match status.signal() {
        Some(s) => format!("killed by signal {s}"),
        None => format!("exited with {status}"),
    };
    ("abort", format!("{how}: {}", stderr.lines().last().unwrap_or("")))
}

/// Peak resident set of this process and of its largest child, KiB.
fn peak_rss_kib() -> (i64, i64) {
    let get = |who| {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(who, &mut u) } != 0 {
            return -1;
        }
        // macOS reports bytes, Linux KiB.
        if cfg!(target_os = "macos") {
            u.ru_maxrss / 1024
        } else {
            u.ru_maxrss
        }
    };
    (get(libc::RUSAGE_SELF), get(libc::RUSAGE_CHILDREN))
}

fn tally_json(t: &Tally) -> Value {
    let map = |m: &BTreeMap<String, Counts>| -> Value {
        Value::Object(m.iter().map(|(k, c)| (k.clone(), c.json())).collect())
    };
    json!({
        "counts": t.total.json(),
        "by_class": map(&t.by_class),
        "by_kind": map(&t.by_kind),
        "typed_errors": t.errors,
        "worker_restarts": t.restarts,
        "seconds": (t.seconds * 10.0).round() / 10.0,
        "inputs_per_second": if t.seconds > 0.0 { (t.total.inputs as f64 / t.seconds * 10.0).round() / 10.0 } else { 0.0 },
        "mean_input_ms": if t.total.inputs > 0 { (t.input_ms / t.total.inputs as f64 * 100.0).round() / 100.0 } else { 0.0 },
        "slowest": t.slowest.iter().map(|(ms, i, d)| json!({"ms": ms, "i": i, "what": d})).collect::<Vec<_>>(),
    })
}

fn print_tally(name: &str, t: &Tally) {
    println!(
        "{name}: {} inputs in {:.1} s ({:.1}/s): {} loaded, {} typed errors, {} faults; {} worker restarts",
        t.total.inputs,
        t.seconds,
        if t.seconds > 0.0 { t.total.inputs as f64 / t.seconds } else { 0.0 },
        t.total.ok,
        t.total.typed,
        t.total.faults,
        t.restarts
    );
    for (class, c) in &t.by_class {
        println!("  {class:<16} {:>7} inputs {:>6} ok {:>7} typed {:>5} faults", c.inputs, c.ok, c.typed, c.faults);
    }
}

/// `cargo xtask fuzz [--adapters N] [--models N] [--seed S] [--short] [--timeout S] [--check-every K]`.
pub fn run(root: &Path, args: &[String]) -> Result<()> {
    let opts = Options::parse(args)?;
    let out = root.join("target/fuzz");
    for d in ["work", "faults"] {
        let _ = std::fs::remove_dir_all(out.join(d));
    }
    std::fs::create_dir_all(&out)?;
    let started = Instant::now();
    let mut fuzz = Fuzz { root: root.to_path_buf(), out: out.clone(), opts, faults: BTreeMap::new() };
    eprintln!(
        "fuzz: {} adapter inputs, {} model directories, seed {}, timeout {:?}, logits compared every {} failed loads",
        fuzz.opts.adapters, fuzz.opts.models, fuzz.opts.seed, fuzz.opts.timeout, fuzz.opts.check_every
    );
    let adapters = fuzz.drive(Domain::Adapter, fuzz.opts.adapters)?;
    let models = fuzz.drive(Domain::Model, fuzz.opts.models)?;
    let _ = std::fs::remove_dir_all(out.join("work"));
    let (rss_self, rss_child) = peak_rss_kib();
    let seconds = started.elapsed().as_secs_f64();
    print_tally("adapters", &adapters);
    print_tally("models", &models);
    let faults: u64 = fuzz.faults.values().map(|g| g.count).sum();
    println!("{} fault inputs in {} groups:", faults, fuzz.faults.len());
    for (sig, g) in &fuzz.faults {
        println!("  {:>6} × {sig}", g.count);
        if let Some(r) = g.reproducers.first() {
            println!("           e.g. {r}");
        }
    }
    println!(
        "peak RSS: {:.1} MiB (largest worker), {:.1} MiB (driver); {seconds:.1} s in all",
        rss_child as f64 / 1024.0,
        rss_self as f64 / 1024.0
    );
    let summary = json!({
        "seed": fuzz.opts.seed,
        "short": fuzz.opts.short,
        "timeout_s": fuzz.opts.timeout.as_secs(),
        "logits_compared_every": fuzz.opts.check_every,
        "adapters": tally_json(&adapters),
        "models": tally_json(&models),
        "fault_inputs": faults,
        "faults": fuzz.faults.iter().map(|(sig, g)| json!({
            "signature": sig,
            "symptom": g.symptom,
            "domain": g.domain,
            "kind": g.kind,
            "class": g.class,
            "message": g.message,
            "count": g.count,
            "reproducers": g.reproducers,
            "examples": g.examples,
        })).collect::<Vec<_>>(),
        "peak_rss_kib": {"worker": rss_child, "driver": rss_self},
        "seconds": (seconds * 10.0).round() / 10.0,
    });
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    println!("summary: {}", out.join("summary.json").display());
    if faults > 0 {
        eprintln!(
            "error: {faults} inputs gave faults (panic, abort, hang, over-limit allocation, non-finite logits, \
             accepted corrupt file or changed adapter state); reproducers under {}",
            out.join("faults").display()
        );
        std::process::exit(1);
    }
    Ok(())
}

/// The injections of the harness check (input index, the symptoms it must be reported with).
const INJECTED: [(u64, &str, &[&str]); 5] = [
    (2, "abort", &["abort"]),
    (5, "hang", &["hang"]),
    (9, "panic", &["panic"]),
    (13, "alloc", &["abort-alloc"]),
    // A multiple of the check interval: the changed scale shows in the logits too.
    (16, "state", &["state-changed", "logits-changed"]),
];

/// The fuzzer's own fault detection: 24 adapter inputs run through `fuzz` (the executable
/// `xtask`, with `backend` as WGPU_BACKEND) with an abort, a hang, a panic, a 1 TiB allocation
/// and a changed adapter state injected (`QWEN35_FUZZ_INJECT`); the run must fail and report
/// exactly those inputs, each with its symptoms. Its summary is overwritten by the next run.
pub fn harness_check(root: &Path, xtask: &Path, backend: Option<&str>) -> Result<()> {
    let spec: Vec<String> = INJECTED.iter().map(|(i, what, _)| format!("{what}@{i}")).collect();
    let path = root.join("target/fuzz/summary.json");
    // An earlier run's summary must not stand in for this one's.
    let _ = std::fs::remove_file(&path);
    let mut cmd = Command::new(xtask);
    cmd.args(["fuzz", "--adapters", "24", "--models", "0", "--timeout", "5", "--check-every", "4"])
        .env("QWEN35_FUZZ_INJECT", spec.join(","))
        .stdout(Stdio::null());
    if let Some(b) = backend {
        cmd.env("WGPU_BACKEND", b);
    }
    let status = cmd.status().context("running the fuzzer with injected faults")?;
    if status.success() {
        bail!("fuzz harness check: the run with injected faults ({}) passed", spec.join(","));
    }
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&path).context("the harness check's summary")?)?;
    let mut found: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for f in summary["faults"].as_array().context("faults")? {
        let symptom = f["symptom"].as_str().unwrap_or("?").to_string();
        for r in f["reproducers"].as_array().context("reproducers")? {
            let input = r.as_str().and_then(|p| p.rsplit_once("adapter-")).and_then(|(_, n)| n.parse().ok());
            found.entry(input.context("a reproducer named adapter-N")?).or_default().push(symptom.clone());
        }
    }
    let mut want: BTreeMap<u64, Vec<String>> =
        INJECTED.iter().map(|(i, _, symptoms)| (*i, symptoms.iter().map(|s| s.to_string()).collect())).collect();
    for v in want.values_mut().chain(found.values_mut()) {
        v.sort();
    }
    if found != want {
        bail!("fuzz harness check: expected the faults {want:?} (input → symptoms), the fuzzer reported {found:?}");
    }
    eprintln!("fuzz harness check: the {} injected faults reported as such", INJECTED.len());
    Ok(())
}
