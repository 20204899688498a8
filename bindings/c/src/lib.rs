//! The C API of qwen35-wgpu: `include/qwen35_wgpu.h` (generated from this file by cbindgen).
//!
//! The boundary's rules:
//! - Every function returns a [`qe_status`]; after a failure [`qe_last_error`] gives the typed
//!   error's text on the calling thread.
//! - Nothing unwinds into the caller: every call runs inside `catch_unwind`, and a panic becomes
//!   [`QE_PANIC`]. An engine whose lock a panic poisoned refuses further calls
//!   (`QE_PANIC`); free it.
//! - Handles are numbers in a table, never reused, so a freed or unknown handle is an error
//!   ([`QE_INVALID_HANDLE`]), never a dangling pointer. The table is the one piece of
//!   global state, and it lives here, at the boundary: the engine library has none.
//! - Null pointers, invalid UTF-8 and malformed JSON are [`QE_INVALID_ARGUMENT`]
//!   errors naming the argument.
//! - Calls on one engine take its lock in turn (a call waits while another runs, a whole
//!   generation included); [`qe_cancel`] never takes it. A call on an engine from inside that
//!   engine's streaming callback is refused instead of waiting forever, and one on another, busy
//!   engine from inside a callback is [`QE_BUSY`] (two callbacks calling each other's engine
//!   would wait for each other).

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};

use qwen35_wgpu::learn::LEARNABLE;
use qwen35_wgpu::{
    AdapterError, AdapterWeight, BackendError, CancelFlag, ChatMessage, ChatRequest, FeedbackEvent, GenerateParams,
    LayerScales, LearnError, LearnOptions, LlmBackend, LoadOptions, ModelError, Proj, QuantizeRecipe, RunError,
    SessionId, SessionOptions, Signal, TrainSpec, WgpuBackend,
};
use serde::Deserialize;
use serde_json::{json, Value};

/// What a call did: one of the `QE_*` codes (plain `int32_t` constants, so C, C++ and Swift
/// compare them with `==` alike).
pub type qe_status = i32;

/// Success.
pub const QE_OK: qe_status = 0;
/// A null pointer, invalid UTF-8, malformed JSON, an unknown field or an out-of-range value,
/// or a call on an engine from inside that engine's streaming callback.
pub const QE_INVALID_ARGUMENT: qe_status = 1;
/// An engine or session handle that is not open (never made, freed, or a session of another
/// engine).
pub const QE_INVALID_HANDLE: qe_status = 2;
/// The model could not be loaded (missing or invalid files), or none is loaded.
pub const QE_MODEL: qe_status = 3;
/// An adapter could not be loaded, found or applied.
pub const QE_ADAPTER: qe_status = 4;
/// Generation failed (context full, non-finite logits, a bad parameter).
pub const QE_RUN: qe_status = 5;
/// A learning step, the trainable adapter or its export failed.
pub const QE_LEARN: qe_status = 6;
/// The GPU failed (no adapter, out of memory, a device error).
pub const QE_GPU: qe_status = 7;
/// Tokenizer or chat template failure.
pub const QE_TEXT: qe_status = 8;
/// Stopped by qe_cancel or qe_engine_free (what was generated until then is returned).
pub const QE_CANCELLED: qe_status = 9;
/// A panic inside the library (a bug): caught at the boundary.
pub const QE_PANIC: qe_status = 10;
/// The engine is running another call and this thread is inside a streaming callback, where
/// waiting for it could wait forever (the call holding it may wait for this one): retry after
/// the callback has returned.
pub const QE_BUSY: qe_status = 11;

/// An engine: one loaded model on the GPU, its resident adapters and its sessions. 0 is never a
/// valid handle.
pub type qe_engine = u64;

/// A session (one conversation: KV cache, GDN states, prompt cache, active adapter set) of an
/// engine, valid with that engine only. 0 is never a valid handle.
pub type qe_session = u64;

/// Streaming callback: `len` bytes of UTF-8 text at `text` (not NUL-terminated, valid only
/// during the call) and the caller's `user` pointer. Return nonzero to go on, 0 to stop the
/// generation (the call then returns QE_OK with the text so far; the callback is not called
/// again). Inside the callback only qe_cancel, qe_last_error, qe_string_free and calls on other
/// engines may be made: a call on an engine whose callback this thread is running, the same
/// engine or one further out when callbacks nest, returns QE_INVALID_ARGUMENT (it would wait
/// for the very call that runs that callback), and a call on another engine that is busy
/// returns QE_BUSY instead of waiting. The callback must return: it must not throw (C++,
/// Objective-C, Swift errors) or longjmp through the library, and must not wait for another
/// thread that is calling the same engine (that thread waits for this call).
pub type qe_delta_fn = Option<unsafe extern "C" fn(text: *const c_char, len: usize, user: *mut c_void) -> i32>;

/// Streaming callback of qe_generate_batch and qe_chat_batch: request `index`'s text (for a
/// chat, its answer's content), as for qe_delta_fn. Return 0 to stop that request (the call goes
/// on with the others; the callback is not called for it again). The same rules inside the
/// callback as for qe_delta_fn.
pub type qe_batch_delta_fn =
    Option<unsafe extern "C" fn(index: usize, text: *const c_char, len: usize, user: *mut c_void) -> i32>;

/// The ABI version: bumped whenever a function's signature or meaning changes or functions are
/// added (3: qe_generate_batch and qe_chat_batch; 4: QE_BUSY).
pub const QE_ABI_VERSION: u32 = 4;

struct Engine {
    id: qe_engine,
    state: Mutex<State>,
    /// Raised by qe_cancel (and qe_engine_free): a call arms a clone when it is made, so a
    /// cancel reaches a call that is still waiting for the lock, and never one made after it;
    /// its generation checks it at every token.
    cancel: CancelFlag,
    /// Set by qe_engine_free: a call still waiting for the lock then finds the handle closed.
    closed: AtomicBool,
}

/// An engine's backend and the sessions the caller opened on it.
struct State {
    backend: WgpuBackend,
    /// Open session handles (their low 32 bits) → the backend's session.
    sessions: BTreeMap<u64, SessionId>,
    /// The serial of the next session handle.
    next_serial: u64,
    /// A backend session no handle holds (the one a loaded backend always keeps): the next
    /// qe_session_create hands it out instead of allocating another.
    spare: Option<SessionId>,
}

/// Session handles: the engine in the high 32 bits, a serial (from 1, never reused) in the low.
const SESSION_BITS: u32 = 32;

fn engines() -> MutexGuard<'static, BTreeMap<u64, Arc<Engine>>> {
    static ENGINES: OnceLock<Mutex<BTreeMap<u64, Arc<Engine>>>> = OnceLock::new();
    // The table is a map of handles, consistent after any panic: a poisoned lock is taken as is.
    ENGINES.get_or_init(|| Mutex::new(BTreeMap::new())).lock().unwrap_or_else(PoisonError::into_inner)
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The engines whose streaming callbacks this thread is running, innermost last (a callback
    /// may run another engine's generation, whose callback runs inside it); the calls running
    /// them hold their locks.
    static IN_CALLBACK: RefCell<Vec<qe_engine>> = const { RefCell::new(Vec::new()) };
}

/// A failed call: its status and message.
struct Fail {
    status: qe_status,
    message: String,
}

impl Fail {
    fn arg(message: impl Into<String>) -> Self {
        Self { status: QE_INVALID_ARGUMENT, message: message.into() }
    }
}

/// Whether `e` is a GPU failure, also where a model, run, adapter or learning error wraps it.
fn is_gpu(e: &BackendError) -> bool {
    fn adapter(e: &AdapterError) -> bool {
        matches!(e, AdapterError::Gpu(_))
    }
    fn run(e: &RunError) -> bool {
        matches!(e, RunError::Gpu(_)) || matches!(e, RunError::Adapter(a) if adapter(a))
    }
    match e {
        BackendError::Gpu(_) => true,
        BackendError::Model(m) => matches!(m, ModelError::Gpu(_)),
        BackendError::Adapter(a) => adapter(a),
        BackendError::Run(r) => run(r),
        BackendError::Learn(l) => match l {
            LearnError::Gpu(_) => true,
            LearnError::Adapter(a) => adapter(a),
            LearnError::Run(r) => run(r),
            _ => false,
        },
        _ => false,
    }
}

impl From<BackendError> for Fail {
    fn from(e: BackendError) -> Self {
        let status = match &e {
            e if is_gpu(e) => QE_GPU,
            BackendError::NoModel | BackendError::Model(_) => QE_MODEL,
            BackendError::UnknownSession { .. } => QE_INVALID_HANDLE,
            BackendError::Sessions { .. } => QE_INVALID_ARGUMENT,
            BackendError::Adapter(AdapterError::Gpu(_)) | BackendError::Gpu(_) => QE_GPU,
            BackendError::Adapter(_) | BackendError::AdapterNotSupported { .. } => QE_ADAPTER,
            BackendError::Run(_) => QE_RUN,
            BackendError::Learn(_) | BackendError::LearningNotSupported { .. } => QE_LEARN,
            BackendError::Text(_) | BackendError::NoTokenizer { .. } => QE_TEXT,
        };
        Self { status, message: e.to_string() }
    }
}

type Res<T> = Result<T, Fail>;

fn set_error(message: &str) {
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // try_with: a call from a thread-local destructor loses its message instead of aborting.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// Run `f` at the boundary: its error or panic becomes a status and the thread's last error.
fn guard(f: impl FnOnce() -> Res<()>) -> qe_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => QE_OK,
        Ok(Err(fail)) => {
            set_error(&fail.message);
            fail.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_error(&format!("panic inside qwen35-wgpu (a bug; please report it): {what}"));
            QE_PANIC
        }
    }
}

fn not_open(handle: qe_engine) -> Fail {
    Fail { status: QE_INVALID_HANDLE, message: format!("engine handle {handle} is not open (never made, or freed)") }
}

fn engine(handle: qe_engine) -> Res<Arc<Engine>> {
    engines().get(&handle).cloned().ok_or_else(|| not_open(handle))
}

/// The engine's state, refused from inside its own streaming callback, at any depth of nested
/// callbacks (the lock is held by the call running it: waiting would never end); from inside
/// another engine's callback, refused with QE_BUSY when another call holds it (two threads whose
/// callbacks call each other's engine would wait for each other). A call that waited while the
/// engine was freed finds the handle closed.
fn lock(e: &Engine) -> Res<MutexGuard<'_, State>> {
    // A thread whose locals are being torn down runs no callback (`in_callback` marks it there).
    let inside = IN_CALLBACK.try_with(|c| c.borrow().clone()).unwrap_or_default();
    if inside.contains(&e.id) {
        return Err(Fail::arg(format!(
            "engine {} is running a streaming callback on this thread: only qe_cancel, qe_last_error, \
             qe_string_free and engines not running one here may be called from it",
            e.id
        )));
    }
    let poisoned = || Fail {
        status: QE_PANIC,
        message: "this engine is unusable after an earlier panic; free it and load the model again".into(),
    };
    let guard = if inside.is_empty() {
        e.state.lock().map_err(|_| poisoned())?
    } else {
        match e.state.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
            Err(TryLockError::WouldBlock) => {
                return Err(Fail {
                    status: QE_BUSY,
                    message: format!(
                        "engine {} is running another call, and this thread is inside a streaming callback \
                         (of engine {:?}), where waiting for it could wait forever: retry after the callback",
                        e.id, inside
                    ),
                })
            }
        }
    };
    if e.closed.load(Ordering::SeqCst) {
        return Err(not_open(e.id));
    }
    Ok(guard)
}

fn bad_session(engine: qe_engine, session: qe_session) -> Fail {
    Fail {
        status: QE_INVALID_HANDLE,
        message: format!(
            "session handle {session} is not open on engine {engine} (never made, freed, or another engine's)"
        ),
    }
}

/// The backend of `handle` with session `session` current.
fn with_session<T>(
    handle: qe_engine,
    session: qe_session,
    f: impl FnOnce(&mut WgpuBackend, Entry) -> Res<T>,
) -> Res<T> {
    let e = engine(handle)?;
    with_entry(Entry::new(&e), session, f)
}

/// [`with_session`] for a call armed before it read its arguments: a generating call looks its
/// engine up and arms its cancel flag first, so a qe_cancel made once the call began stops it.
fn with_entry<T>(entry: Entry, session: qe_session, f: impl FnOnce(&mut WgpuBackend, Entry) -> Res<T>) -> Res<T> {
    let e = entry.engine;
    let mut st = lock(e)?;
    let (_, id) = st.session(e.id, session)?;
    st.backend.select_session(id)?;
    f(&mut st.backend, entry)
}

impl State {
    /// The serial and backend session of `session`, a handle of engine `engine`.
    fn session(&self, engine: qe_engine, session: qe_session) -> Res<(u64, SessionId)> {
        let serial = session & u64::from(u32::MAX);
        match self.sessions.get(&serial) {
            Some(&id) if session >> SESSION_BITS == engine => Ok((serial, id)),
            _ => Err(bad_session(engine, session)),
        }
    }
}

/// The engine a call runs on and its cancel flag, armed when the call was made (before its lock).
struct Entry<'a> {
    engine: &'a Engine,
    cancel: CancelFlag,
}

impl<'a> Entry<'a> {
    /// A call made on `engine` now.
    fn new(engine: &'a Engine) -> Self {
        Self { engine, cancel: engine.cancel.armed() }
    }

    /// Whether the engine was cancelled (qe_cancel, qe_engine_free) since the call was made.
    fn cancelled(&self) -> bool {
        self.cancel.is_raised()
    }

    /// `params` with the call's cancel flag: a cancel stops the generation at its next token,
    /// also where no text is streamed (a tool call being gathered, special tokens).
    fn params(&self, params: &GenerateParams) -> GenerateParams {
        GenerateParams { cancel: Some(self.cancel.clone()), ..params.clone() }
    }

    /// Run the caller's callback `call`, this thread marked as running one of the engine's (a
    /// call on it from inside is refused, see [`lock`]).
    fn in_callback<R>(&self, call: impl FnOnce() -> R) -> R {
        // Unmarked only on a thread whose locals are being torn down, where `lock` reads none.
        let marked = IN_CALLBACK.try_with(|c| c.borrow_mut().push(self.engine.id)).is_ok();
        let r = call();
        if marked {
            let _ = IN_CALLBACK.try_with(|c| c.borrow_mut().pop());
        }
        r
    }
}

/// What a cancelled generation returns (with the text so far written).
fn cancelled() -> Fail {
    Fail { status: QE_CANCELLED, message: "cancelled by qe_cancel or qe_engine_free".into() }
}

/// The NUL-terminated UTF-8 string at `p`, named `name` in errors.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn text<'a>(p: *const c_char, name: &str) -> Res<&'a str> {
    if p.is_null() {
        return Err(Fail::arg(format!("{name} is null")));
    }
    // SAFETY: the caller guarantees a NUL-terminated string (checked non-null above).
    let bytes = unsafe { CStr::from_ptr(p) };
    bytes.to_str().map_err(|e| Fail::arg(format!("{name} is not valid UTF-8 (at byte {})", e.valid_up_to())))
}

/// Like [`text`], with null meaning "none".
///
/// # Safety
/// As [`text`].
unsafe fn opt_text<'a>(p: *const c_char, name: &str) -> Res<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: as the caller's contract.
    unsafe { text(p, name) }.map(Some)
}

/// Parse the JSON text at `p` (null: `T::default()` when `optional`).
///
/// # Safety
/// As [`text`].
unsafe fn parse<T: for<'de> Deserialize<'de> + Default>(p: *const c_char, name: &str, optional: bool) -> Res<T> {
    if p.is_null() && optional {
        return Ok(T::default());
    }
    // SAFETY: as the caller's contract.
    let s = unsafe { text(p, name) }?;
    serde_json::from_str(s).map_err(|e| Fail::arg(format!("{name}: {e}")))
}

/// Write `value` to the out pointer `out` (named `name`).
///
/// # Safety
/// `out` is null or valid for one write of `T`.
unsafe fn put<T>(out: *mut T, value: T, name: &str) -> Res<()> {
    if out.is_null() {
        return Err(Fail::arg(format!("{name} is null")));
    }
    // SAFETY: non-null and, by the caller's contract, valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

/// Hand `s` to the caller through `out` (freed with qe_string_free).
///
/// # Safety
/// As [`put`].
unsafe fn put_string(out: *mut *mut c_char, s: String, name: &str) -> Res<()> {
    // A NUL (which a byte-level tokenizer can generate) would end the C string early; with none
    // left, CString::new cannot fail.
    let c = CString::new(s.replace('\0', "\u{FFFD}")).unwrap_or_default();
    // SAFETY: as the caller's contract.
    unsafe { put(out, c.into_raw(), name) }
}

/// Check that an out pointer is not null before the work it reports is done.
fn need<T>(out: *mut T, name: &str) -> Res<()> {
    if out.is_null() {
        return Err(Fail::arg(format!("{name} is null")));
    }
    Ok(())
}

/// The text of the last failed call on this thread ("" if none failed yet). Valid until the
/// next call on this thread; owned by the library (do not free).
#[no_mangle]
pub extern "C" fn qe_last_error() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

/// The library's version, e.g. "0.1.0" (static; do not free).
#[no_mangle]
pub extern "C" fn qe_version() -> *const c_char {
    static VERSION: OnceLock<CString> = OnceLock::new();
    VERSION.get_or_init(|| CString::new(env!("CARGO_PKG_VERSION")).unwrap_or_default()).as_ptr()
}

/// The ABI version of the library ([`QE_ABI_VERSION`] of the header it was built with).
#[no_mangle]
pub extern "C" fn qe_abi_version() -> u32 {
    QE_ABI_VERSION
}

/// Free a string the library returned (null: nothing).
///
/// # Safety
/// `s` is null or a string returned through a `char **` of this library, not freed before and
/// not modified (a NUL written into it would make the free use the wrong size: copy it to edit).
#[no_mangle]
pub unsafe extern "C" fn qe_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: the caller passes a pointer from CString::into_raw, once.
        drop(unsafe { CString::from_raw(s) });
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct EngineOptions {
    max_context: Option<usize>,
    max_batch: Option<usize>,
    quantize: Option<String>,
}

/// Load the model in `model_dir` (a Hugging Face or MLX directory) on the default GPU and open
/// an engine for it. `options_json` (may be null): `{"max_context": 2048, "max_batch": 128,
/// "quantize": "q8" | "q4" | "q4-quality"}` (sessions' sizes; quantize 16/32-bit weights at
/// load). Writes the handle to `out`; free it with qe_engine_free.
///
/// # Safety
/// `model_dir` and `options_json` are null or NUL-terminated strings; `out` is null or valid
/// for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_engine_load(
    model_dir: *const c_char,
    options_json: *const c_char,
    out: *mut qe_engine,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let dir = unsafe { text(model_dir, "model_dir") }?;
        // SAFETY: the caller's contract.
        let o: EngineOptions = unsafe { parse(options_json, "options_json", true) }?;
        need(out, "out")?;
        let defaults = SessionOptions::default();
        let opts = SessionOptions {
            max_context: o.max_context.unwrap_or(defaults.max_context),
            max_batch: o.max_batch.unwrap_or(defaults.max_batch),
        };
        let quantize = match o.quantize.as_deref() {
            None => None,
            Some(q) => Some(QuantizeRecipe::parse(q).ok_or_else(|| {
                Fail::arg(format!("options_json quantize: expected \"q8\", \"q4\" or \"q4-quality\", found {q:?}"))
            })?),
        };
        let mut backend = WgpuBackend::new(opts)?;
        backend.load_model_with(Path::new(dir), &LoadOptions { quantize, ..Default::default() })?;
        let id = NEXT_ENGINE.fetch_add(1, Ordering::Relaxed);
        if id >> SESSION_BITS != 0 {
            return Err(Fail::arg(format!("{id} engines made: session handles hold engine numbers below 2^32")));
        }
        let spare = backend.current_session();
        let state = State { backend, sessions: BTreeMap::new(), next_serial: 1, spare };
        let e = Arc::new(Engine {
            id,
            state: Mutex::new(state),
            cancel: CancelFlag::new(),
            closed: AtomicBool::new(false),
        });
        engines().insert(id, e);
        // SAFETY: checked non-null by `need`; the caller's contract.
        unsafe { put(out, id, "out") }
    })
}

/// Close an engine: a generation running on it stops (QE_CANCELLED), and its sessions, adapters
/// and model are freed once no call on it is running. The handle and its sessions' handles are
/// invalid afterwards.
#[no_mangle]
pub extern "C" fn qe_engine_free(engine: qe_engine) -> qe_status {
    guard(|| {
        // Out of the table first: the teardown runs after the table's lock is released.
        let e = engines().remove(&engine).ok_or_else(|| not_open(engine))?;
        e.closed.store(true, Ordering::SeqCst);
        e.cancel.raise();
        drop(e);
        Ok(())
    })
}

/// Stop the generations called on `engine` before this call (the one running, and any still
/// waiting for the engine) after their current token; they return QE_CANCELLED with the text so
/// far. Later calls are not affected. Safe from any thread; never waits for the engine.
#[no_mangle]
pub extern "C" fn qe_cancel(engine: qe_engine) -> qe_status {
    guard(|| {
        self::engine(engine)?.cancel.raise();
        Ok(())
    })
}

/// Bound the GPU bytes the prompt-cache snapshots of all of `engine`'s sessions hold together
/// (default 256 MiB): past it the least recently used session's snapshots are freed first, so a
/// smaller budget only means more prefill on later requests; 0 keeps none between requests.
/// `bytes_out` (null: not written) receives the bytes they hold after the change.
///
/// # Safety
/// `bytes_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_set_snapshot_budget(engine: qe_engine, bytes: u64, bytes_out: *mut u64) -> qe_status {
    guard(|| {
        let e = self::engine(engine)?;
        let mut st = lock(&e)?;
        let b = &mut st.backend;
        b.set_snapshot_budget(bytes);
        let held = b.snapshot_bytes();
        if bytes_out.is_null() {
            return Ok(());
        }
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put(bytes_out, held, "bytes_out") }
    })
}

/// Open a session on `engine` (no adapter active, an empty context). Free it with
/// qe_session_free.
///
/// # Safety
/// `out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_session_create(engine: qe_engine, out: *mut qe_session) -> qe_status {
    guard(|| {
        need(out, "out")?;
        let e = self::engine(engine)?;
        let mut st = lock(&e)?;
        let serial = st.next_serial;
        if serial > u64::from(u32::MAX) {
            return Err(Fail::arg(format!("{serial} sessions made on engine {engine}: at most 2^32 - 1")));
        }
        let id = match st.spare.take() {
            Some(id) => id,
            None => st.backend.create_session()?,
        };
        st.next_serial += 1;
        st.sessions.insert(serial, id);
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put(out, engine << SESSION_BITS | serial, "out") }
    })
}

/// Close a session and free its caches. The handle is invalid afterwards. (The engine keeps one
/// backend session: when the last open handle is freed its memory stays, emptied, for the next
/// qe_session_create.)
#[no_mangle]
pub extern "C" fn qe_session_free(engine: qe_engine, session: qe_session) -> qe_status {
    guard(|| {
        let e = self::engine(engine)?;
        let mut st = lock(&e)?;
        let (serial, id) = st.session(engine, session)?;
        if st.backend.sessions().len() > 1 {
            st.backend.close_session(id)?;
        } else {
            // A loaded backend keeps one session: it stays, emptied, for the next create.
            st.backend.select_session(id)?;
            st.backend.session()?.reset();
            st.backend.set_adapters(&[])?;
            st.spare = Some(id);
        }
        st.sessions.remove(&serial);
        Ok(())
    })
}

/// Forget a session's context (its adapter set stays).
#[no_mangle]
pub extern "C" fn qe_session_reset(engine: qe_engine, session: qe_session) -> qe_status {
    guard(|| {
        with_session(engine, session, |b, _| {
            b.session()?.reset();
            Ok(())
        })
    })
}

/// Load the PEFT or MLX LoRA adapter at `path` (directory or .safetensors) and keep it
/// resident on the GPU under `id` (null: its directory name; a taken id gets a suffix). It is
/// not active in any session. Writes the id given to `id_out` (free with qe_string_free). A
/// failed load changes nothing.
///
/// # Safety
/// `path` and `id` are null or NUL-terminated strings; `id_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_adapter_load(
    engine: qe_engine,
    path: *const c_char,
    id: *const c_char,
    id_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let path = unsafe { text(path, "path") }?;
        // SAFETY: the caller's contract.
        let id = unsafe { opt_text(id, "id") }?;
        need(id_out, "id_out")?;
        let e = self::engine(engine)?;
        let got = lock(&e)?.backend.preload_adapter(Path::new(path), id)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(id_out, got, "id_out") }
    })
}

/// Unload resident adapter `id` (it leaves every session's set).
///
/// # Safety
/// `id` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn qe_adapter_remove(engine: qe_engine, id: *const c_char) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let id = unsafe { text(id, "id") }?;
        let e = self::engine(engine)?;
        lock(&e)?.backend.remove_adapter(id)?;
        Ok(())
    })
}

/// The resident adapters as JSON: `[{"id", "name", "path", "ranks", "modules", "gpu_bytes"}]`
/// (`modules`: the number of (layer, projection) pairs adapted). Free with qe_string_free.
///
/// # Safety
/// `json_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_adapters_list(engine: qe_engine, json_out: *mut *mut c_char) -> qe_status {
    guard(|| {
        need(json_out, "json_out")?;
        let e = self::engine(engine)?;
        let list = lock(&e)?.backend.list_adapters()?;
        let v: Vec<Value> = list
            .iter()
            .map(|(id, a)| {
                json!({"id": id, "name": a.name, "path": a.path, "ranks": a.ranks,
                       "modules": a.modules.len(), "gpu_bytes": a.gpu_bytes})
            })
            .collect();
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(json_out, Value::Array(v).to_string(), "json_out") }
    })
}

/// What resident adapter `id` is, as JSON: `{"id", "name", "path", "ranks", "config_source",
/// "modules": [[layer, "q_proj"], ...], "ignored_count", "gpu_bytes"}` (free with
/// qe_string_free).
///
/// # Safety
/// `id` is null or a NUL-terminated string; `json_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_adapter_info(
    engine: qe_engine,
    id: *const c_char,
    json_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let id = unsafe { text(id, "id") }?;
        need(json_out, "json_out")?;
        let e = self::engine(engine)?;
        let list = lock(&e)?.backend.list_adapters()?;
        let (id, a) = list.iter().find(|(i, _)| i == id).ok_or_else(|| {
            Fail::from(BackendError::Adapter(AdapterError::UnknownId {
                id: id.to_string(),
                resident: list.iter().map(|(i, _)| i.clone()).collect(),
            }))
        })?;
        let modules: Vec<Value> = a.modules.iter().map(|(l, p)| json!([l, p.name()])).collect();
        let v = json!({"id": id, "name": a.name, "path": a.path, "ranks": a.ranks,
                       "config_source": format!("{:?}", a.config_source), "modules": modules,
                       "ignored_count": a.ignored_count, "gpu_bytes": a.gpu_bytes});
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(json_out, v.to_string(), "json_out") }
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetEntry {
    id: String,
    scale: f32,
    #[serde(default)]
    layers: Vec<LayerRule>,
}

/// One per-layer rule: `{"layers": [start, end], "projections": ["q_proj", ...], "factor": f}`
/// (either of layers / projections may be left out: all of them).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerRule {
    layers: Option<[usize; 2]>,
    projections: Option<Vec<String>>,
    factor: f32,
}

fn projections(names: &[String]) -> Res<Vec<Proj>> {
    names
        .iter()
        .map(|n| {
            Proj::ALL.into_iter().find(|p| p.name() == n).ok_or_else(|| {
                Fail::arg(format!("set_json projections: expected a projection name such as \"q_proj\", found {n:?}"))
            })
        })
        .collect()
}

fn weights(set: Vec<SetEntry>) -> Res<Vec<AdapterWeight>> {
    set.into_iter()
        .map(|e| {
            let mut scales = LayerScales::default();
            for r in e.layers {
                scales = match (r.layers, r.projections) {
                    (Some([a, b]), Some(p)) => scales.at(a..b, &projections(&p)?, r.factor),
                    (Some([a, b]), None) => scales.layers(a..b, r.factor),
                    (None, Some(p)) => scales.projections(&projections(&p)?, r.factor),
                    (None, None) => scales.projections(&Proj::ALL, r.factor),
                };
            }
            Ok(AdapterWeight::new(e.id, e.scale).with_layers(scales))
        })
        .collect()
}

/// Replace a session's whole active adapter set: `set_json` = `[{"id": "shout", "scale": 1.0,
/// "layers": [{"layers": [16, 24], "factor": 1.0}, {"projections": ["q_proj"], "factor": 0}]}]`
/// (`layers` optional; rules that match a (layer, projection) multiply). `[]`: the base model.
/// The adapters' deltas are summed (stacked into one pass). On error nothing changes.
///
/// # Safety
/// `set_json` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn qe_session_set_adapters(
    engine: qe_engine,
    session: qe_session,
    set_json: *const c_char,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let set: Vec<SetEntry> = unsafe { parse(set_json, "set_json", false) }?;
        let set = weights(set)?;
        with_session(engine, session, |b, _| Ok(b.set_adapters(&set)?))
    })
}

/// Make resident adapter `id` the session's only active adapter, at `scale`.
///
/// # Safety
/// `id` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn qe_session_activate(
    engine: qe_engine,
    session: qe_session,
    id: *const c_char,
    scale: f32,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let id = unsafe { text(id, "id") }?;
        with_session(engine, session, |b, _| Ok(b.activate_adapter(id, scale)?))
    })
}

/// Change the scale of the session's one active adapter (an error while several are active).
#[no_mangle]
pub extern "C" fn qe_session_set_scale(engine: qe_engine, session: qe_session, scale: f32) -> qe_status {
    guard(|| with_session(engine, session, |b, _| Ok(b.set_adapter_scale(scale)?)))
}

/// Deactivate every adapter of the session (they stay resident): the base model.
#[no_mangle]
pub extern "C" fn qe_session_deactivate(engine: qe_engine, session: qe_session) -> qe_status {
    guard(|| with_session(engine, session, |b, _| Ok(b.deactivate_adapter()?)))
}

/// The session's active set as JSON `[{"id", "scale"}]` (free with qe_string_free).
///
/// # Safety
/// `json_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_session_adapters(
    engine: qe_engine,
    session: qe_session,
    json_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        need(json_out, "json_out")?;
        let set = with_session(engine, session, |b, _| Ok(b.active_adapters()?))?;
        let v: Vec<Value> = set.iter().map(|a| json!({"id": a.id, "scale": a.scale})).collect();
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(json_out, Value::Array(v).to_string(), "json_out") }
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    max_tokens: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
    repetition_penalty: f32,
    stop: Vec<String>,
    stop_at_eos: bool,
}

impl Default for Params {
    fn default() -> Self {
        let d = GenerateParams::default();
        Self {
            max_tokens: d.max_tokens,
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            seed: d.seed,
            repetition_penalty: d.repetition_penalty,
            stop: d.stop,
            stop_at_eos: d.stop_at_eos,
        }
    }
}

impl From<Params> for GenerateParams {
    fn from(p: Params) -> Self {
        Self {
            max_tokens: p.max_tokens,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            seed: p.seed,
            repetition_penalty: p.repetition_penalty,
            stop: p.stop,
            stop_at_eos: p.stop_at_eos,
            cancel: None,
        }
    }
}

/// A streaming sink over the C callback and the call's cancel flag (once raised it stays raised);
/// `stopped` tells whether the callback stopped it (it is not called again).
struct Sink<'a> {
    cb: qe_delta_fn,
    user: *mut c_void,
    entry: Entry<'a>,
    stopped: bool,
}

impl<'a> Sink<'a> {
    fn new(cb: qe_delta_fn, user: *mut c_void, entry: Entry<'a>) -> Self {
        Self { cb, user, entry, stopped: false }
    }

    /// Whether to go on (false once the engine was cancelled after the call was made, or the
    /// callback asked to stop).
    fn tick(&self) -> bool {
        !self.entry.cancelled() && !self.stopped
    }

    fn push(&mut self, delta: &str) -> bool {
        if !self.tick() {
            return false;
        }
        let Some(f) = self.cb else { return true };
        // SAFETY: the caller's callback, given valid text for the duration of the call.
        let go_on = self.entry.in_callback(|| unsafe { f(delta.as_ptr().cast(), delta.len(), self.user) }) != 0;
        self.stopped = !go_on;
        go_on
    }
}

fn finish(sink: &Sink, out: *mut *mut c_char, text: String, name: &str) -> Res<()> {
    // SAFETY: checked non-null by the caller of `finish`; the caller's contract.
    unsafe { put_string(out, text, name) }?;
    // Also a generation the cancel stopped at a token that streamed nothing.
    if sink.entry.cancelled() {
        return Err(cancelled());
    }
    Ok(())
}

/// Continue `session` with the raw text `prompt` (no chat template) and generate. `params_json`
/// (may be null): `{"max_tokens", "temperature", "top_k", "top_p", "seed",
/// "repetition_penalty", "stop": [...], "stop_at_eos"}`. `on_delta` (may be null) gets the text
/// as it is generated; returning 0 stops. Writes the whole text to `text_out` (free with
/// qe_string_free), also after QE_CANCELLED (empty when the cancel came before the call got the
/// engine: nothing ran). `text_out` can differ from the streamed text: a NUL character the
/// model generates streams as is but comes back as U+FFFD there, and when the callback stops a
/// generation with stop strings it also holds the text that was held back (not yet streamed)
/// while a stop string could still match.
///
/// # Safety
/// `prompt` and `params_json` are null or NUL-terminated strings; `text_out` is null or valid
/// for a write; `on_delta` is null or a function that may be called with `user` during the
/// call.
#[no_mangle]
pub unsafe extern "C" fn qe_generate(
    engine: qe_engine,
    session: qe_session,
    prompt: *const c_char,
    params_json: *const c_char,
    on_delta: qe_delta_fn,
    user: *mut c_void,
    text_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        let e = self::engine(engine)?;
        let entry = Entry::new(&e);
        // SAFETY: the caller's contract.
        let prompt = unsafe { text(prompt, "prompt") }?;
        // SAFETY: the caller's contract.
        let params: Params = unsafe { parse(params_json, "params_json", true) }?;
        need(text_out, "text_out")?;
        with_entry(entry, session, |b, entry| {
            let params = entry.params(&params.into());
            let mut sink = Sink::new(on_delta, user, entry);
            // Cancelled while waiting for the engine: nothing runs.
            if sink.entry.cancelled() {
                return finish(&sink, text_out, String::new(), "text_out");
            }
            let text = b.generate_stream(prompt, &params, &mut |d| sink.push(d))?;
            finish(&sink, text_out, text, "text_out")
        })
    })
}

/// The most requests one batch call takes: the sessions an engine keeps open.
const MAX_BATCH: usize = qwen35_wgpu::MAX_SESSIONS;
const _: () = assert!(MAX_BATCH <= qwen35_wgpu::runtime::MAX_BATCH_SESSIONS, "a batch call's sessions fit one Batch");

/// A batch call's streaming sink over the C callback and the call's cancel flag (once raised it
/// stays raised): `stopped[i]` tells whether the callback stopped request `i` (it is not called
/// for it again).
struct BatchSink<'a> {
    cb: qe_batch_delta_fn,
    user: *mut c_void,
    entry: Entry<'a>,
    stopped: Vec<bool>,
}

impl BatchSink<'_> {
    /// Whether request `i` goes on (false once the engine was cancelled after the call was
    /// made, or the callback stopped it).
    fn tick(&self, i: usize) -> bool {
        !self.entry.cancelled() && !self.stopped[i]
    }

    fn push(&mut self, i: usize, delta: &str) -> bool {
        if !self.tick(i) {
            return false;
        }
        let Some(f) = self.cb else { return true };
        // SAFETY: the caller's callback, given valid text for the duration of the call.
        let go_on = self.entry.in_callback(|| unsafe { f(i, delta.as_ptr().cast(), delta.len(), self.user) }) != 0;
        self.stopped[i] = !go_on;
        go_on
    }
}

/// The course qe_generate_batch and qe_chat_batch share, for the call's `entry` (its engine,
/// armed before the call read its arguments): the `n` sessions and the `n` strings
/// at `inputs` (named `input` in errors, `input[i]`) checked and each made a request by `parse`,
/// then under the engine's lock the sessions' backend ids found, `run` over them with a sink on
/// the callback, and the `n` texts it returns written to `out` (also after a cancel, which then
/// is the status; `empty` for each when the cancel came before the engine was free).
///
/// # Safety
/// `sessions` and `inputs` are null or valid for `n` reads, each input null or a NUL-terminated
/// string, none changing during the call; `out` is null or valid for `n` writes; `cb` is null or
/// a function that may be called with `user` during the call.
unsafe fn run_batch<'a, T>(
    entry: Entry,
    (sessions, inputs, n, input): (*const qe_session, *const *const c_char, usize, &str),
    parse: impl Fn(usize, &'a str) -> Res<T>,
    (cb, user): (qe_batch_delta_fn, *mut c_void),
    (out, out_name, empty): (*mut *mut c_char, &str, String),
    run: impl FnOnce(&mut WgpuBackend, Vec<(SessionId, T)>, &mut BatchSink) -> Res<Vec<String>>,
) -> Res<()> {
    let e = entry.engine;
    if n == 0 {
        return Ok(());
    }
    if n > MAX_BATCH {
        return Err(Fail::arg(format!("n is {n}: at most {MAX_BATCH} requests (an engine's sessions)")));
    }
    need(sessions.cast_mut(), "sessions")?;
    need(inputs.cast_mut(), input)?;
    need(out, out_name)?;
    // SAFETY: non-null, and by the caller's contract valid for n reads.
    let (handles, ptrs) = unsafe { (std::slice::from_raw_parts(sessions, n), std::slice::from_raw_parts(inputs, n)) };
    let mut parsed = Vec::with_capacity(n);
    for (i, &p) in ptrs.iter().enumerate() {
        // SAFETY: the caller's contract.
        let s: &'a str = unsafe { text(p, &format!("{input}[{i}]")) }?;
        parsed.push(parse(i, s)?);
    }
    let mut st = lock(e)?;
    let mut requests = Vec::with_capacity(n);
    for (&handle, request) in handles.iter().zip(parsed) {
        requests.push((st.session(e.id, handle)?.1, request));
    }
    let mut sink = BatchSink { cb, user, entry, stopped: vec![false; n] };
    // Cancelled while waiting for the engine: nothing runs, each output is the empty one.
    let results = if sink.entry.cancelled() { vec![empty; n] } else { run(&mut st.backend, requests, &mut sink)? };
    for (i, text) in results.into_iter().enumerate().take(n) {
        // SAFETY: element i < n of the caller's array, valid for a write by the contract.
        unsafe { put_string(out.add(i), text, out_name) }?;
    }
    if sink.entry.cancelled() {
        return Err(cancelled());
    }
    Ok(())
}

/// Continue `n` sessions at once, each with its raw text prompt (no chat template), and generate:
/// request `i` is `sessions[i]` with `prompts[i]`, as qe_generate would run it alone (its
/// adapter set, its prompt cache, the same text), and the sessions decode together (each step
/// reads the weights once for all of them). `params_json` as in qe_generate; each request stops
/// at EOS, `max_tokens` or a stop string on its own, and where its session's context fills it
/// ends with what it has (alone that is QE_RUN). `on_delta` (may be null) gets each request's
/// text as it is generated, with the request's index; returning 0 stops that request.
/// Writes request `i`'s whole text to `texts_out[i]` (free each with qe_string_free), also
/// after QE_CANCELLED; after another failure `texts_out` is left as it was. A session asked for
/// twice is QE_INVALID_ARGUMENT, and so are more than 64 requests; `n` = 0 does nothing.
///
/// # Safety
/// `sessions` and `prompts` are null or valid for `n` reads, each prompt null or a
/// NUL-terminated string, none of them changing during the call (the callback included);
/// `params_json` as in qe_generate; `texts_out` is null or valid for `n` writes; `on_delta` is
/// null or a function that may be called with `user` during the call.
#[no_mangle]
pub unsafe extern "C" fn qe_generate_batch(
    engine: qe_engine,
    sessions: *const qe_session,
    prompts: *const *const c_char,
    n: usize,
    params_json: *const c_char,
    on_delta: qe_batch_delta_fn,
    user: *mut c_void,
    texts_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        let e = self::engine(engine)?;
        let entry = Entry::new(&e);
        // SAFETY: the caller's contract.
        let params: Params = unsafe { parse(params_json, "params_json", true) }?;
        let params = params.into();
        // SAFETY: the caller's contract, as run_batch's.
        unsafe {
            run_batch(
                entry,
                (sessions, prompts, n, "prompts"),
                |_, prompt| Ok(prompt),
                (on_delta, user),
                (texts_out, "texts_out", String::new()),
                |b, r, sink| {
                    let params = sink.entry.params(&params);
                    Ok(b.generate_batch_stream(&r, &params, &mut |i, delta| sink.push(i, delta))?)
                },
            )
        }
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Chat {
    messages: Vec<ChatMessage>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    enable_thinking: Option<bool>,
    #[serde(default)]
    vars: serde_json::Map<String, Value>,
    #[serde(default)]
    sanitize_control_tokens: bool,
    #[serde(default)]
    documents: Option<Vec<Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<Continue>,
}

/// `continue_final_message`: `true` continues the final message's content, a string names the
/// field to continue (`"reasoning_content"`), `false` is the default.
#[derive(Deserialize)]
#[serde(untagged)]
enum Continue {
    Flag(bool),
    Field(String),
}

impl Chat {
    /// The request the backend renders: tool-call arguments sent as a JSON string (OpenAI's
    /// form) parsed into the object Qwen's templates iterate, as vLLM does.
    fn request(self) -> ChatRequest {
        let mut request = ChatRequest::new(self.messages).parse_tool_arguments();
        request.tools = self.tools;
        request.vars = self.vars;
        request.sanitize_control_tokens = self.sanitize_control_tokens;
        request.documents = self.documents;
        request.continue_final_message = match self.continue_final_message {
            Some(Continue::Flag(true)) => Some("content".into()),
            Some(Continue::Field(field)) => Some(field),
            Some(Continue::Flag(false)) | None => None,
        };
        // Continuing the final message starts no new turn unless the request says so (and then
        // the template refuses the two together, as transformers does).
        request.add_generation_prompt = self.add_generation_prompt.unwrap_or(request.continue_final_message.is_none());
        if let Some(on) = self.enable_thinking {
            request = request.thinking(on);
        }
        request
    }
}

/// One chat turn in `session`: `request_json` = `{"messages": [{"role": "user", "content":
/// "..."}, ...], "tools": [...], "enable_thinking": false, "vars": {...},
/// "sanitize_control_tokens": false, "documents": [...], "add_generation_prompt": true,
/// "continue_final_message": false}` (OpenAI / transformers message dicts, tool-call arguments as
/// an object or, as OpenAI sends them, a JSON string; the model's chat template renders them, with
/// transformers' `apply_chat_template` arguments of the same names;
/// `sanitize_control_tokens: true` encodes control tokens written in the request's strings, like
/// a user's `<|im_end|>`, as plain text; `continue_final_message` is `true` for the final
/// message's content or the name of the field to continue, and then `add_generation_prompt`
/// defaults to false). `params_json` and `on_delta` as in
/// qe_generate (`on_delta` gets the answer's text; reasoning and tool calls are in the reply).
/// Writes the reply to `reply_out` as JSON `{"content", "reasoning_content", "tool_calls",
/// "text"}` (free with qe_string_free), also after QE_CANCELLED. A conversation that grows turn by turn prefills only
/// the new turn (the session's prompt cache).
///
/// # Safety
/// As qe_generate, with `request_json` for `prompt`.
#[no_mangle]
pub unsafe extern "C" fn qe_chat(
    engine: qe_engine,
    session: qe_session,
    request_json: *const c_char,
    params_json: *const c_char,
    on_delta: qe_delta_fn,
    user: *mut c_void,
    reply_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        let e = self::engine(engine)?;
        let entry = Entry::new(&e);
        // SAFETY: the caller's contract.
        let chat: Chat = unsafe { parse(request_json, "request_json", false) }?;
        // SAFETY: the caller's contract.
        let params: Params = unsafe { parse(params_json, "params_json", true) }?;
        need(reply_out, "reply_out")?;
        let request = chat.request();
        with_entry(entry, session, |b, entry| {
            let params = entry.params(&params.into());
            let mut sink = Sink::new(on_delta, user, entry);
            // Cancelled while waiting for the engine: nothing runs.
            if sink.entry.cancelled() {
                let empty = qwen35_wgpu::ChatReply::default();
                return finish(&sink, reply_out, reply_json(&empty), "reply_out");
            }
            let reply = b.chat(&request, &params, &mut |d| match d {
                qwen35_wgpu::ChatDelta::Content(c) => sink.push(c),
                _ => sink.tick(),
            })?;
            finish(&sink, reply_out, reply_json(&reply), "reply_out")
        })
    })
}

/// A reply as qe_chat writes it.
fn reply_json(reply: &qwen35_wgpu::ChatReply) -> String {
    json!({
        "content": reply.content,
        "reasoning_content": reply.reasoning_content,
        "tool_calls": reply.tool_calls,
        "text": reply.text,
    })
    .to_string()
}

/// One chat turn in each of `n` sessions at once: request `i` is qe_chat of `requests_json[i]`
/// in `sessions[i]` (its template, adapter set and prompt cache, the same reply), the sessions
/// decoding together as in qe_generate_batch. `params_json` as in qe_generate; `on_delta` (may
/// be null) gets each request's answer text with the request's index, returning 0 stops that
/// request. Writes request `i`'s reply JSON (as qe_chat's) to `replies_out[i]` (free each with
/// qe_string_free), also after QE_CANCELLED; after another failure `replies_out` is left as it
/// was. The same refusals as qe_generate_batch, and a malformed request is QE_INVALID_ARGUMENT
/// naming its index.
///
/// # Safety
/// As qe_generate_batch, with `requests_json` for `prompts` and `replies_out` for `texts_out`.
#[no_mangle]
pub unsafe extern "C" fn qe_chat_batch(
    engine: qe_engine,
    sessions: *const qe_session,
    requests_json: *const *const c_char,
    n: usize,
    params_json: *const c_char,
    on_delta: qe_batch_delta_fn,
    user: *mut c_void,
    replies_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        let e = self::engine(engine)?;
        let entry = Entry::new(&e);
        // SAFETY: the caller's contract.
        let params: Params = unsafe { parse(params_json, "params_json", true) }?;
        let params = params.into();
        let io = (replies_out, "replies_out", reply_json(&qwen35_wgpu::ChatReply::default()));
        let parse = |i: usize, json: &str| -> Res<ChatRequest> {
            let chat: Chat = serde_json::from_str(json).map_err(|e| Fail::arg(format!("requests_json[{i}]: {e}")))?;
            Ok(chat.request())
        };
        // SAFETY: the caller's contract, as run_batch's.
        unsafe {
            run_batch(
                entry,
                (sessions, requests_json, n, "requests_json"),
                parse,
                (on_delta, user),
                io,
                |b, r, sink| {
                    let asks: Vec<_> = r.iter().map(|(id, request)| (*id, request)).collect();
                    let params = sink.entry.params(&params);
                    let replies = b.chat_batch(&asks, &params, &mut |i, d| match d {
                        qwen35_wgpu::ChatDelta::Content(c) => sink.push(i, c),
                        _ => sink.tick(i),
                    })?;
                    Ok(replies.iter().map(reply_json).collect())
                },
            )
        }
    })
}

/// An embedding of `text` (the mean of the final hidden states; uses and resets `session`):
/// writes up to `capacity` floats to `out` and their number to `len_out`. When `capacity` is
/// too small or `out` is null, nothing runs (the session is left as it was), `len_out` gets the
/// size needed and the call returns QE_INVALID_ARGUMENT.
///
/// # Safety
/// `text` is null or a NUL-terminated string; `out` is null or valid for `capacity` floats;
/// `len_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_embeddings(
    engine: qe_engine,
    session: qe_session,
    text: *const c_char,
    out: *mut f32,
    capacity: usize,
    len_out: *mut usize,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let text = unsafe { self::text(text, "text") }?;
        need(len_out, "len_out")?;
        with_session(engine, session, |b, _| {
            // The size is known before the forward: a size query runs nothing and keeps the
            // session as it is.
            let needed = b.model_info().ok_or(BackendError::NoModel)?.config.hidden_size;
            // SAFETY: checked non-null; the caller's contract.
            unsafe { put(len_out, needed, "len_out") }?;
            if needed > capacity || out.is_null() {
                return Err(Fail::arg(format!("out: {needed} floats needed, capacity {capacity}")));
            }
            let v = b.embeddings(text)?;
            if v.len() != needed {
                return Err(Fail { status: QE_RUN, message: format!("{} floats made, {needed} expected", v.len()) });
            }
            // SAFETY: out is valid for `capacity` ≥ v.len() floats by the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out, v.len()) };
            Ok(())
        })
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Spec {
    rank: Option<usize>,
    alpha: Option<f32>,
    targets: Option<Vec<String>>,
    layers: Option<Vec<usize>>,
    seed: Option<u64>,
    id: Option<String>,
}

/// Create a trainable adapter (PEFT initialisation: the answers do not change until the first
/// step) and make it the session's active adapter. `spec_json` (may be null): `{"rank": 8,
/// "alpha": 16, "targets": ["q_proj", ...], "layers": [...], "seed": 0, "id": "feedback"}`.
/// Writes its id to `id_out` (free with qe_string_free).
///
/// # Safety
/// `spec_json` is null or a NUL-terminated string; `id_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_trainable_create(
    engine: qe_engine,
    session: qe_session,
    spec_json: *const c_char,
    id_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let s: Spec = unsafe { parse(spec_json, "spec_json", true) }?;
        need(id_out, "id_out")?;
        if let Some(at) = s.id.as_deref().and_then(|id| id.find('\0')) {
            return Err(Fail::arg(format!("spec_json id: expected no NUL character, found one at byte {at}")));
        }
        let d = TrainSpec::default();
        let targets = match s.targets {
            Some(t) => projections(&t)?,
            None => LEARNABLE.to_vec(),
        };
        let spec = TrainSpec {
            rank: s.rank.unwrap_or(d.rank),
            alpha: s.alpha.unwrap_or(d.alpha),
            targets,
            layers: s.layers,
            seed: s.seed.unwrap_or(d.seed),
            id: s.id,
        };
        let id = with_session(engine, session, |b, _| Ok(b.create_trainable_adapter(&spec)?))?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(id_out, id, "id_out") }
    })
}

/// Load a PEFT adapter as the trainable one (continue training it), active in the session.
///
/// # Safety
/// As qe_adapter_load.
#[no_mangle]
pub unsafe extern "C" fn qe_trainable_import(
    engine: qe_engine,
    session: qe_session,
    path: *const c_char,
    id_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let path = unsafe { text(path, "path") }?;
        need(id_out, "id_out")?;
        let id = with_session(engine, session, |b, _| Ok(b.import_trainable_adapter(Path::new(path))?))?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(id_out, id, "id_out") }
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Event {
    prompt: String,
    response: String,
    /// A score in [0, 1]; absent: the response is the preferred one.
    #[serde(default)]
    score: Option<f32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Options {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    max_grad_norm: f32,
    anchor_l2: f32,
    baseline_momentum: f32,
}

impl Default for Options {
    fn default() -> Self {
        let d = LearnOptions::default();
        Self {
            lr: d.lr,
            beta1: d.beta1,
            beta2: d.beta2,
            eps: d.eps,
            weight_decay: d.weight_decay,
            max_grad_norm: d.max_grad_norm,
            anchor_l2: d.anchor_l2,
            baseline_momentum: d.baseline_momentum,
        }
    }
}

/// One learning step of the trainable adapter on feedback, run in `session`: `events_json` =
/// `[{"prompt": "...", "response": "...", "score": 0.9}]` (no score: the response is the
/// preferred one); `options_json` (may be null): AdamW `{"lr", "beta1", "beta2", "eps",
/// "weight_decay", "max_grad_norm", "anchor_l2", "baseline_momentum"}`. Writes the report
/// `{"step", "event_ce", "grad_norm", "baseline"}` to `report_out` (free with qe_string_free).
///
/// # Safety
/// The strings are null or NUL-terminated; `report_out` is null or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qe_learn(
    engine: qe_engine,
    session: qe_session,
    events_json: *const c_char,
    options_json: *const c_char,
    report_out: *mut *mut c_char,
) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let events: Vec<Event> = unsafe { parse(events_json, "events_json", false) }?;
        // SAFETY: the caller's contract.
        let o: Options = unsafe { parse(options_json, "options_json", true) }?;
        need(report_out, "report_out")?;
        let events: Vec<FeedbackEvent> = events
            .into_iter()
            .map(|e| FeedbackEvent {
                prompt: e.prompt,
                response: e.response,
                signal: e.score.map_or(Signal::Preferred, Signal::Score),
            })
            .collect();
        let opts = LearnOptions {
            lr: o.lr,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
            max_grad_norm: o.max_grad_norm,
            anchor_l2: o.anchor_l2,
            baseline_momentum: o.baseline_momentum,
        };
        let r = with_session(engine, session, |b, _| Ok(b.learn(&events, &opts)?))?;
        let v = json!({"step": r.step, "event_ce": r.event_ce, "grad_norm": r.grad_norm, "baseline": r.baseline});
        // SAFETY: checked non-null; the caller's contract.
        unsafe { put_string(report_out, v.to_string(), "report_out") }
    })
}

/// Write the trainable adapter to `dir` as a PEFT adapter (adapter_config.json +
/// adapter_model.safetensors), loadable by peft, vLLM and qe_adapter_load.
///
/// # Safety
/// `dir` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn qe_trainable_export(engine: qe_engine, dir: *const c_char) -> qe_status {
    guard(|| {
        // SAFETY: the caller's contract.
        let dir = unsafe { text(dir, "dir") }?;
        let e = self::engine(engine)?;
        lock(&e)?.backend.export_trainable_adapter(Path::new(dir))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::Chat;

    #[test]
    fn openai_tool_call_arguments_reach_the_template_as_objects() {
        let json = r#"{"messages": [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "content": "sunny"}]}"#;
        let chat: Chat = serde_json::from_str(json).expect("request");
        let request = chat.request();
        let calls = request.messages[1].tool_calls.as_ref().expect("the assistant's calls");
        assert_eq!(calls[0].function.arguments, serde_json::json!({"city": "Paris"}));
    }

    /// The request's fields reach the ChatRequest the template renders (transformers'
    /// `apply_chat_template` arguments), `continue_final_message` without a new turn by default.
    #[test]
    fn apply_chat_template_arguments_reach_the_request() {
        let parse = |json: &str| serde_json::from_str::<Chat>(json).expect("request").request();
        let base = parse(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#);
        assert!(base.add_generation_prompt && base.continue_final_message.is_none() && base.documents.is_none());
        assert!(!base.sanitize_control_tokens);
        let all = parse(
            r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                "documents": [{"title": "t", "text": "x"}], "continue_final_message": true,
                "sanitize_control_tokens": true, "enable_thinking": false}"#,
        );
        assert_eq!(all.continue_final_message.as_deref(), Some("content"));
        assert!(!all.add_generation_prompt && all.sanitize_control_tokens);
        assert_eq!(all.documents, Some(vec![serde_json::json!({"title": "t", "text": "x"})]));
        assert_eq!(all.vars.get("enable_thinking"), Some(&serde_json::json!(false)));
        let field = parse(
            r#"{"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": "reasoning_content"}"#,
        );
        assert_eq!(field.continue_final_message.as_deref(), Some("reasoning_content"));
        let both = parse(
            r#"{"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": true, "add_generation_prompt": true}"#,
        );
        assert!(
            both.add_generation_prompt && both.continue_final_message.is_some(),
            "as asked: the template refuses it"
        );
        let off = parse(
            r#"{"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": false, "add_generation_prompt": false}"#,
        );
        assert!(!off.add_generation_prompt && off.continue_final_message.is_none());
    }
}

#[cfg(test)]
mod status_tests {
    use super::*;
    use qwen35_wgpu::GpuError;

    /// Out of memory and device errors are QE_GPU also where a model, run, adapter or learning
    /// error wraps them; the other errors keep their own codes.
    #[test]
    fn gpu_errors_are_qe_gpu_at_any_depth() {
        let gpu = || GpuError::RequestDevice("out of memory".into());
        let cases: Vec<(BackendError, qe_status)> = vec![
            (BackendError::Gpu(gpu()), QE_GPU),
            (BackendError::Model(ModelError::Gpu(gpu())), QE_GPU),
            (BackendError::Run(RunError::Gpu(gpu())), QE_GPU),
            (BackendError::Run(RunError::Adapter(Box::new(AdapterError::Gpu(gpu())))), QE_GPU),
            (BackendError::Adapter(AdapterError::Gpu(gpu())), QE_GPU),
            (BackendError::Learn(LearnError::Gpu(gpu())), QE_GPU),
            (BackendError::Learn(LearnError::Run(RunError::Gpu(gpu()))), QE_GPU),
            (BackendError::Run(RunError::EmptyInput), QE_RUN),
            (BackendError::Learn(LearnError::Run(RunError::EmptyInput)), QE_LEARN),
            (BackendError::NoModel, QE_MODEL),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            assert_eq!(Fail::from(e).status, want, "{text}");
        }
    }
}
