//! `GdnPool` and `KvPool`: the GDN states and the KV caches of a batched generation's
//! sessions side by side.

use crate::error::GpuError;
use crate::gpu::GpuContext;
use crate::model::{LayerType, TextConfig};
use crate::runtime::cache::{gdn_state_bytes, kv_cache_bytes, LayerState};
use crate::runtime::session::Session;

/// Which of the batch's pools hold a generation's rows (`Batch::pool_in`).
#[derive(Clone, Copy, Default)]
pub(super) struct Pooled {
    pub(super) gdn: bool,
    pub(super) kv: bool,
}

impl Pooled {
    /// A step's rows `rows` (their sessions' indices, their slots) with the pools that hold
    /// them; `None` where neither does.
    pub(super) fn rows(self, rows: &[usize]) -> Option<(&[usize], Pooled)> {
        (self.gdn || self.kv).then_some((rows, self))
    }
}

/// A step's rows in the pools: row r is slot `slots[r]`, its GDN states in `gdn` at the parity
/// given, its KV caches in `kv`, where those pools hold the generation's rows.
#[derive(Clone, Copy)]
pub(super) struct PoolRows<'a> {
    pub(super) gdn: Option<(&'a GdnPool, usize)>,
    pub(super) kv: Option<&'a KvPool>,
    pub(super) slots: &'a [usize],
}

/// Pooled states of one layer type for a batched generation's sessions side by side (slot =
/// the session's index in the call), per layer of that type.
pub(super) struct Pool<L> {
    pub(super) slots: usize,
    /// Each slot's session position when its states were copied in.
    pub(super) start: Vec<usize>,
    /// Per layer: its pooled buffers; `None` for layers of the other type.
    layers: Vec<Option<L>>,
}

impl<L> Pool<L> {
    /// A pool of `slots` with `make(layer)`'s buffers for each layer of type `ty`.
    fn build(
        c: &TextConfig,
        slots: usize,
        ty: LayerType,
        make: impl Fn(usize) -> Result<L, GpuError>,
    ) -> Result<Self, GpuError> {
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, &t)| if t == ty { make(i).map(Some) } else { Ok(None) })
            .collect::<Result<_, GpuError>>()?;
        Ok(Self { slots, start: Vec::new(), layers })
    }

    /// Layer `layer`'s pooled buffers (`None` for a layer of the other type).
    pub(super) fn layer(&self, layer: usize) -> Option<&L> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    /// Copies between the sessions and their slots, in one submit: `each(encoder, pooled
    /// layer, slot, the slot's start, session, its layer state)` for every pooled layer and
    /// session, the sessions' positions noted as the slots' starts first when `into`.
    fn copy_each(
        &mut self,
        ctx: &GpuContext,
        sessions: &[&mut Session],
        into: bool,
        each: impl Fn(&mut wgpu::CommandEncoder, &L, usize, usize, &Session, &LayerState),
    ) {
        if into {
            self.start = sessions.iter().map(|s| s.pos).collect();
        }
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch pool") });
        for (layer, pooled) in self.layers.iter().enumerate() {
            let Some(pooled) = pooled else { continue };
            for (i, s) in sessions.iter().enumerate() {
                each(&mut enc, pooled, i, self.start[i], s, &s.states[layer]);
            }
        }
        ctx.submit(enc.finish(), 0);
    }
}

/// (conv histories, recurrent states) of a pooled GDN layer, two parities each.
type GdnPair = ([wgpu::Buffer; 2], [wgpu::Buffer; 2]);

/// The GDN states of a batched generation's sessions side by side, so one `gdn_decode` dispatch
/// steps a layer of every row (a workgroup per value head and row) instead of one dispatch per
/// session: a batched step's per-session mixer dispatches are the part that does not shrink
/// with batching (on a GPU each is Hv workgroups, 16 at the 0.8B dims, far too few to fill the
/// device). `Batch::generate` copies each session's conv and recurrent states into its slot
/// before the first step and back after the last; the steps ping-pong between the two
/// parities, a row's state after j committed steps in parity j % 2 (the rows of a step all
/// committed as many: a row leaves the batch for good). A step that is not committed (run-ahead
/// past a row's end) wrote the other parity, as a session's own step does. Holds 2 · slots
/// states: 38 MiB per slot at the 0.8B dims.
pub(super) type GdnPool = Pool<GdnPair>;

impl GdnPool {
    pub(super) fn new(ctx: &GpuContext, c: &TextConfig, slots: usize) -> Result<Self, GpuError> {
        let (conv, state) = gdn_state_bytes(c);
        Pool::build(c, slots, LayerType::Linear, |i| {
            let buf = |what: &str, p: usize, bytes: u64| {
                ctx.storage_buffer(&format!("batch pool layers.{i}.{what}[{p}]"), bytes * slots as u64, true)
            };
            let convs = [buf("conv_state", 0, conv)?, buf("conv_state", 1, conv)?];
            let states = [buf("recurrent_state", 0, state)?, buf("recurrent_state", 1, state)?];
            Ok((convs, states))
        })
    }

    /// Copy session `i`'s states into slot `i` of parity 0 (`into`, noting its position) or
    /// slot `i`'s states at the parity of its committed steps since then back into the session.
    pub(super) fn copy(&mut self, ctx: &GpuContext, c: &TextConfig, sessions: &[&mut Session], into: bool) {
        let (conv_bytes, state_bytes) = gdn_state_bytes(c);
        self.copy_each(ctx, sessions, into, |enc, (pc, ps), i, start, s, layer| {
            let LayerState::Gdn { conv, state } = layer else { return };
            let at = (s.pos - start) % 2;
            for (own, pool, bytes) in [(&conv[s.parity], pc, conv_bytes), (&state[s.parity], ps, state_bytes)] {
                let slot = i as u64 * bytes;
                if into {
                    enc.copy_buffer_to_buffer(own, 0, &pool[0], slot, bytes);
                } else {
                    enc.copy_buffer_to_buffer(&pool[at], slot, own, 0, bytes);
                }
            }
        });
    }
}

/// The KV caches of a batched generation's sessions side by side, so one `attend_rows`
/// dispatch and its merge attend a layer of up to 32 rows (a workgroup per query head, split and
/// row) instead of two dispatches per session. `Batch::generate` copies each session's cached
/// positions into its slot before the first step and the positions its steps wrote back after
/// the last (a step that is not committed wrote a position past the session's end, which
/// nothing copies back). Per attention layer `[slots · Hkv, positions, hd]` keys and values:
/// 2 · Hkv · hd · 4 bytes per position, slot and layer (24 KiB per position and slot over the 6
/// attention layers at the 0.8B dims).
pub(super) struct KvPool {
    /// Positions per slot and KV head (the pooled caches' `s_max`).
    pub(super) positions: usize,
    /// Per attention layer: keys and values.
    pub(super) pool: Pool<(wgpu::Buffer, wgpu::Buffer)>,
}

impl KvPool {
    pub(super) fn new(ctx: &GpuContext, c: &TextConfig, slots: usize, positions: usize) -> Result<Self, GpuError> {
        let bytes = slots as u64 * kv_cache_bytes(c, positions);
        let pool = Pool::build(c, slots, LayerType::Full, |i| {
            let buf = |what: &str| ctx.storage_buffer(&format!("batch pool layers.{i}.{what}"), bytes, true);
            Ok((buf("k_cache")?, buf("v_cache")?))
        })?;
        Ok(Self { positions, pool })
    }

    /// Copy session `i`'s cached positions into slot `i` (`into`, noting its position), or the
    /// positions from there to its position now back into the session: a copy per layer, KV
    /// head and keys or values.
    pub(super) fn copy(&mut self, ctx: &GpuContext, c: &TextConfig, sessions: &[&mut Session], into: bool) {
        let (row, positions) = (c.head_dim as u64 * 4, self.positions);
        self.pool.copy_each(ctx, sessions, into, |enc, (pk, pv), i, start, s, layer| {
            let LayerState::Attention { k, v } = layer else { return };
            let from = if into { 0 } else { start };
            if s.pos <= from {
                return;
            }
            let bytes = (s.pos - from) as u64 * row;
            for h in 0..c.num_kv_heads {
                let own = (h * s.opts.max_context + from) as u64 * row;
                let slot = ((i * c.num_kv_heads + h) * positions + from) as u64 * row;
                for (own_buf, pool) in [(k, pk), (v, pv)] {
                    if into {
                        enc.copy_buffer_to_buffer(own_buf, own, pool, slot, bytes);
                    } else {
                        enc.copy_buffer_to_buffer(pool, slot, own_buf, own, bytes);
                    }
                }
            }
        });
    }
}
