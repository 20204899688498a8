//! An adapter resident on the GPU. Uploaded once at load; sessions switch adapters by binding
//! other bind groups, never by uploading.
//!
//! Per (layer, input group) the A matrices of the projections that read the same input are
//! concatenated into one `[Σr, in]` f32 matrix, so one shrink dispatch computes `t = x·Aᵀ` for
//! all of them; their B matrices (`[out, r]` f32 each) lie in one buffer with one group-2 bind
//! group, so the fused expand of a concatenated weight (q|k|v, the GDN input projections,
//! gate|up) covers every projection in one dispatch. A stack of several adapters
//! ([`LoraAdapter::stack`]) has the same form, each projection's rank being its sources' ranks
//! side by side.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use crate::error::AdapterError;
use crate::gpu::{read_f32_many, GpuContext, GpuWeight};
use crate::lora::peft::{parse, ConfigSource, ModuleDelta, ParsedAdapter};
use crate::lora::{InputGroup, Proj, MAX_RANK, MAX_SCALING, MAX_WEIGHT};
use crate::model::{Dtype, Model, TextConfig};

/// Rank columns of a projection that come from one adapter of a stack.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankPart {
    /// Which source adapter (index into the stack's sources; 0 for a plain adapter).
    pub source: usize,
    /// Its rank.
    pub rank: usize,
    /// Its alpha / r (or alpha / √r).
    pub scaling: f32,
}

/// One projection's slot.
pub struct LoraMember {
    /// The projection.
    pub proj: Proj,
    /// First column of its rank in the group's t.
    pub t_offset: usize,
    /// Rank r.
    pub rank: usize,
    /// alpha / r (or alpha / √r), before the user's scale (1 in a stack: see `parts`).
    pub scaling: f32,
    /// Where its rank columns come from, in t order (one part for a plain adapter).
    pub parts: Vec<RankPart>,
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
    /// Adapters stacked into this one (1 for a loaded adapter).
    sources: usize,
}

/// One projection of a group on the host, before upload.
struct HostMember {
    proj: Proj,
    parts: Vec<RankPart>,
    scaling: f32,
    /// `[rank, in]`.
    a: Vec<f32>,
    /// `[out, rank]`.
    b: Vec<f32>,
}

/// One layer of an adapter read back: per input group, its A (`[Σr, in]`) and B buffer.
type HostLayer = [Option<(Vec<f32>, Vec<f32>)>; 4];

/// Upload one (layer, input group): the members' A concatenated, their B in one buffer.
fn upload_group(
    ctx: &GpuContext,
    label: &str,
    fan_in: usize,
    host: Vec<HostMember>,
    bytes: &mut u64,
) -> Result<LoraGroup, AdapterError> {
    let rank_total = host.iter().try_fold(0usize, |acc, m| acc.checked_add(m.a.len() / fan_in.max(1)));
    let rank_total =
        rank_total.filter(|&r| r.checked_mul(fan_in).is_some()).ok_or_else(|| AdapterError::BadConfig {
            field: label.to_string(),
            expected: "ranks whose sum fits in memory".into(),
            found: format!("{} modules", host.len()),
        })?;
    let a_cat: Vec<f32> = host.iter().flat_map(|m| m.a.iter().copied()).collect();
    let a = GpuWeight::upload(
        ctx,
        &format!("{label} A"),
        Dtype::F32,
        rank_total,
        fan_in,
        bytemuck::cast_slice(&a_cat),
        u64::MAX,
    )?;
    *bytes += a.bytes();
    let mut members = Vec::with_capacity(host.len());
    let mut b_cat: Vec<f32> = Vec::new();
    let mut t_offset = 0;
    for m in host {
        let rank = m.a.len() / fan_in.max(1);
        let b_offset = b_cat.len().div_ceil(rank) * rank;
        b_cat.resize(b_offset, 0.0);
        b_cat.extend_from_slice(&m.b);
        let out = m.b.len() / rank;
        members.push(LoraMember { proj: m.proj, t_offset, rank, scaling: m.scaling, parts: m.parts, out, b_offset });
        t_offset += rank;
    }
    let b = ctx.upload(&format!("{label} B"), bytemuck::cast_slice(&b_cat))?;
    *bytes += b.size();
    let b_bind = ctx.weights_bind_group(&b, &format!("{label} B"));
    Ok(LoraGroup { a, rank_total, members, b, b_bind })
}

/// The name a delta's errors give it.
fn delta_key(d: &ModuleDelta) -> String {
    format!("layers.{}.{}", d.layer, d.proj.path())
}

/// Check one delta against the model's config: a layer it has, of the projection's type, a
/// rank in 1..=MAX_RANK, factors of exactly `[rank, in]` and `[out, rank]`, a finite scaling of
/// at most MAX_SCALING and finite weights of at most MAX_WEIGHT (the bounds in `crate::lora`).
fn check_delta(d: &ModuleDelta, c: &TextConfig) -> Result<(), AdapterError> {
    let key = delta_key(d);
    let layers = c.num_layers();
    let Some(&ty) = c.layer_types.get(d.layer) else {
        return Err(AdapterError::LayerOutOfRange { key, layer: d.layer, layers });
    };
    if d.proj.layer_type().is_some_and(|t| t != ty) {
        let (layer, projection) = (d.layer, d.proj.path().into());
        return Err(AdapterError::WrongTarget { key, layer, layer_type: format!("{ty:?}"), projection });
    }
    let (fan_in, fan_out) = d.proj.dims(c);
    let fits = (1..=MAX_RANK).contains(&d.rank)
        && d.rank.checked_mul(fan_in) == Some(d.a.len())
        && fan_out.checked_mul(d.rank) == Some(d.b.len());
    if !fits {
        return Err(AdapterError::BadConfig {
            field: key,
            expected: format!("a rank of 1 to {MAX_RANK}, lora_A [rank, {fan_in}] and lora_B [{fan_out}, rank]"),
            found: format!("rank {}, {} and {} elements", d.rank, d.a.len(), d.b.len()),
        });
    }
    if !(d.scaling.is_finite() && f64::from(d.scaling.abs()) <= MAX_SCALING) {
        return Err(AdapterError::BadConfig {
            field: format!("{key} scaling"),
            expected: format!("a number of magnitude at most {MAX_SCALING}"),
            found: d.scaling.to_string(),
        });
    }
    for (which, values) in [("lora_A", &d.a), ("lora_B", &d.b)] {
        if let Some(index) = values.iter().position(|v| !(v.is_finite() && v.abs() <= MAX_WEIGHT)) {
            let (key, value) = (format!("{key}.{which}"), values[index]);
            return Err(AdapterError::WeightTooLarge { key, index, value, limit: MAX_WEIGHT });
        }
    }
    Ok(())
}

const GROUPS: [InputGroup; 4] = [InputGroup::MixerIn, InputGroup::MixerOut, InputGroup::MlpIn, InputGroup::MlpOut];

impl LoraAdapter {
    /// Parse, validate and upload the adapter at `path` for `model`. Nothing is changed on
    /// failure.
    pub fn load(model: &Arc<Model>, path: &Path) -> Result<Self, AdapterError> {
        let parsed = parse(path, &model.config)?;
        Self::upload(model, &parsed)
    }

    /// Upload an already parsed adapter. Its deltas are checked against `model` first (a
    /// `ParsedAdapter` may have been built by hand or parsed for another config): nothing is
    /// uploaded from one that does not fit.
    pub fn upload(model: &Arc<Model>, parsed: &ParsedAdapter) -> Result<Self, AdapterError> {
        model.check().map_err(|e| AdapterError::ModelConfig(Box::new(e)))?;
        let mut seen = std::collections::BTreeSet::new();
        for d in &parsed.deltas {
            check_delta(d, &model.config)?;
            if !seen.insert((d.layer, d.proj)) {
                let key = delta_key(d);
                return Err(AdapterError::DuplicateModule { other: key.clone(), key });
            }
        }
        let ctx: &GpuContext = &model.ctx;
        let mut layers: Vec<[Option<LoraGroup>; 4]> =
            (0..model.config.num_layers()).map(|_| Default::default()).collect();
        let mut bytes = 0u64;
        for (layer, slots) in layers.iter_mut().enumerate() {
            for group in GROUPS {
                let host: Vec<HostMember> = parsed
                    .deltas
                    .iter()
                    .filter(|d| d.layer == layer && d.proj.group() == group)
                    .map(|d| HostMember {
                        proj: d.proj,
                        parts: vec![RankPart { source: 0, rank: d.rank, scaling: d.scaling }],
                        scaling: d.scaling,
                        a: d.a.clone(),
                        b: d.b.clone(),
                    })
                    .collect();
                if host.is_empty() {
                    continue;
                }
                let fan_in = host[0].proj.dims(&model.config).0;
                let label = format!("lora {} layers.{layer} {group:?}", parsed.name);
                slots[group as usize] = Some(upload_group(ctx, &label, fan_in, host, &mut bytes)?);
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
        Ok(Self { info, model: Arc::downgrade(model), layers, sources: 1 })
    }

    /// Stack `sources` (resident adapters of `model`, at least two, each once) into one adapter:
    /// per (layer, input group) every projection that any source adapts, in [`Proj::ALL`] order,
    /// with the sources' ranks side by side in source order ([`LoraMember::parts`]); A rows and
    /// B columns follow the same order. The sources' weights are read back from the GPU (so a
    /// trainable adapter stacks with its current weights) and uploaded once more. Scales are not
    /// applied: every member's `scaling` is 1 and the session's scale table carries each part's
    /// alpha / r with the user's scale.
    pub(crate) fn stack(model: &Arc<Model>, sources: &[Arc<LoraAdapter>]) -> Result<Self, AdapterError> {
        let ctx: &GpuContext = &model.ctx;
        if let Some(other) = sources.iter().find(|a| !a.is_for(model)) {
            return Err(AdapterError::WrongModel { name: other.info.name.clone() });
        }
        if sources.len() > crate::lora::MAX_SET {
            return Err(AdapterError::SetTooLarge { found: sources.len(), limit: crate::lora::MAX_SET });
        }
        // Every source group's A chunks and B, read back in one submission.
        let mut reads: Vec<(&wgpu::Buffer, usize, usize)> = Vec::new();
        for src in sources {
            for g in src.layers.iter().flatten().flatten() {
                reads.extend(g.a.chunks.iter().map(|c| (&c.buffer, 0, c.rows * g.a.cols)));
                reads.push((&g.b, 0, (g.b.size() / 4) as usize));
            }
        }
        let mut data = read_f32_many(ctx, &reads)?.into_iter();
        let mut host_groups: Vec<Vec<HostLayer>> = Vec::with_capacity(sources.len());
        for src in sources {
            let mut per_layer: Vec<HostLayer> = Vec::with_capacity(src.layers.len());
            for slots in &src.layers {
                let mut out: HostLayer = Default::default();
                for (gi, g) in slots.iter().enumerate() {
                    if let Some(g) = g {
                        let a: Vec<f32> = g.a.chunks.iter().flat_map(|_| data.next().unwrap_or_default()).collect();
                        let b = data.next().unwrap_or_default();
                        out[gi] = Some((a, b));
                    }
                }
                per_layer.push(out);
            }
            host_groups.push(per_layer);
        }
        let name = sources.iter().map(|a| a.info.name.as_str()).collect::<Vec<_>>().join("+");
        let mut layers: Vec<[Option<LoraGroup>; 4]> =
            (0..model.config.num_layers()).map(|_| Default::default()).collect();
        let mut bytes = 0u64;
        for (layer, slots) in layers.iter_mut().enumerate() {
            for group in GROUPS {
                let gi = group as usize;
                let mut host = Vec::new();
                let mut fan_in = 0;
                for proj in Proj::ALL.into_iter().filter(|p| p.group() == group) {
                    let mut m = HostMember { proj, parts: Vec::new(), scaling: 1.0, a: Vec::new(), b: Vec::new() };
                    let mut b_parts: Vec<(&[f32], usize)> = Vec::new();
                    for (si, src) in sources.iter().enumerate() {
                        let Some(g) = src.group(layer, group) else { continue };
                        let Some(member) = g.member(proj) else { continue };
                        let Some((a, b)) = &host_groups[si][layer][gi] else { continue };
                        fan_in = g.a.cols;
                        let rows = member.t_offset * fan_in..(member.t_offset + member.rank) * fan_in;
                        m.a.extend_from_slice(a.get(rows).unwrap_or_default());
                        let b = b.get(member.b_offset..member.b_offset + member.out * member.rank).unwrap_or_default();
                        b_parts.push((b, member.rank));
                        m.parts.push(RankPart { source: si, rank: member.rank, scaling: member.scaling });
                    }
                    if m.parts.is_empty() {
                        continue;
                    }
                    let out = b_parts[0].0.len() / b_parts[0].1;
                    for row in 0..out {
                        for (b, r) in &b_parts {
                            m.b.extend_from_slice(&b[row * r..(row + 1) * r]);
                        }
                    }
                    host.push(m);
                }
                if host.is_empty() {
                    continue;
                }
                let label = format!("lora {name} layers.{layer} {group:?}");
                slots[gi] = Some(upload_group(ctx, &label, fan_in, host, &mut bytes)?);
            }
        }
        let mut modules: Vec<(usize, Proj)> = sources.iter().flat_map(|a| a.info.modules.iter().copied()).collect();
        modules.sort_unstable();
        modules.dedup();
        let mut ranks: Vec<usize> =
            layers.iter().flatten().flatten().flat_map(|g| g.members.iter().map(|m| m.rank)).collect();
        ranks.sort_unstable();
        ranks.dedup();
        let info = AdapterInfo {
            name,
            path: PathBuf::new(),
            ranks,
            config_source: ConfigSource::Stacked,
            modules,
            ignored: Vec::new(),
            ignored_count: 0,
            gpu_bytes: bytes,
        };
        Ok(Self { info, model: Arc::downgrade(model), layers, sources: sources.len() })
    }

    /// How many adapters this one stacks (1 for a loaded adapter).
    pub fn sources(&self) -> usize {
        self.sources
    }

    /// Whether this adapter was uploaded for `model` (the same `Arc`, not an equal model).
    pub fn is_for(&self, model: &Arc<Model>) -> bool {
        std::ptr::eq(self.model.as_ptr(), Arc::as_ptr(model))
    }

    /// The adapted projections of `layer` that read `group`'s input.
    pub fn group(&self, layer: usize, group: InputGroup) -> Option<&LoraGroup> {
        self.layers.get(layer).and_then(|g| g[group as usize].as_ref())
    }

    /// Every GPU buffer of the adapter (each group's A chunks and B): what a cache of bind
    /// groups must let go of for the adapter's memory to be freed with it.
    pub fn buffers(&self) -> Vec<&wgpu::Buffer> {
        let groups = self.layers.iter().flatten().flatten();
        groups.flat_map(|g| g.a.chunks.iter().map(|c| &c.buffer).chain(std::iter::once(&g.b))).collect()
    }

    /// The largest Σr of any group (sizes a session's t scratch).
    pub fn max_group_rank(&self) -> usize {
        self.layers.iter().flatten().flatten().map(|g| g.rank_total).max().unwrap_or(0)
    }
}
