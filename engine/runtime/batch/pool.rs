//! `GdnPool` and `KvPool`: the GDN states and the KV caches of a batched generation's
//! sessions side by side.

use crate::error::GpuError;
use crate::gpu::GpuContext;
use crate::model::{LayerType, TextConfig};
use crate::runtime::cache::{gdn_state_bytes, LayerState};
use crate::runtime::session::Session;

/// The GDN states of a batched generation's sessions side by side (slot = the session's index
/// in the call), so one `gdn_decode` dispatch steps a layer of every row (a workgroup per value
/// head and row) instead of one dispatch per session: a batched step's per-session mixer
/// dispatches are the part that does not shrink with batching (on a GPU each is Hv workgroups,
/// 16 at the 0.8B dims, far too few to fill the device). `Batch::generate` copies each session's
/// conv and recurrent states into its slot before the first step and back after the last; the
/// steps ping-pong between the two parities, a row's state after j committed steps in parity
/// j % 2 (the rows of a step all committed as many: a row leaves the batch for good). A step
/// that is not committed (run-ahead past a row's end) wrote the other parity, as a session's own
/// step does. Holds 2 · slots states: 38 MiB per slot at the 0.8B dims.
pub(super) struct GdnPool {
    pub(super) slots: usize,
    /// Each slot's session position when its states were copied in.
    pub(super) start: Vec<usize>,
    /// Per layer: conv histories and recurrent states, two parities each; `None` for attention.
    pub(super) layers: Vec<Option<GdnPair>>,
}

/// (conv histories, recurrent states) of a pooled GDN layer, two parities each.
type GdnPair = ([wgpu::Buffer; 2], [wgpu::Buffer; 2]);

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

/// The KV caches of a batched generation's sessions side by side (slot = the session's index in
/// the call), so one `attend_rows` dispatch (and its merge) attends a layer of every row (a
/// workgroup per query head, split and row) instead of two dispatches per session.
/// `Batch::generate` copies each session's cached positions into its slot before the first
/// step and the positions its steps wrote back after the last (a step that is not committed
/// wrote a position past the session's end, which nothing copies back). Per attention layer
/// `[slots · Hkv, positions, hd]` keys and values: 2 · Hkv · hd · 4 bytes per position, slot and
/// layer (24 KiB per position and slot over the 6 attention layers at the 0.8B dims).
pub(super) struct KvPool {
    pub(super) slots: usize,
    /// Positions per slot and KV head (the caches' `s_max`).
    pub(super) positions: usize,
    /// Each slot's session position when its caches were copied in.
    start: Vec<usize>,
    /// Per layer: keys and values; `None` for GDN layers.
    layers: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
}

impl KvPool {
    pub(super) fn new(ctx: &GpuContext, c: &TextConfig, slots: usize, positions: usize) -> Result<Self, GpuError> {
        let bytes = (slots * c.num_kv_heads) as u64 * positions as u64 * c.head_dim as u64 * 4;
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, ty)| {
                if !matches!(ty, LayerType::Full) {
                    return Ok(None);
                }
                let buf = |what: &str| ctx.storage_buffer(&format!("batch pool layers.{i}.{what}"), bytes, true);
                Ok(Some((buf("k_cache")?, buf("v_cache")?)))
            })
            .collect::<Result<_, GpuError>>()?;
        Ok(Self { slots, positions, start: Vec::new(), layers })
    }

    /// Layer `layer`'s pooled keys and values (`None` for a GDN layer).
    pub(super) fn layer(&self, layer: usize) -> Option<&(wgpu::Buffer, wgpu::Buffer)> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    /// Copy session `i`'s cached positions into slot `i` (`into`, noting its position), or the
    /// positions from there to its position now back into the session, a copy per layer, KV
    /// head and keys or values.
    pub(super) fn copy(&mut self, ctx: &GpuContext, c: &TextConfig, sessions: &[&mut Session], into: bool) {
        if into {
            self.start = sessions.iter().map(|s| s.pos).collect();
        }
        let row = c.head_dim as u64 * 4;
        let mut enc =
            ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch kv pool") });
        for (layer, pooled) in self.layers.iter().enumerate() {
            let Some((pk, pv)) = pooled else { continue };
            for (i, s) in sessions.iter().enumerate() {
                let LayerState::Attention { k, v } = &s.states[layer] else { continue };
                let (from, to) = if into { (0, s.pos) } else { (self.start[i], s.pos) };
                if to <= from {
                    continue;
                }
                for h in 0..c.num_kv_heads {
                    let own = (h * s.opts.max_context + from) as u64 * row;
                    let slot = ((i * c.num_kv_heads + h) * self.positions + from) as u64 * row;
                    let bytes = (to - from) as u64 * row;
                    for (own_buf, pool) in [(k, pk), (v, pv)] {
                        if into {
                            enc.copy_buffer_to_buffer(own_buf, own, pool, slot, bytes);
                        } else {
                            enc.copy_buffer_to_buffer(pool, slot, own_buf, own, bytes);
                        }
                    }
                }
            }
        }
        ctx.submit(enc.finish(), 0);
    }
}

impl GdnPool {
    pub(super) fn new(ctx: &GpuContext, c: &TextConfig, slots: usize) -> Result<Self, GpuError> {
        let (conv, state) = gdn_state_bytes(c);
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, ty)| {
                if !matches!(ty, LayerType::Linear) {
                    return Ok(None);
                }
                let buf = |what: &str, p: usize, bytes: u64| {
                    ctx.storage_buffer(&format!("batch pool layers.{i}.{what}[{p}]"), bytes * slots as u64, true)
                };
                let convs = [buf("conv_state", 0, conv)?, buf("conv_state", 1, conv)?];
                let states = [buf("recurrent_state", 0, state)?, buf("recurrent_state", 1, state)?];
                Ok(Some((convs, states)))
            })
            .collect::<Result<_, GpuError>>()?;
        Ok(Self { slots, start: Vec::new(), layers })
    }

    /// Copy session `i`'s states into slot `i` of parity 0 (`into`, noting its position) or
    /// slot `i`'s states at the parity of its committed steps since then back into the session.
    pub(super) fn copy(&mut self, ctx: &GpuContext, c: &TextConfig, sessions: &[&mut Session], into: bool) {
        if into {
            self.start = sessions.iter().map(|s| s.pos).collect();
        }
        let start = &self.start;
        let (conv_bytes, state_bytes) = gdn_state_bytes(c);
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch pool") });
        for (layer, pooled) in self.layers.iter().enumerate() {
            let Some((pc, ps)) = pooled else { continue };
            for (i, s) in sessions.iter().enumerate() {
                let LayerState::Gdn { conv, state } = &s.states[layer] else { continue };
                let at = (s.pos - start[i]) % 2;
                for (own, pool, bytes) in [(&conv[s.parity], pc, conv_bytes), (&state[s.parity], ps, state_bytes)] {
                    let slot = i as u64 * bytes;
                    if into {
                        enc.copy_buffer_to_buffer(own, 0, &pool[0], slot, bytes);
                    } else {
                        enc.copy_buffer_to_buffer(&pool[at], slot, own, 0, bytes);
                    }
                }
            }
        }
        ctx.submit(enc.finish(), 0);
    }
}
