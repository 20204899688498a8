//! A session's active adapter set and what its steps bind for it (see [`crate::lora::set`]).

use std::sync::Arc;

use crate::error::AdapterError;
use crate::kernels::matmul::ScaleTableAt;
use crate::lora::{InputGroup, LayerScales, LoraAdapter, Proj, MAX_SCALE, MAX_SET};
use crate::model::Model;

/// One adapter of a session's active set.
#[derive(Clone)]
pub struct ActiveAdapter {
    /// The resident adapter.
    pub adapter: Arc<LoraAdapter>,
    /// Multiplies alpha / r (0: off).
    pub scale: f32,
    /// Per-layer / per-projection factors on top of the scale.
    pub layers: LayerScales,
}

impl ActiveAdapter {
    /// `adapter` at `scale` on every layer.
    pub fn new(adapter: Arc<LoraAdapter>, scale: f32) -> Self {
        Self { adapter, scale, layers: LayerScales::default() }
    }

    /// With per-layer / per-projection factors.
    pub fn with_layers(self, layers: LayerScales) -> Self {
        Self { layers, ..self }
    }
}

/// What a step binds for the active set.
pub(crate) struct BoundSet {
    /// The adapter (one active) or the stack (several) the shrinks and expands read.
    pub(crate) lora: Arc<LoraAdapter>,
    /// Per layer, per projection ([`Proj::index`]): the expand's segment scale.
    pub(crate) seg_scale: Vec<[f32; 12]>,
    /// Per layer, per input group: where the group's scale table is in the t buffer (a stack's
    /// per-rank-column factors; one row per row of t in a batched step).
    pub(crate) tables: Vec<[Option<ScaleTableAt>; 4]>,
}

/// A session's adapter state.
#[derive(Default)]
pub(crate) struct LoraState {
    /// The set as given.
    pub(crate) active: Vec<ActiveAdapter>,
    /// What the steps bind (`None`: the base model, also when every scale is 0).
    pub(crate) bound: Option<BoundSet>,
    /// The shrink output t (`[max_batch, widest group's Σr]` from element 0), then the scale
    /// tables; with its size in bytes.
    pub(crate) t: Option<(wgpu::Buffer, u64)>,
    /// The last stack built, with its sources (reused while the members stay the same).
    stack: Option<(Vec<Arc<LoraAdapter>>, Arc<LoraAdapter>)>,
}

impl LoraState {
    /// Forget the cached stack (its sources' weights changed: a learning step).
    pub(crate) fn forget_stack(&mut self) {
        self.stack = None;
    }

    /// The GPU buffers this state owns (the cached stack's and the t scratch; the adapters of a
    /// set are their owner's), as handles to compare after a change.
    pub(crate) fn own_buffers(&self) -> Vec<wgpu::Buffer> {
        let stack = self.stack.iter().flat_map(|(_, st)| st.buffers());
        stack.chain(self.t.iter().map(|(t, _)| t)).cloned().collect()
    }

    /// Whether the cached stack (bound or not) holds `adapter`.
    pub(crate) fn stack_holds(&self, adapter: &Arc<LoraAdapter>) -> bool {
        self.stack.as_ref().is_some_and(|(sources, _)| sources.iter().any(|s| Arc::ptr_eq(s, adapter)))
    }

    /// Make `set` the active set for steps of at most `max_batch` tokens. Nothing changes on
    /// error.
    pub(crate) fn bind(
        &mut self,
        model: &Arc<Model>,
        max_batch: usize,
        set: Vec<ActiveAdapter>,
    ) -> Result<(), AdapterError> {
        let layers = model.config.num_layers();
        if set.len() > MAX_SET {
            return Err(AdapterError::SetTooLarge { found: set.len(), limit: MAX_SET });
        }
        for (i, a) in set.iter().enumerate() {
            if !(a.scale.is_finite() && a.scale.abs() <= MAX_SCALE) {
                return Err(AdapterError::BadScale(a.scale));
            }
            if !a.adapter.is_for(model) {
                return Err(AdapterError::WrongModel { name: a.adapter.info.name.clone() });
            }
            if a.adapter.sources() > 1 {
                return Err(AdapterError::BadId {
                    id: a.adapter.info.name.clone(),
                    why: "a stack is not a member of a set: give its adapters instead".into(),
                });
            }
            if set[..i].iter().any(|b| Arc::ptr_eq(&a.adapter, &b.adapter)) {
                return Err(AdapterError::DuplicateInSet { id: a.adapter.info.name.clone() });
            }
            a.layers.check(&a.adapter.info.name, layers)?;
        }
        let live: Vec<&ActiveAdapter> = set.iter().filter(|a| a.scale != 0.0).collect();
        let (bound, stack, table) = match live.as_slice() {
            [] => (None, None, Vec::new()),
            [one] => {
                let seg_scale = (0..layers)
                    .map(|l| {
                        Proj::ALL.map(|p| {
                            let scaling =
                                one.adapter.group(l, p.group()).and_then(|g| g.member(p)).map_or(0.0, |m| m.scaling);
                            one.scale * one.layers.factor(l, p) * scaling
                        })
                    })
                    .collect();
                let tables = vec![[None; 4]; layers];
                (Some(BoundSet { lora: one.adapter.clone(), seg_scale, tables }), None, Vec::new())
            }
            many => {
                let sources: Vec<Arc<LoraAdapter>> = many.iter().map(|a| a.adapter.clone()).collect();
                let cached = self.stack.as_ref().filter(|(s, _)| {
                    s.len() == sources.len() && s.iter().zip(&sources).all(|(a, b)| Arc::ptr_eq(a, b))
                });
                let stack = match cached {
                    Some((_, st)) => st.clone(),
                    None => Arc::new(LoraAdapter::stack(model, &sources)?),
                };
                let base = table_base(max_batch, &stack);
                let rows: [&[&ActiveAdapter]; 1] = [many];
                let (table, tables) = stack_tables(&stack, &sources, &rows, base, layers);
                let seg_scale = vec![[1.0; 12]; layers];
                let bound = BoundSet { lora: stack.clone(), seg_scale, tables };
                (Some(bound), Some((sources, stack)), table)
            }
        };
        if let Some(b) = &bound {
            let base = table_base(max_batch, &b.lora);
            let bytes = ((base + table.len()) * 4) as u64;
            if self.t.as_ref().is_none_or(|(_, size)| *size < bytes) {
                let buffer = model.ctx.storage_buffer("lora t", bytes, true)?;
                self.t = Some((buffer, bytes));
            }
            if let (Some((t, _)), false) = (&self.t, table.is_empty()) {
                model.ctx.write(t, (base * 4) as u64, bytemuck::cast_slice(&table));
            }
        }
        if stack.is_some() {
            self.stack = stack;
        }
        self.active = set;
        self.bound = bound;
        Ok(())
    }
}

/// The scale tables of `stack` (built from `sources`, in order) for steps whose row `r` applies
/// the set `rows[r]`: per (layer, input group) with an adapter, one factor per rank column and
/// row, `scale · factor(layer, proj) · alpha / r` of the row's entry for the column's source (0
/// where the row's set does not hold it), rows `Σr` rounded up to 4 apart. Returns the factors
/// (to be written at element `base` of the t buffer) and where each group's table is (row
/// stride 0 for one row: every row of t reads it).
pub(crate) fn stack_tables(
    stack: &LoraAdapter,
    sources: &[Arc<LoraAdapter>],
    rows: &[&[&ActiveAdapter]],
    base: usize,
    layers: usize,
) -> (Vec<f32>, Vec<[Option<ScaleTableAt>; 4]>) {
    let mut table: Vec<f32> = Vec::new();
    let mut tables = vec![[None; 4]; layers];
    for (l, slots) in tables.iter_mut().enumerate() {
        for group in [InputGroup::MixerIn, InputGroup::MixerOut, InputGroup::MlpIn, InputGroup::MlpOut] {
            let Some(g) = stack.group(l, group) else { continue };
            let stride = g.rank_total.next_multiple_of(4);
            slots[group as usize] =
                Some(ScaleTableAt { offset: base + table.len(), stride: if rows.len() > 1 { stride } else { 0 } });
            for set in rows {
                let row0 = table.len();
                for m in &g.members {
                    for part in &m.parts {
                        let entry = set.iter().find(|a| Arc::ptr_eq(&a.adapter, &sources[part.source]));
                        let f = entry.map_or(0.0, |a| a.scale * a.layers.factor(l, m.proj) * part.scaling);
                        table.extend(std::iter::repeat_n(f, part.rank));
                    }
                }
                table.resize(row0 + stride, 0.0);
            }
        }
    }
    (table, tables)
}

/// Where the scale tables start in the t buffer: after `[max_batch, Σr]` of t (16-byte aligned).
pub(crate) fn table_base(max_batch: usize, lora: &LoraAdapter) -> usize {
    (max_batch * lora.max_group_rank()).next_multiple_of(4)
}
