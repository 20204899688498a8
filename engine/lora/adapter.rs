//! An adapter resident on the GPU. Uploaded once at load; sessions switch adapters by binding
//! other bind groups, never by uploading.
//!
//! Per (layer, input group) the A matrices of the projections that read the same input are
//! concatenated into one `[Σr, in]` f32 matrix, so one shrink dispatch computes `t = x·Aᵀ` for
//! all of them; their B matrices (`[out, r]` f32 each) lie in one buffer with one group-2 bind
//! group, so the fused expand of a concatenated weight (q|k|v, the GDN input projections,
//! gate|up) covers every projection in one dispatch.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use crate::error::AdapterError;
use crate::gpu::{GpuContext, GpuWeight};
use crate::lora::peft::{parse, ConfigSource, ParsedAdapter};
use crate::lora::{InputGroup, Proj};
use crate::model::{Dtype, Model};

/// One projection's slot.
pub struct LoraMember {
    /// The projection.
    pub proj: Proj,
    /// First column of its rank in the group's t.
    pub t_offset: usize,
    /// Rank r.
    pub rank: usize,
    /// alpha / r (or alpha / √r), before the user's scale.
    pub scaling: f32,
    /// Output features (rows of B).
    pub out: usize,
    /// Element of the group's B buffer where this B `[out, r]` starts (a multiple of r, so B is
    /// also rows `b_offset / r ..` of a `[_, r]` matrix).
    pub b_offset: usize,
}

/// The projections of one layer that share an input.
pub struct LoraGroup {
    /// Concatenated A `[Σr, in]` f32, the weight of the shrink dispatch.
    pub a: GpuWeight,
    /// Σr: the row stride of t.
    pub rank_total: usize,
    /// The projections, in [`Proj::ALL`] order.
    pub members: Vec<LoraMember>,
    /// Every member's B, f32.
    pub b: wgpu::Buffer,
    /// Group-2 bind group over `b`.
    pub b_bind: wgpu::BindGroup,
}

impl LoraGroup {
    /// The slot of `proj`, if adapted.
    pub fn member(&self, proj: Proj) -> Option<&LoraMember> {
        self.members.iter().find(|m| m.proj == proj)
    }
}

/// What an adapter is and covers.
#[derive(Clone, Debug)]
pub struct AdapterInfo {
    /// Name (directory name or file stem).
    pub name: String,
    /// The path loaded.
    pub path: PathBuf,
    /// Distinct ranks, ascending.
    pub ranks: Vec<usize>,
    /// Where rank and alpha came from.
    pub config_source: ConfigSource,
    /// The (layer, projection) pairs adapted.
    pub modules: Vec<(usize, Proj)>,
    /// Keys skipped as irrelevant to text generation (vision tower): the first few by name.
    pub ignored: Vec<String>,
    /// How many keys were skipped in all.
    pub ignored_count: usize,
    /// Bytes held on the GPU.
    pub gpu_bytes: u64,
}

/// An adapter uploaded for one model.
pub struct LoraAdapter {
    /// What it is.
    pub info: AdapterInfo,
    /// The model it was uploaded for. A `Weak` keeps the `Arc`'s allocation (not the model's
    /// GPU buffers) alive, so no later model can reuse the address while this adapter exists:
    /// comparing addresses alone let an adapter of a dropped model pass for a new model's.
    model: Weak<Model>,
    layers: Vec<[Option<LoraGroup>; 4]>,
}

impl LoraAdapter {
    /// Parse, validate and upload the adapter at `path` for `model`. Nothing is changed on
    /// failure.
    pub fn load(model: &Arc<Model>, path: &Path) -> Result<Self, AdapterError> {
        let parsed = parse(path, &model.config)?;
        Self::upload(model, &parsed)
    }

    /// Upload an already parsed adapter.
    pub fn upload(model: &Arc<Model>, parsed: &ParsedAdapter) -> Result<Self, AdapterError> {
        let ctx: &GpuContext = &model.ctx;
        let mut layers: Vec<[Option<LoraGroup>; 4]> =
            (0..model.config.num_layers()).map(|_| Default::default()).collect();
        let mut bytes = 0u64;
        for (layer, slots) in layers.iter_mut().enumerate() {
            for group in [InputGroup::MixerIn, InputGroup::MixerOut, InputGroup::MlpIn, InputGroup::MlpOut] {
                let deltas: Vec<_> =
                    parsed.deltas.iter().filter(|d| d.layer == layer && d.proj.group() == group).collect();
                if deltas.is_empty() {
                    continue;
                }
                let fan_in = deltas[0].proj.dims(&model.config).0;
                let rank_total = deltas.iter().try_fold(0usize, |acc, d| acc.checked_add(d.rank));
                let rank_total =
                    rank_total.filter(|&r| r.checked_mul(fan_in).is_some()).ok_or_else(|| AdapterError::BadConfig {
                        field: format!("layers.{layer} {group:?}"),
                        expected: "ranks whose sum fits in memory".into(),
                        found: format!("{} modules", deltas.len()),
                    })?;
                let a_cat: Vec<f32> = deltas.iter().flat_map(|d| d.a.iter().copied()).collect();
                let label = format!("lora {} layers.{layer} {group:?} A", parsed.name);
                let a = GpuWeight::upload(
                    ctx,
                    &label,
                    Dtype::F32,
                    rank_total,
                    fan_in,
                    bytemuck::cast_slice(&a_cat),
                    u64::MAX,
                )?;
                bytes += a.bytes();
                let mut members = Vec::with_capacity(deltas.len());
                let mut b_cat: Vec<f32> = Vec::new();
                let mut t_offset = 0;
                for d in deltas {
                    let b_offset = b_cat.len().div_ceil(d.rank) * d.rank;
                    b_cat.resize(b_offset, 0.0);
                    b_cat.extend_from_slice(&d.b);
                    let out = d.b.len() / d.rank;
                    members.push(LoraMember {
                        proj: d.proj,
                        t_offset,
                        rank: d.rank,
                        scaling: d.scaling,
                        out,
                        b_offset,
                    });
                    t_offset += d.rank;
                }
                let label = format!("lora {} layers.{layer} {group:?} B", parsed.name);
                let b = ctx.upload(&label, bytemuck::cast_slice(&b_cat))?;
                bytes += b.size();
                let b_bind = ctx.weights_bind_group(&b, &label);
                slots[group as usize] = Some(LoraGroup { a, rank_total, members, b, b_bind });
            }
        }
        let mut ranks: Vec<usize> = parsed.deltas.iter().map(|d| d.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let info = AdapterInfo {
            name: parsed.name.clone(),
            path: parsed.path.clone(),
            ranks,
            config_source: parsed.config.source,
            modules: parsed.deltas.iter().map(|d| (d.layer, d.proj)).collect(),
            ignored: parsed.ignored.clone(),
            ignored_count: parsed.ignored_count,
            gpu_bytes: bytes,
        };
        Ok(Self { info, model: Arc::downgrade(model), layers })
    }

    /// Whether this adapter was uploaded for `model` (the same `Arc`, not an equal model).
    pub fn is_for(&self, model: &Arc<Model>) -> bool {
        std::ptr::eq(self.model.as_ptr(), Arc::as_ptr(model))
    }

    /// The adapted projections of `layer` that read `group`'s input.
    pub fn group(&self, layer: usize, group: InputGroup) -> Option<&LoraGroup> {
        self.layers.get(layer).and_then(|g| g[group as usize].as_ref())
    }

    /// The largest Σr of any group (sizes a session's t scratch).
    pub fn max_group_rank(&self) -> usize {
        self.layers.iter().flatten().flatten().map(|g| g.rank_total).max().unwrap_or(0)
    }
}
