//! A counting global allocator for the fuzz worker: the peak live bytes and the largest single
//! allocation while an input is processed, and a per-input ceiling. An allocation over the ceiling
//! is refused (null), so an engine that sizes a buffer from a hostile field aborts at once with
//! Rust's "memory allocation of N bytes failed" instead of paging in gigabytes; the refusal is
//! also recorded for code that handles it (`try_reserve`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The allocator (registered with `#[global_allocator]` in main.rs).
pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static REFUSED: AtomicUsize = AtomicUsize::new(0);

fn admit(size: usize) -> bool {
    if size > LIMIT.load(Relaxed) {
        REFUSED.fetch_max(size, Relaxed);
        return false;
    }
    LARGEST.fetch_max(size, Relaxed);
    true
}

fn grew(size: usize) {
    let live = LIVE.fetch_add(size, Relaxed) + size;
    PEAK.fetch_max(live, Relaxed);
}

// SAFETY: every call is forwarded to `System` with the caller's layout; the counters are plain
// atomics and never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !admit(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Relaxed);
            grew(new_size);
        }
        p
    }
}

/// What one input allocated.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    /// Peak live bytes above the level at the start.
    pub peak: usize,
    /// The largest single allocation.
    pub largest: usize,
    /// The largest allocation refused for exceeding the ceiling (0: none).
    pub refused: usize,
}

/// Start measuring an input with at most `limit` bytes per allocation.
pub fn begin(limit: usize) -> usize {
    let live = LIVE.load(Relaxed);
    PEAK.store(live, Relaxed);
    LARGEST.store(0, Relaxed);
    REFUSED.store(0, Relaxed);
    LIMIT.store(limit, Relaxed);
    live
}

/// Stop measuring (lifting the ceiling) and report.
pub fn end(start_live: usize) -> Usage {
    LIMIT.store(usize::MAX, Relaxed);
    Usage {
        peak: PEAK.load(Relaxed).saturating_sub(start_live),
        largest: LARGEST.load(Relaxed),
        refused: REFUSED.load(Relaxed),
    }
}
