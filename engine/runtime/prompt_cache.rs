//! Reusing a session's state across requests: a request whose prompt starts with tokens the
//! session already computed (under the same adapter, scale and weights) prefills only the rest.
//!
//! The KV cache can be cut back to any position for free (later positions are overwritten), but
//! the GDN conv and recurrent states cannot be rolled back, so the cache keeps
//! [`StateSnapshot`]s at two points of every prompt it prefills: before the last turn-start
//! token (`<|im_start|>`, where the next chat turn's prompt goes on differently: Qwen's template
//! re-renders the previous assistant turn without its reasoning) and before the prompt's last
//! token. The request's own steps take them on their way ([`Session::snapshot_at`]: the GDN
//! dispatches split at those rows), so a new turn runs as one step, not one per snapshot point.
//! A new prompt continues from the session's state when it extends the tokens held (used only
//! while nothing else ran on the session), else from the longest snapshot that is a prefix of it
//! and that the session can still restore ([`Session::restorable`]: none taken before an adapter
//! set was bound on it), else from scratch. A learning step changes a bound adapter's weights
//! without the session knowing: after one the owner calls [`PromptCache::clear`], as the
//! backend does.

use crate::error::RunError;
use crate::runtime::session::{Session, StateSnapshot};

/// Snapshots kept per session (oldest dropped first): two per request, so the last two turns. At
/// the 0.8B dimensions one is 19 MiB (18 GDN layers: a 1 MiB recurrent state and a 72 KiB conv
/// history each), so one session's cache holds at most 77 MiB; the backend also bounds the bytes
/// of all its sessions' snapshots together (`WgpuBackend::set_snapshot_budget`).
pub const MAX_SNAPSHOTS: usize = 4;

/// What the prompt cache did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    /// Requests served.
    pub requests: u64,
    /// Prompt tokens not prefilled because the session already held them.
    pub reused_tokens: u64,
    /// Prompt tokens prefilled.
    pub prefilled_tokens: u64,
}

/// The tokens a session holds and snapshots of its states (see the module docs).
pub struct PromptCache {
    enabled: bool,
    /// The tokens the session's state holds, when known, and the session's stamp then: they
    /// are used only while the stamp is unchanged (nothing else ran on the session since).
    tokens: Option<(Vec<u32>, (u64, u64))>,
    /// (the tokens before it, the snapshot), oldest first.
    snapshots: Vec<(Vec<u32>, StateSnapshot)>,
    stats: PromptCacheStats,
}

impl Default for PromptCache {
    fn default() -> Self {
        Self { enabled: true, tokens: None, snapshots: Vec::new(), stats: PromptCacheStats::default() }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    /// Turn reuse on or off (off: every request starts from scratch). On by default.
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        self.clear();
    }

    /// Whether reuse is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Forget what the session holds (its state no longer matches any tokens).
    pub fn clear(&mut self) {
        self.tokens = None;
        self.snapshots.clear();
    }

    /// Counters since the cache was made.
    pub fn stats(&self) -> PromptCacheStats {
        self.stats
    }

    /// Snapshots held.
    pub fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

    /// GPU bytes the snapshots hold.
    pub fn snapshot_bytes(&self) -> u64 {
        self.snapshots.iter().map(|(_, s)| s.bytes()).sum()
    }

    /// Free the oldest snapshot (a later prompt that would have gone on from it prefills more);
    /// false when there is none.
    pub fn drop_oldest(&mut self) -> bool {
        if self.snapshots.is_empty() {
            return false;
        }
        self.snapshots.remove(0);
        true
    }

    /// Bring `session` to a state that holds a prefix of `prompt` and return its length (fewer
    /// than `prompt.len()` tokens, so the request still has a token to run), and ask the
    /// session for the snapshots of this prompt ([`Session::snapshot_at`]): the request's own
    /// steps take them as they pass their positions, and [`PromptCache::finish`] keeps them.
    /// Nothing is prefilled here. `turn_start` is the tokenizer's `<|im_start|>` id.
    pub fn prepare(
        &mut self,
        session: &mut Session,
        prompt: &[u32],
        turn_start: Option<u32>,
    ) -> Result<usize, RunError> {
        // Snapshots of a request that did not finish are not this prompt's.
        drop(session.take_snapshots());
        let limit = prompt.len().saturating_sub(1);
        let mut fed = 0;
        match (&self.tokens, self.enabled) {
            (Some((held, stamp)), true)
                if *stamp == session.stamp() && held.len() <= limit && common_prefix(held, prompt) == held.len() =>
            {
                fed = held.len();
            }
            (_, true) => {
                let best = self
                    .snapshots
                    .iter()
                    .enumerate()
                    .filter(|(_, (t, snap))| {
                        t.len() <= limit && common_prefix(t, prompt) == t.len() && session.restorable(snap)
                    })
                    .max_by_key(|(_, (t, _))| t.len())
                    .map(|(i, _)| i);
                match best {
                    Some(i) => {
                        session.restore(&self.snapshots[i].1)?;
                        fed = self.snapshots[i].0.len();
                    }
                    None => session.reset(),
                }
            }
            (_, false) => session.reset(),
        }
        // Snapshots past the point the prompt goes on from will be overwritten.
        self.snapshots.retain(|(t, _)| t.len() <= fed && common_prefix(t, prompt) == t.len());
        self.tokens = None;
        self.stats.requests += 1;
        self.stats.reused_tokens += fed as u64;
        self.stats.prefilled_tokens += (prompt.len() - fed) as u64;
        if self.enabled {
            let turn = turn_start.and_then(|id| prompt[..limit].iter().rposition(|&t| t == id));
            let points = [turn, Some(limit)].into_iter().flatten().filter(|&p| p > fed);
            for (asked, point) in points.enumerate() {
                let reuse = (self.snapshots.len() + asked >= MAX_SNAPSHOTS && !self.snapshots.is_empty())
                    .then(|| self.snapshots.remove(0).1);
                session.snapshot_at(point, reuse)?;
            }
        }
        Ok(fed)
    }

    /// After a request on `prompt` generated `out`: the session holds the first
    /// `session.position()` tokens of the two, and the snapshots its steps took are kept.
    pub fn finish(&mut self, session: &mut Session, prompt: &[u32], out: &[u32]) {
        let taken = session.take_snapshots();
        if !self.enabled {
            return;
        }
        for snap in taken.into_iter().filter(|s| s.position() < prompt.len()) {
            if self.snapshots.len() >= MAX_SNAPSHOTS {
                self.snapshots.remove(0);
            }
            self.snapshots.push((prompt[..snap.position()].to_vec(), snap));
        }
        let held: Vec<u32> = prompt.iter().chain(out).copied().take(session.position()).collect();
        self.tokens = (held.len() == session.position()).then(|| (held, session.stamp()));
    }
}
