//! Snapshots of a session's GDN states ([`StateSnapshot`]): taken between steps
//! ([`Session::snapshot`]), or by the step that passes a position asked for
//! ([`Session::snapshot_at`]: its conv and delta-rule dispatches split at that row and write the
//! states there into the snapshot, so a prompt's prefix is kept without running it as a step of
//! its own), and restored ([`Session::restore`]).

use crate::error::RunError;
use crate::kernels::gdn::GdnSplit;
use crate::runtime::cache::LayerState;

use super::Session;

/// A session's GDN states at a position ([`Session::snapshot`]), on the GPU.
pub struct StateSnapshot {
    pos: usize,
    /// Each GDN layer's conv history and recurrent state, in layer order.
    buffers: Vec<wgpu::Buffer>,
    /// The session it was taken from, and that session's count of moves back and adapter
    /// version at the time.
    session: u64,
    rewinds: u64,
    adapters: u64,
}

impl StateSnapshot {
    /// The position it was taken at (the number of tokens the session held).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// GPU bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.buffers.iter().map(wgpu::Buffer::size).sum()
    }
}

/// The snapshots asked for with [`Session::snapshot_at`].
#[derive(Default)]
pub(crate) struct Taps {
    /// Positions not reached yet, in order, each with an older snapshot's buffers to reuse.
    pending: Vec<(usize, Option<StateSnapshot>)>,
    /// Taken by the last step, which is not committed yet: its position and the session's
    /// epoch then (a commit of that step finds both unchanged).
    fired: Option<(usize, u64, Vec<StateSnapshot>)>,
    /// Taken by committed steps (or at once), in position order.
    taken: Vec<StateSnapshot>,
}

/// The snapshots one step takes: at rows inside it (its GDN dispatches split there) or at its end
/// (copies of the states it writes).
pub(crate) struct StepTaps {
    snaps: Vec<StateSnapshot>,
    /// The step's first position and its tokens.
    pos: usize,
    t: usize,
}

impl StepTaps {
    /// The snapshots at rows inside the step (the rest are at its end).
    fn inner(&self) -> impl Iterator<Item = &StateSnapshot> {
        let end = self.pos + self.t;
        self.snaps.iter().filter(move |s| s.pos < end)
    }

    /// The buffers of the snapshots the step's GDN dispatches write and read at inner rows.
    pub(crate) fn split_buffers(&self) -> Vec<&wgpu::Buffer> {
        self.inner().flat_map(|s| &s.buffers).collect()
    }

    /// The splits of the `g`-th GDN layer's step, in row order.
    pub(crate) fn splits(&self, g: usize) -> Vec<GdnSplit<'_>> {
        self.inner()
            .map(|s| GdnSplit { row: s.pos - self.pos, conv: &s.buffers[2 * g], state: &s.buffers[2 * g + 1] })
            .collect()
    }

    /// Where the `g`-th GDN layer's states after the step are copied: (conv, state) pairs.
    pub(crate) fn at_end(&self, g: usize) -> impl Iterator<Item = [&wgpu::Buffer; 2]> {
        let end = self.pos + self.t;
        self.snaps.iter().filter(move |s| s.pos == end).map(move |s| [&s.buffers[2 * g], &s.buffers[2 * g + 1]])
    }
}

impl Session {
    /// Every GDN layer's conv history and recurrent state at the committed parity, in layer
    /// order: what a snapshot copies, in its order.
    fn gdn_states(&self) -> impl Iterator<Item = &wgpu::Buffer> {
        self.states.iter().flat_map(|st| match st {
            LayerState::Gdn { conv, state } => vec![&conv[self.parity], &state[self.parity]],
            LayerState::Attention { .. } => Vec::new(),
        })
    }

    /// Buffers for a snapshot: one per GDN state buffer, sized alike (`reuse`'s where they fit).
    fn snapshot_buffers(&self, reuse: Option<StateSnapshot>) -> Result<Vec<wgpu::Buffer>, RunError> {
        let mut kept = reuse.map(|s| s.buffers).unwrap_or_default().into_iter();
        self.gdn_states()
            .map(|src| match kept.next() {
                Some(b) if b.size() == src.size() => Ok(b),
                _ => Ok(self.ctx().storage_buffer("state snapshot", src.size(), true)?),
            })
            .collect()
    }

    fn new_snapshot(&self, pos: usize, buffers: Vec<wgpu::Buffer>) -> StateSnapshot {
        StateSnapshot { pos, buffers, session: self.uid, rewinds: self.rewinds, adapters: self.adapters_version }
    }

    /// A copy of the state the next step starts from: the position and every GDN layer's conv
    /// and recurrent state (the KV cache needs no copy: positions below this one are only
    /// written again after the session moves back past them). `reuse` gives back the buffers
    /// of an older snapshot of this session.
    pub fn snapshot(&self, reuse: Option<StateSnapshot>) -> Result<StateSnapshot, RunError> {
        let buffers = self.snapshot_buffers(reuse)?;
        let ctx = self.ctx();
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("snapshot") });
        for (src, dst) in self.gdn_states().zip(&buffers) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size());
        }
        ctx.submit(enc.finish(), 0);
        Ok(self.new_snapshot(self.pos, buffers))
    }

    /// Ask for a snapshot of the state before position `pos` ([`Session::snapshot`] there),
    /// taken by the step that reaches it: inside the step (a step of several tokens splits its
    /// GDN dispatches at that row, with no step of its own) or at its end. At the current
    /// position it is taken now; a position asked for already is asked once. Snapshots count
    /// once their step is committed ([`Session::take_snapshots`] hands them out): a move back
    /// (reset, restore) drops those not reached, and one whose step is discarded (a greedy
    /// run-ahead step after the callback changed the session) or whose position the session
    /// passes without a step of its own (a batch's decode) is not taken. `reuse` gives back an
    /// older snapshot's buffers.
    pub fn snapshot_at(&mut self, pos: usize, reuse: Option<StateSnapshot>) -> Result<(), RunError> {
        if pos < self.pos || pos > self.opts.max_context {
            return Err(RunError::BadParam {
                name: "snapshot position",
                value: format!("{pos} (the session is at {})", self.pos),
                expected: "a position from the session's to its context's end",
            });
        }
        if self.taps.pending.iter().any(|(p, _)| *p == pos) {
            return Ok(());
        }
        if pos == self.pos {
            let snap = self.snapshot(reuse)?;
            self.taps.taken.push(snap);
        } else {
            let at = self.taps.pending.partition_point(|(p, _)| *p < pos);
            self.taps.pending.insert(at, (pos, reuse));
        }
        Ok(())
    }

    /// The snapshots [`Session::snapshot_at`] asked for that committed steps took, in position
    /// order; the requests not reached yet are dropped.
    pub fn take_snapshots(&mut self) -> Vec<StateSnapshot> {
        self.taps.pending.clear();
        self.taps.fired = None;
        std::mem::take(&mut self.taps.taken)
    }

    /// The snapshots a step of `t` tokens takes, with their buffers. One asked for at the step's
    /// own position (the session moved there since) is taken now.
    pub(crate) fn step_taps(&mut self, t: usize) -> Result<StepTaps, RunError> {
        self.taps.fired = None;
        // Positions the session passed without a step (a batch's decode) are behind it.
        self.taps.pending.retain(|(pos, _)| *pos >= self.pos);
        let mut snaps = Vec::new();
        while let Some(&(pos, _)) = self.taps.pending.first() {
            if pos > self.pos + t {
                break;
            }
            let (pos, reuse) = self.taps.pending.remove(0);
            if pos == self.pos {
                let snap = self.snapshot(reuse)?;
                self.taps.taken.push(snap);
            } else {
                let buffers = self.snapshot_buffers(reuse)?;
                snaps.push(self.new_snapshot(pos, buffers));
            }
        }
        Ok(StepTaps { snaps, pos: self.pos, t })
    }

    /// The step that took `taps` was submitted: they count once it is committed.
    /// Its split dispatches' bind groups, which hold the snapshots' buffers, leave the cache.
    pub(crate) fn step_taken(&mut self, taps: StepTaps) {
        let splits = taps.split_buffers();
        if !splits.is_empty() {
            self.io.forget_buffers(&splits);
        }
        if !taps.snaps.is_empty() {
            self.taps.fired = Some((taps.pos, self.epoch, taps.snaps));
        }
    }

    /// A step the session did not record itself (a batch's) is about to run at its position: the
    /// snapshots an earlier step of its own took there (a discarded run-ahead) are not that
    /// step's, and its commit must not keep them.
    pub(crate) fn forget_fired_taps(&mut self) {
        self.taps.fired = None;
    }

    /// A step at the session's position (before the commit moves it) was committed: so are its
    /// snapshots, if it is the step that took them.
    pub(super) fn commit_taps(&mut self) {
        if let Some((pos, epoch, mut snaps)) = self.taps.fired.take() {
            if (pos, epoch) == (self.pos, self.epoch) {
                self.taps.taken.append(&mut snaps);
            }
        }
    }

    /// The position went back: positions asked for are no longer ahead of this sequence.
    pub(super) fn drop_pending_taps(&mut self) {
        self.taps.pending.clear();
        self.taps.fired = None;
    }

    /// Whether [`Session::restore`] takes `snap`: it was taken from this session, at or before its
    /// position, under the adapters bound now (no set bound since), and the session has not been
    /// below that position since (a reset, or a restore of an earlier snapshot, followed by other
    /// tokens, rewrote the KV cache it relies on).
    pub fn restorable(&self, snap: &StateSnapshot) -> bool {
        snap.session == self.uid
            && snap.adapters == self.adapters_version
            && snap.pos <= self.pos
            && snap.buffers.len() == self.gdn_states().count()
            && self.holds_since(snap.rewinds, snap.pos)
    }

    /// Go back to `snap`: the next step runs at its position with its GDN states. Refused
    /// (nothing changes) unless [`Session::restorable`].
    pub fn restore(&mut self, snap: &StateSnapshot) -> Result<(), RunError> {
        if !self.restorable(snap) {
            return Err(RunError::BadParam {
                name: "snapshot",
                value: format!("position {} of session {} (this is session {})", snap.pos, snap.session, self.uid),
                expected: "a snapshot of this session at or before its position, under its adapters, not below which it has been since",
            });
        }
        let ctx = self.ctx();
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("restore") });
        for (src, dst) in snap.buffers.iter().zip(self.gdn_states()) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, dst.size().min(src.size()));
        }
        ctx.submit(enc.finish(), 0);
        self.pos = snap.pos;
        self.epoch += 1;
        self.moved_back();
        Ok(())
    }

    /// Whether the KV cache still holds the tokens of a snapshot taken at `pos` after `rewinds`
    /// moves back: no later move went below `pos`.
    fn holds_since(&self, rewinds: u64, pos: usize) -> bool {
        self.lows.iter().find(|&&(count, _)| count > rewinds).is_none_or(|&(_, low)| low >= pos)
    }
}
