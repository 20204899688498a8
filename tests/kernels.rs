//! Tier 2: each kernel against the plain-Rust reference (`engine/reference/`) over shape sweeps.

mod common;

use std::sync::Arc;

use common::tolerance::{ACCUMULATED_ATOL, ACCUMULATED_RTOL, EXACT, KERNEL_ATOL, KERNEL_RTOL, TOPK_MASS_REL};
use common::{assert_close, gpu};
use qwen35_wgpu::gpu::{
    read_f32, Affine, AffineData, GpuContext, GpuOptions, GpuVector, GpuWeight, HalfType, IoBindCache, Recorder,
    Subgroups,
};
use qwen35_wgpu::kernels::attention::{
    attention, attention_one, attention_one_rows, attention_splits, AttnIo, AttnOneIo, AttnParams, ATTN_MAX_ROWS,
    ATTN_MAX_SPLITS,
};
use qwen35_wgpu::kernels::gdn::{
    gated_delta, gdn_step, gdn_step_rows, GdnIo, GdnParams, GdnSplit, GdnStepIo, HeadShrink, DELTA_RULE_MAX_DK,
    GDN_MAX_ROWS,
};
use qwen35_wgpu::kernels::learn::{matmul_dx, matmul_dx_scratch, DxIo, DxWeight};
use qwen35_wgpu::kernels::matmul::{
    batch_tokens, linear, linear_rows, matmul_overrides, matmul_split, matmul_split_floats, matmul_tile, matvec_lanes,
    shrink_out_parts, Fuse, FusedNorm, LinearIo, LoraExpand, LoraSegment, NormOut, ScaleTableAt, ShrinkOut,
    SplitShrink, WeightRows, BATCH_SPLIT_SHRINK_FLOATS, MATMUL_TILES, MATVEC_BATCH_TOKENS, MATVEC_LANES,
    SPLIT_MIN_SPAN,
};
use qwen35_wgpu::kernels::misc::{
    argmax, argmax_rows, argmax_scratch_bytes, embed, swiglu, topk, topk_blocks, topk_mass_offset, topk_max,
    topk_scratch_bytes, topk_value, TopkIo,
};
use qwen35_wgpu::kernels::norm::{rms_norm, rms_norm_gated, rms_norm_shrink, NormIo, NormShrink};
use qwen35_wgpu::model::quantize::quantize_bytes;
use qwen35_wgpu::model::Dtype;
use qwen35_wgpu::{reference as cpu, GpuError};

/// Deterministic values in [-scale, scale).
fn rand(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Scale-table factors whose products with t are exact (powers of two of both signs), so the
/// kernels' rounding is the same as without a table while a misplaced factor still shows.
fn exact_factors(n: usize, seed: u64) -> Vec<f32> {
    rand(n, seed, 1.0).iter().map(|v| [0.5, -1.0, 2.0, -0.25][((v + 1.0) * 2.0) as usize % 4]).collect()
}

fn upload(ctx: &GpuContext, data: &[f32]) -> wgpu::Buffer {
    ctx.upload("test", bytemuck::cast_slice(data)).expect("upload")
}

fn read(ctx: &GpuContext, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
    read_f32(ctx, b, 0, n).expect("readback")
}

/// A bind cache with a fresh uniform arena of `bytes`.
fn bind_cache(ctx: &GpuContext, bytes: u64) -> IoBindCache {
    IoBindCache::with_arena(ctx, "arena", bytes)
}

/// Record with `f` and submit, with a fresh uniform arena.
fn run(ctx: &GpuContext, f: impl FnOnce(&mut Recorder) -> Result<(), GpuError>) {
    let mut cache = bind_cache(ctx, 256 * 1024);
    let mut rec = Recorder::new(ctx, &mut cache);
    f(&mut rec).expect("record");
    rec.submit().expect("submit");
}

/// Weight bytes in `dtype` and the exact f32 values they hold.
fn weight_bytes(values: &[f32], dtype: Dtype) -> (Vec<u8>, Vec<f32>) {
    let bytes: Vec<u8> = match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        Dtype::Affine(_) => panic!("float dtypes only (affine weights: affine_weights)"),
    };
    let exact = dtype.to_f32(&bytes).expect("a float dtype");
    (bytes, exact)
}

fn ctx() -> Option<Arc<GpuContext>> {
    gpu()
}

#[test]
fn linear_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let shapes = [(1, 1, 1), (1, 7, 13), (1, 300, 257), (2, 5, 3), (3, 65, 17), (70, 130, 33), (64, 64, 64)];
    for (si, &(m, n, k)) in shapes.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            for (accumulate, chunk) in [(false, u64::MAX), (true, u64::MAX), (false, 64)] {
                let seed = si as u64 * 31 + dtype.row_bytes(1) as u64;
                let (bytes, w) = weight_bytes(&rand(n * k, seed, 1.0), dtype);
                let max_chunk = chunk.max(dtype.row_bytes(k) as u64);
                let gw = GpuWeight::upload(&ctx, "w", dtype, n, k, &bytes, max_chunk).expect("weight");
                // x starts at row 1 of a bigger buffer; y rows are wider than n (stride n + 3).
                let x = rand((m + 1) * k, seed + 1, 1.0);
                let y0 = rand(m * (n + 3), seed + 2, 1.0);
                let (xb, yb) = (upload(&ctx, &x), upload(&ctx, &y0));
                let io = LinearIo { x: &xb, x_offset: k, m, y: &yb, y_offset: 1, y_stride: n + 3, accumulate };
                run(&ctx, |rec| linear(rec, &gw, &io, None));
                let got = read(&ctx, &yb, m * (n + 3));
                let prod = cpu::linear(&x[k..], &w, m, n, k);
                let mut want = y0.clone();
                for i in 0..m {
                    for j in 0..n {
                        let slot = &mut want[1 + i * (n + 3) + j];
                        *slot = if accumulate { *slot + prod[i * n + j] } else { prod[i * n + j] };
                    }
                }
                let what = format!("linear m{m} n{n} k{k} {dtype:?} acc={accumulate} chunks={}", gw.chunks.len());
                assert_close(&what, &got, &want, KERNEL_ATOL, KERNEL_RTOL);
            }
        }
    }
}

#[test]
fn linear_with_fused_lora_expand_matches_reference() {
    let Some(ctx) = ctx() else { return };
    // (m, n, k, rank, t_stride, t_offset); chunked weights check the B row offset per chunk.
    for &(m, n, k, rank, stride, offset) in
        &[(1, 7, 13, 1, 3, 2), (1, 130, 64, 16, 40, 8), (5, 70, 33, 8, 8, 0), (70, 65, 17, 20, 24, 4)]
    {
        for chunk in [u64::MAX, 64 * 4] {
            let seed = (m * 7 + n + rank) as u64;
            let (bytes, w) = weight_bytes(&rand(n * k, seed, 1.0), Dtype::BF16);
            let gw = GpuWeight::upload(&ctx, "w", Dtype::BF16, n, k, &bytes, chunk.max((k * 2) as u64)).expect("w");
            let x = rand(m * k, seed + 1, 1.0);
            let t = rand(m * stride, seed + 2, 1.0);
            let b = rand(n * rank, seed + 3, 1.0);
            let (xb, tb, yb) = (upload(&ctx, &x), upload(&ctx, &t), upload(&ctx, &vec![0.0; m * n]));
            let bb = upload(&ctx, &b);
            let bg = ctx.weights_bind_group(&bb, "b");
            let io = LinearIo { x: &xb, x_offset: 0, m, y: &yb, y_offset: 0, y_stride: n, accumulate: false };
            let lora = LoraExpand::single(&tb, (offset, stride), (rank, 0), -0.75, &bg);
            run(&ctx, |rec| linear(rec, &gw, &io, Some(&lora)));
            let mut want = cpu::linear(&x, &w, m, n, k);
            for i in 0..m {
                for j in 0..n {
                    let d: f32 = (0..rank).map(|r| t[i * stride + offset + r] * b[j * rank + r]).sum();
                    want[i * n + j] += -0.75 * d;
                }
            }
            let what = format!("lora linear m{m} n{n} k{k} r{rank} chunks={}", gw.chunks.len());
            assert_close(&what, &read(&ctx, &yb, m * n), &want, KERNEL_ATOL, KERNEL_RTOL);
        }
    }
}

/// B for `segments` (ranks, rows) in one buffer as the adapter lays it out (each segment from a
/// multiple of its rank), and each segment's first element.
fn segment_b(segments: &[(usize, usize)], seed: u64) -> (Vec<f32>, Vec<usize>) {
    let mut b = Vec::new();
    let mut offsets = Vec::new();
    for (j, &(rank, rows)) in segments.iter().enumerate() {
        let off = if rank == 0 { b.len() } else { b.len().div_ceil(rank) * rank };
        b.resize(off, 0.0);
        b.extend(rand(rows * rank, seed + j as u64, 1.0));
        offsets.push(off);
    }
    b.push(0.0);
    (b, offsets)
}

/// The default context: where the subgroup is narrower than 64 lanes (lavapipe's 8 in CI) the
/// wider row groups run the subgroup kernels with `SPLIT`.
#[test]
fn matvec_sweep_matches_reference() {
    let Some(ctx) = ctx() else { return };
    if ctx.info.backend == wgpu::Backend::Vulkan && common::adapter_required() {
        let size = ctx.subgroup_size();
        assert!(size.is_some_and(|s| s < 64), "{}: subgroup size {size:?}, so CI would not test SPLIT", ctx.info.name);
        assert_eq!(ctx.subgroup_matvec(64), Some(true), "row groups of 64 lanes run with SPLIT");
    }
    matvec_sweep(&ctx);
    glu_shrink_out_sweep(&ctx);
    residual_shrink_out_sweep(&ctx);
}

/// The matvec sweeps on a context without subgroups (the portable reduction for every shape) and
/// on one that runs the subgroup kernels for every shape (also row groups wider than the
/// subgroup, the idle-row-group path). Where the adapter has subgroups they must be in use; a
/// Vulkan adapter in CI (lavapipe) must have them.
#[test]
fn matvec_sweeps_match_reference_on_both_reduction_paths() {
    for subgroups in [Subgroups::Off, Subgroups::Always] {
        let Some(ctx) = common::gpu_with(GpuOptions { subgroups }) else { return };
        let has = ctx.features.contains(wgpu::Features::SUBGROUP);
        assert_eq!(has && subgroups != Subgroups::Off, ctx.subgroup_size().is_some(), "{subgroups:?}: size measured");
        if subgroups == Subgroups::Always && ctx.info.backend == wgpu::Backend::Vulkan && common::adapter_required() {
            assert!(has, "{}: no SUBGROUP feature, so CI would not test the subgroup kernels", ctx.info.name);
        }
        matvec_sweep(&ctx);
        glu_shrink_out_sweep(&ctx);
        residual_shrink_out_sweep(&ctx);
        affine_sweep(&ctx);
    }
}

/// A SwiGLU matvec that also writes the next projection's shrink split by workgroup: the
/// outputs, each workgroup's part (its outputs times their columns of A, the rank's padding
/// zero) and nothing past the last part, over every rows-per-workgroup variant, ranks around
/// the padding, dtypes, with and without a norm and a LoRA expand of its own.
fn glu_shrink_out_sweep(ctx: &GpuContext) {
    let g = ctx.min_workgroups();
    // (outputs, k, rank, dtype, norm, own LoRA rank)
    let cases = [
        (1, 8, 1, Dtype::BF16, false, 0),
        (5, 13, 4, Dtype::F32, true, 0),
        (33, 16, 13, Dtype::F16, false, 3),
        (8 * g - 3, 24, 16, Dtype::BF16, true, 4),
        (16 * g + 5, 8, 2, Dtype::BF16, false, 0),
        (32 * g + 1, 40, 33, Dtype::F32, false, 8),
    ];
    let mut lanes = std::collections::BTreeSet::new();
    for (ci, &(n, k, rank, dtype, norm, own)) in cases.iter().enumerate() {
        let seed = 900 + ci as u64 * 7;
        let (bytes, w) = weight_bytes(&rand(2 * n * k, seed, 1.0), dtype);
        let gw = GpuWeight::upload(ctx, "w", dtype, 2 * n, k, &bytes, u64::MAX).expect("weight");
        let x = rand(k, seed + 1, 1.0);
        let norm_w = rand(k, seed + 2, 0.5);
        let a = rand(rank * n, seed + 3, 1.0);
        let count = shrink_out_parts(ctx, 2 * n, true);
        lanes.insert(matvec_lanes(2 * n, g));
        let per = 256 / matvec_lanes(2 * n, g) as usize;
        let (at, pad) = (n.next_multiple_of(4), rank.next_multiple_of(4));
        let y_len = at + count * pad + 4;
        let (xb, yb, ab, nb) = (upload(ctx, &x), upload(ctx, &vec![7.0; y_len]), upload(ctx, &a), upload(ctx, &norm_w));
        // Its own expand (gate|up adapted too): one segment over all 2n rows.
        let t = rand(own.max(1), seed + 4, 1.0);
        let b = rand(2 * n * own.max(1), seed + 5, 0.1);
        let (tb, bb) = (upload(ctx, &t), upload(ctx, &b));
        let bg = ctx.weights_bind_group(&bb, "b");
        let lora = LoraExpand::single(&tb, (0, own), (own, 0), 0.5, &bg);
        let shrink_out = Some(ShrinkOut { a: &ab, rank, at, norm: None });
        let fused = norm.then_some(FusedNorm { weight: &nb, eps: 1e-6, prenormed: None });
        let fuse = Fuse { norm: fused, glu: true, shrink_out, norm_out: None };
        let io = LinearIo { x: &xb, x_offset: 0, m: 1, y: &yb, y_offset: 0, y_stride: n, accumulate: false };
        run(ctx, |rec| linear_rows(rec, WeightRows::all(&gw), &io, (own > 0).then_some(&lora), fuse));
        let xin = if norm { cpu::rms_norm(&x, &norm_w, k, 1e-6) } else { x.clone() };
        let mut vals = cpu::linear(&xin, &w, 1, 2 * n, k);
        if own > 0 {
            for (r, v) in vals.iter_mut().enumerate() {
                *v += 0.5 * (0..own).map(|c| t[c] * b[r * own + c]).sum::<f32>();
            }
        }
        let h: Vec<f32> = (0..n).map(|o| cpu::silu(vals[o]) * vals[n + o]).collect();
        let got = read(ctx, &yb, y_len);
        let what = format!("SwiGLU shrink out n{n} k{k} rank {rank} {dtype:?} norm {norm} own rank {own}");
        assert_close(&what, &got[..n], &h, KERNEL_ATOL, KERNEL_RTOL);
        for q in 0..count {
            let part = &got[at + q * pad..at + (q + 1) * pad];
            let cols = q * per..((q + 1) * per).min(n);
            let want: Vec<f32> = (0..rank).map(|r| cols.clone().map(|o| a[r * n + o] * h[o]).sum()).collect();
            assert_close(&format!("{what}: part {q} of {count}"), &part[..rank], &want, KERNEL_ATOL, KERNEL_RTOL);
            assert!(part[rank..].iter().all(|&v| v == 0.0), "{what}: padding of part {q}");
        }
        assert!(got[at + count * pad..].iter().all(|&v| v == 7.0), "{what}: wrote past the parts");
    }
    assert_eq!(lanes.len(), 4, "every rows-per-workgroup variant: {lanes:?}");
    // Refused, not computed wrongly: parts that do not fit in y.
    let gw = GpuWeight::upload(ctx, "w", Dtype::F32, 8, 8, &[0; 8 * 8 * 4], u64::MAX).expect("weight");
    let (xb, yb, ab) = (upload(ctx, &[1.0; 8]), upload(ctx, &[0.0; 4]), upload(ctx, &[1.0; 4]));
    let fuse = Fuse { glu: true, shrink_out: Some(ShrinkOut { a: &ab, rank: 1, at: 4, norm: None }), ..Fuse::NONE };
    let io = LinearIo { x: &xb, x_offset: 0, m: 1, y: &yb, y_offset: 0, y_stride: 4, accumulate: false };
    let mut cache = IoBindCache::new(upload(ctx, &[0.0; 64]));
    let mut rec = Recorder::new(ctx, &mut cache);
    let err = linear_rows(&mut rec, WeightRows::all(&gw), &io, None, fuse);
    assert!(matches!(err, Err(GpuError::Validation { .. })), "{err:?}");
    // Refused for what it is (A and y large enough for every case below): a shrink out without
    // the SwiGLU or the residual add that writes it, a norm weight with SwiGLU, on a projection
    // that does not accumulate, or beside a fused norm; the same residual shrink out is recorded.
    let yb = upload(ctx, &[0.0; 64]);
    let (ab, nb) = (upload(ctx, &[1.0; 8]), upload(ctx, &[0.5; 8]));
    let plain = LinearIo { y: &yb, y_stride: 8, ..io };
    let residual = LinearIo { accumulate: true, ..plain };
    let out = |norm| Some(ShrinkOut { a: &ab, rank: 1, at: 8, norm });
    let fused_norm = Some(FusedNorm { weight: &nb, eps: 1e-6, prenormed: None });
    for (what, io, fuse) in [
        ("no SwiGLU, no norm weight", &plain, Fuse { shrink_out: out(None), ..Fuse::NONE }),
        ("a norm weight with SwiGLU", &plain, Fuse { glu: true, shrink_out: out(Some(&nb)), ..Fuse::NONE }),
        ("a norm weight, not accumulating", &plain, Fuse { shrink_out: out(Some(&nb)), ..Fuse::NONE }),
        (
            "a norm weight beside a fused norm",
            &residual,
            Fuse { norm: fused_norm, shrink_out: out(Some(&nb)), ..Fuse::NONE },
        ),
    ] {
        match linear_rows(&mut rec, WeightRows::all(&gw), io, None, fuse) {
            Err(GpuError::Validation { message, .. }) => {
                assert!(message.contains("a shrink out is written by SwiGLU"), "{what}: {message}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    let fuse = Fuse { shrink_out: out(Some(&nb)), ..Fuse::NONE };
    linear_rows(&mut rec, WeightRows::all(&gw), &residual, None, fuse).expect("a residual shrink out");
}

/// A residual projection (accumulating, one token) that also writes the next block's input
/// shrink of the residual times (1 + that block's norm weight), split by workgroup, and/or (a
/// norm out) the residual times (1 + that weight) with one sum of squares per workgroup, then the
/// block's projection fusing the norm and reading those parts (its expand scaled by the norm's
/// rsqrt) and, after a norm out, that prenormed input: the residual, every part, the norm out,
/// nothing past them, and the reader's outputs against the reference (the normed residual and its
/// shrink), over every rows-per-workgroup variant, ranks around the padding, dtypes, with and
/// without a LoRA expand on the residual projection. Cases cycle through the shrink out alone,
/// with a norm out, and a norm out alone (no adapter on the reader).
fn residual_shrink_out_sweep(ctx: &GpuContext) {
    let g = ctx.min_workgroups();
    // (residual width n, k, rank, dtype, own LoRA rank)
    let cases = [
        (1, 8, 1, Dtype::BF16, 0),
        (5, 13, 4, Dtype::F32, 2),
        (8 * g - 3, 24, 16, Dtype::BF16, 4),
        (16 * g + 5, 8, 13, Dtype::F16, 0),
        (32 * g + 1, 40, 33, Dtype::F32, 8),
        (64 * g + 3, 16, 2, Dtype::BF16, 3),
    ];
    let (n2, scale, eps) = (24, 0.75, 1e-6);
    let mut lanes = std::collections::BTreeSet::new();
    for (ci, &(n, k, rank, dtype, own)) in cases.iter().enumerate() {
        let seed = 1300 + ci as u64 * 11;
        let (bytes, w) = weight_bytes(&rand(n * k, seed, 1.0), dtype);
        let gw = GpuWeight::upload(ctx, "w", dtype, n, k, &bytes, u64::MAX).expect("weight");
        let (bytes2, w2) = weight_bytes(&rand(n2 * n, seed + 1, 1.0), dtype);
        let gw2 = GpuWeight::upload(ctx, "w2", dtype, n2, n, &bytes2, u64::MAX).expect("weight");
        let x = rand(k, seed + 2, 1.0);
        let resid = rand(n, seed + 3, 2.0);
        let norm_w = rand(n, seed + 4, 0.5);
        let a = rand(rank * n, seed + 5, 1.0);
        let b = rand(n2 * rank, seed + 6, 0.3);
        let count = shrink_out_parts(ctx, n, false);
        lanes.insert(matvec_lanes(n, g));
        let per = 512 / matvec_lanes(n, g) as usize;
        let (at, pad) = (n.next_multiple_of(4), rank.next_multiple_of(4));
        let (shrinks, norm_out) = (ci % 3 != 2, ci % 3 != 0);
        let xw_at = if shrinks { at + count * pad } else { at };
        let ssq_at = xw_at + n.next_multiple_of(4);
        let end = if norm_out { ssq_at + count } else { xw_at };
        let y_len = end + 4;
        let mut y0 = resid.clone();
        y0.resize(y_len, 7.0);
        // The residual projection's own expand: one segment over its n rows; in odd cases its t
        // comes in two parts after x (o_proj and down_proj read their own split shrink).
        let t_own = rand(own.max(1), seed + 7, 1.0);
        let b_own = rand(n * own.max(1), seed + 8, 0.1);
        let own_split = own > 0 && ci % 2 == 1;
        let mut xs = x.clone();
        if own_split {
            let (x_at, stride) = (k.next_multiple_of(4), own.next_multiple_of(4));
            let p0 = rand(own, seed + 9, 1.0);
            xs.resize(x_at + 2 * stride, 0.0);
            for c in 0..own {
                xs[x_at + c] = p0[c];
                xs[x_at + stride + c] = t_own[c] - p0[c];
            }
        }
        let (xb, yb, ab, nb) = (upload(ctx, &xs), upload(ctx, &y0), upload(ctx, &a), upload(ctx, &norm_w));
        let y2b = upload(ctx, &vec![0.0; n2]);
        let (tb, bb) = (upload(ctx, &t_own), upload(ctx, &b_own));
        let bg = ctx.weights_bind_group(&bb, "b");
        let own_parts = own_split.then(|| SplitShrink { count: 2, at: k.next_multiple_of(4) });
        let own_lora = LoraExpand { parts: own_parts, ..LoraExpand::single(&tb, (0, own), (own, 0), 0.5, &bg) };
        // The reader's expand: t summed from the parts, in even cases past the first times a scale
        // table (an adapter set's per-rank factors) from its t buffer, which holds only that.
        let factors = exact_factors(rank, seed + 10);
        let table = (ci % 2 == 0 && ci > 0).then_some(ScaleTableAt { offset: 4, stride: 0 });
        let factor = |c: usize| if table.is_some() { factors[c] } else { 1.0 };
        let t2b = upload(ctx, &[vec![0.0; 4], factors.clone()].concat());
        let b2b = upload(ctx, &b);
        let bg2 = ctx.weights_bind_group(&b2b, "b2");
        let split = Some(SplitShrink { count, at });
        let single = LoraExpand::single(&t2b, (0, rank), (rank, 0), scale, &bg2);
        let lora = LoraExpand { parts: split, table, ..single };
        let out = Fuse {
            shrink_out: shrinks.then_some(ShrinkOut { a: &ab, rank, at, norm: Some(&nb) }),
            norm_out: norm_out.then_some(NormOut { weight: &nb, at: xw_at, ssq_at }),
            ..Fuse::NONE
        };
        let prenormed = norm_out.then_some(SplitShrink { count, at: ssq_at });
        let normed = Fuse { norm: Some(FusedNorm { weight: &nb, eps, prenormed }), ..Fuse::NONE };
        let io = LinearIo { x: &xb, x_offset: 0, m: 1, y: &yb, y_offset: 0, y_stride: n, accumulate: true };
        let x_offset = if norm_out { xw_at } else { 0 };
        let io2 = LinearIo { x: &yb, x_offset, m: 1, y: &y2b, y_offset: 0, y_stride: n2, accumulate: false };
        run(ctx, |rec| {
            linear_rows(rec, WeightRows::all(&gw), &io, (own > 0).then_some(&own_lora), out)?;
            linear_rows(rec, WeightRows::all(&gw2), &io2, shrinks.then_some(&lora), normed)
        });
        let mut h = cpu::linear(&x, &w, 1, n, k);
        for (r, v) in h.iter_mut().enumerate() {
            if own > 0 {
                *v += 0.5 * (0..own).map(|c| t_own[c] * b_own[r * own + c]).sum::<f32>();
            }
            *v += resid[r];
        }
        let got = read(ctx, &yb, y_len);
        let what = format!(
            "residual shrink out {shrinks} norm out {norm_out} n{n} k{k} rank {rank} {dtype:?} own rank {own} (split {own_split}), table {table:?}"
        );
        assert_close(&what, &got[..n], &h, KERNEL_ATOL, KERNEL_RTOL);
        if norm_out {
            let xw: Vec<f32> = (0..n).map(|o| h[o] * (1.0 + norm_w[o])).collect();
            assert_close(&format!("{what}: normed out"), &got[xw_at..xw_at + n], &xw, KERNEL_ATOL, KERNEL_RTOL);
            let sums: Vec<f32> =
                (0..count).map(|q| h[q * per..((q + 1) * per).min(n)].iter().map(|v| v * v).sum()).collect();
            assert_close(&format!("{what}: sums of squares"), &got[ssq_at..end], &sums, KERNEL_ATOL, KERNEL_RTOL);
        }
        for q in (0..count).filter(|_| shrinks) {
            let part = &got[at + q * pad..at + (q + 1) * pad];
            let cols = q * per..((q + 1) * per).min(n);
            let want: Vec<f32> =
                (0..rank).map(|r| cols.clone().map(|o| a[r * n + o] * (1.0 + norm_w[o]) * h[o]).sum()).collect();
            assert_close(&format!("{what}: part {q} of {count}"), &part[..rank], &want, KERNEL_ATOL, KERNEL_RTOL);
            assert!(part[rank..].iter().all(|&v| v == 0.0), "{what}: padding of part {q}");
        }
        assert!(got[end..].iter().all(|&v| v == 7.0), "{what}: wrote past the parts");
        // The reader: W2 · norm(h) + scale · B · (A · norm(h)).
        let hn = cpu::rms_norm(&h, &norm_w, n, eps);
        let t = cpu::linear(&hn, &a, 1, rank, n);
        let mut want = cpu::linear(&hn, &w2, 1, n2, n);
        for (r, v) in want.iter_mut().enumerate().filter(|_| shrinks) {
            *v += scale * (0..rank).map(|c| t[c] * factor(c) * b[r * rank + c]).sum::<f32>();
        }
        assert_close(&format!("{what}: the reader"), &read(ctx, &y2b, n2), &want, KERNEL_ATOL, KERNEL_RTOL);
    }
    assert_eq!(lanes.len(), 4, "every rows-per-workgroup variant: {lanes:?}");
}

/// Matvec shapes, dtypes, LoRA segments, fusions and split shrinks against the reference.
fn matvec_sweep(ctx: &GpuContext) {
    // (n, k): n below, at and above the rows per workgroup (16 below 4096 rows, 32 from there),
    // k odd, not a multiple of 8, and aligned; x offsets 4 (16-byte aligned) and 3 (element path).
    let g = ctx.min_workgroups();
    let shapes = [
        (1, 1),
        (15, 8),
        (16, 13),
        (17, 24),
        (31, 257),
        (33, 1024),
        (100, 7),
        (16 * g - 3, 40),
        (32 * g - 5, 1024),
        (64 * g - 1, 64),
        (64 * g + 1, 1032),
        (4097, 24),
    ];
    // Every rows-per-workgroup variant is exercised on this device.
    let lanes: std::collections::BTreeSet<u32> = shapes.iter().map(|&(n, _)| matvec_lanes(n, g)).collect();
    assert_eq!(lanes.into_iter().collect::<Vec<_>>(), MATVEC_LANES.to_vec(), "variants covered");
    for (si, &(n, k)) in shapes.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            // (x offset, rows per chunk (0: one chunk), LoRA rank, fuse: 1 RMSNorm1p, 2 SwiGLU,
            // first row of the view): the view's rows split in three LoRA segments (ranks r, 0
            // and r + 2) when there are three rows; SwiGLU computes 2n rows ([gate; up]).
            for (x_off, chunk_rows, rank, pro, view0) in [
                (4, 0, 0, 0, 0),
                (3, 0, 3, 0, 5),
                (4, 16, 5, 0, 3),
                (4, 0, 16, 0, 0),
                (4, 0, 0, 1, 2),
                (3, 16, 5, 1, 0),
                (4, 0, 3, 2, 0),
                (3, 0, 0, 2, 7),
                (4, 0, 2, 3, 1),
                (4, 0, 16, 1, 0),
                (4, 0, 130, 0, 1),
            ] {
                // Rank 130: t's 266 columns pass the 256 the matvec stages in workgroup memory,
                // so the expand multiplies in the table per row (every fourth shape).
                if rank > 128 && si % 4 != 0 {
                    continue;
                }
                let glu = pro & 2 == 2;
                let norm = pro & 1 == 1;
                let rows = if glu { 2 * n } else { n };
                let total = view0 + rows + 1;
                let seed = 500 + si as u64 * 13 + dtype.row_bytes(1) as u64;
                let (bytes, w) = weight_bytes(&rand(total * k, seed, 1.0), dtype);
                let chunk = (if chunk_rows == 0 { total } else { chunk_rows } * dtype.row_bytes(k)) as u64;
                let gw = GpuWeight::upload(ctx, "w", dtype, total, k, &bytes, chunk).expect("weight");
                let x = rand(x_off + k, seed + 1, 1.0);
                let y0 = rand(n + 2, seed + 2, 1.0);
                let norm_w = rand(k, seed + 5, 0.5);
                // LoRA segments: (rank, rows), t columns after two unused ones (four when the
                // rank is a multiple of 4: segment 0 takes the 16-byte expand path), scales.
                let segs: Vec<(usize, usize)> = if rows >= 3 {
                    vec![(rank, rows / 3), (0, rows / 3), (rank + 2, rows - 2 * (rows / 3))]
                } else {
                    vec![(rank, rows)]
                };
                let scales = [0.5, 0.0, -0.25];
                let t_offs: Vec<usize> = segs
                    .iter()
                    .scan(if rank % 4 == 0 { 4 } else { 2 }, |acc, &(r, _)| Some(std::mem::replace(acc, *acc + r)))
                    .collect();
                let mut t = rand(4 + segs.iter().map(|s| s.0).sum::<usize>(), seed + 3, 1.0);
                // A scale table (one factor per t column) after t, in the same buffer, for some
                // cases: the element path (odd view start) and the vec4 path (rank 16).
                let t_cols = t.len();
                let table = (view0 % 2 == 1 || rank == 16).then(|| t_cols.next_multiple_of(4));
                let factors = exact_factors(t_cols, seed + 6);
                if let Some(at) = table {
                    t.resize(at, 0.0);
                    t.extend_from_slice(&factors);
                }
                let factor = |c: usize| if table.is_some() { factors[c] } else { 1.0 };
                let (b, b_offs) = segment_b(&segs, seed + 4);
                // A split shrink in some cases (x aligned): t's columns as three parts after x in
                // x's buffer, summing to t, instead of in t's buffer (which keeps the table).
                let split = rank > 0 && x_off == 4 && (view0 + si) % 2 == 0 && t_cols <= 256;
                let mut xs = x.clone();
                let parts = split.then(|| {
                    let (at, stride) = ((x_off + k).next_multiple_of(4), t_cols.next_multiple_of(4));
                    xs.resize(at + 3 * stride, 0.0);
                    let (p0, p1) = (rand(t_cols, seed + 7, 1.0), rand(t_cols, seed + 8, 1.0));
                    for c in 0..t_cols {
                        xs[at + c] = p0[c];
                        xs[at + stride + c] = p1[c];
                        xs[at + 2 * stride + c] = t[c] - p0[c] - p1[c];
                    }
                    SplitShrink { count: 3, at }
                });
                // t's own columns zeroed where the parts stand in for them (the table stays).
                let mut t_buf = t.clone();
                if parts.is_some() {
                    t_buf[..t_cols].fill(0.0);
                }
                let (xb, yb, tb, bb) = (upload(ctx, &xs), upload(ctx, &y0), upload(ctx, &t_buf), upload(ctx, &b));
                let nb = upload(ctx, &norm_w);
                let bg = ctx.weights_bind_group(&bb, "b");
                let segments = segs
                    .iter()
                    .enumerate()
                    .map(|(j, &(r, rows))| LoraSegment {
                        rows,
                        rank: r,
                        t_offset: t_offs[j],
                        b_offset: b_offs[j],
                        scale: scales[j],
                    })
                    .collect();
                let table = table.map(|offset| ScaleTableAt { offset, stride: 0 });
                let lora = LoraExpand { t: &tb, t_stride: t_cols, b: &bg, segments, table, parts };
                let accumulate = rank % 2 == 1 && !glu;
                let io = LinearIo { x: &xb, x_offset: x_off, m: 1, y: &yb, y_offset: 2, y_stride: n, accumulate };
                let norm_fused = norm.then_some(FusedNorm { weight: &nb, eps: 1e-6, prenormed: None });
                let fuse = Fuse { norm: norm_fused, glu, ..Fuse::NONE };
                let view = WeightRows { w: &gw, rows: view0..view0 + rows };
                run(ctx, |rec| linear_rows(rec, view, &io, (rank > 0).then_some(&lora), fuse));
                let xin = if norm { cpu::rms_norm(&x[x_off..], &norm_w, k, 1e-6) } else { x[x_off..].to_vec() };
                let prod = cpu::linear(&xin, &w[view0 * k..(view0 + rows) * k], 1, rows, k);
                let mut vals = prod.clone();
                // With the norm fused, split parts are of the input before the norm's scale (a
                // residual projection's shrink out), so the expand takes that scale.
                let ms = x[x_off..].iter().map(|v| v * v).sum::<f32>() / k as f32;
                let expand_scale = if norm && split { 1.0 / (ms + 1e-6).sqrt() } else { 1.0 };
                if rank > 0 {
                    let mut start = 0;
                    for (j, &(r, seg_rows)) in segs.iter().enumerate() {
                        for (i, v) in vals[start..start + seg_rows].iter_mut().enumerate() {
                            let b0 = b_offs[j] + i * r;
                            let d: f32 = (0..r).map(|c| t[t_offs[j] + c] * factor(t_offs[j] + c) * b[b0 + c]).sum();
                            *v += scales[j] * d * expand_scale;
                        }
                        start += seg_rows;
                    }
                }
                let mut want = y0.clone();
                for j in 0..n {
                    let slot = &mut want[2 + j];
                    *slot = if glu {
                        cpu::silu(vals[j]) * vals[n + j]
                    } else if accumulate {
                        *slot + vals[j]
                    } else {
                        vals[j]
                    };
                }
                let what = format!(
                    "matvec n{n} k{k} {dtype:?} x_offset {x_off} rank {rank} fuse {pro} rows {view0}.. acc={accumulate} chunks={} table {table:?} split {parts:?}",
                    gw.chunks.len()
                );
                assert_close(&what, &read(ctx, &yb, n + 2), &want, KERNEL_ATOL, KERNEL_RTOL);
            }
        }
    }
}

#[test]
fn matmul_sweep_matches_reference() {
    let Some(ctx) = ctx() else { return };
    // (m, n, k): tokens below, at and above each tile height (16, 32, 64, 128), outputs around
    // the 64-column tile, grids of 128-column tiles wide enough for any device's minimum
    // (partial in both dimensions) at every height, k a multiple of 8 that is not one of BK
    // (vector staging with a partial last step), odd k (element staging); x offsets 4 (aligned)
    // and 1 (element staging).
    let shapes = [
        (2, 5, 8),
        (64, 33, 16),
        (65, 64, 24),
        (127, 64, 24),
        (128, 65, 40),
        (129, 130, 1032),
        (200, 16, 13),
        (3, 70, 64),
        (16, 70, 24),
        (17, 65, 40),
        (32, 64, 13),
        (33, 7, 1032),
        (1100, 1800, 24),
        (5, 16300, 8),
        (20, 16300, 13),
        (40, 16300, 16),
    ];
    let g = ctx.min_workgroups();
    let tiles: std::collections::BTreeSet<u32> = shapes.iter().map(|&(m, n, _)| matmul_tile(m, n, g)).collect();
    assert_eq!(tiles.into_iter().collect::<Vec<_>>(), MATMUL_TILES.to_vec(), "tile variants covered");
    for (si, &(m, n, k)) in shapes.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            for (x_off, chunk_rows, rank) in [(4, n, 0), (1, n, 3), (4, 24, 5), (4, n, 20)] {
                check_linear(&ctx, (m, n, k), dtype, (x_off, chunk_rows, rank), 700 + si as u64 * 17);
            }
        }
    }
}

#[test]
fn matmul_splits_its_reduction_where_its_tiles_leave_the_device_idle() {
    // A context of its own: the dispatch counters below are this test's alone.
    let Some(ctx) = common::gpu_with(GpuOptions::default()) else { return };
    let g = ctx.min_workgroups();
    // (m, n, k): one tile over a long reduction, which splits on any device (the shape of a LoRA
    // shrink at prefill, or of GDN's b and a): k a multiple of 16, of 8 only (the last slice ends
    // in a partial step), odd (element staging), a 128-token tile, two tile rows (each slice
    // stores both); then a grid of tiles too short in k to split.
    let shapes = [(128, 16, 3584), (31, 40, 1032), (5, 33, 1001), (70, 64, 2048), (200, 16, 2048), (1100, 1800, 24)];
    for (si, &(m, n, k)) in shapes.iter().enumerate() {
        let (slices, span) = matmul_split(m, n, k, matmul_tile(m, n, g), g);
        assert_eq!(slices > 1, si < 5, "m{m} n{n} k{k}: {slices} slices of {span}");
        if slices > 1 {
            assert!(span % 16 == 0 && span >= SPLIT_MIN_SPAN, "m{m} n{n} k{k}: span {span}");
            assert!((slices - 1) * span < k && k <= slices * span, "m{m} n{n} k{k}: {slices} slices of {span}");
        }
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            // The 16-byte path, an unaligned x, a weight in two bindings (each chunk splits on its
            // own), a fused expand (slice 0 adds it); odd ranks accumulate into y.
            for (x_off, chunk_rows, rank) in [(4, n, 0), (1, n, 3), (4, 24, 5), (4, n, 20)] {
                let before = ctx.counters();
                check_linear(&ctx, (m, n, k), dtype, (x_off, chunk_rows, rank), 1300 + si as u64 * 13);
                // Each chunk's matmul, and the sum of its slices where it splits.
                let chunks = n.div_ceil(chunk_rows.min(n)) as u64;
                let want = if slices > 1 { 2 * chunks } else { chunks };
                let what = format!("m{m} n{n} k{k} {dtype:?} rank {rank}: dispatches");
                assert_eq!((ctx.counters() - before).dispatches, want, "{what}");
            }
        }
    }
}

#[test]
fn split_reductions_fit_their_scratch_and_cover_k() {
    // Every prompt length up to two tiles of 128, output widths from one column to a wide
    // projection, reductions from too short to split to down_proj's, on a CPU adapter's and a
    // GPU's minimum workgroups.
    let mut splits = 0;
    for g in [4, 128] {
        for m in 9..=256 {
            for n in [1, 16, 40, 64, 65, 256, 1024, 2048, 4096, 6144] {
                for k in [24, 255, 256, 512, 1000, 1024, 2048, 3584] {
                    let variant = matmul_tile(m, n, g);
                    let (slices, span) = matmul_split(m, n, k, variant, g);
                    let (tm, tn) = matmul_overrides(variant);
                    let tiles = n.div_ceil(tn as usize) * m.div_ceil(tm as usize);
                    let what = format!("m{m} n{n} k{k} g{g}: {slices} slices of {span} over {tiles} tiles");
                    if slices == 1 {
                        assert_eq!(span, k, "{what}");
                        continue;
                    }
                    splits += 1;
                    assert!(span % 16 == 0 && span >= SPLIT_MIN_SPAN, "{what}");
                    assert!((slices - 1) * span < k && k <= slices * span, "{what}");
                    assert!(2 * tiles <= g && slices * tiles <= g, "{what}");
                    assert!((slices * m * n) as u64 <= matmul_split_floats(g), "{what}");
                }
            }
        }
    }
    assert!(splits > 0, "no shape split");
}

/// A linear layer of `m` tokens `[n, k]` in `dtype` (x from element `x_off`, the weight in chunks
/// of `chunk_rows` rows, a rank-`rank` LoRA expand, accumulating for odd ranks) vs the reference.
fn check_linear(
    ctx: &GpuContext,
    (m, n, k): (usize, usize, usize),
    dtype: Dtype,
    (x_off, chunk_rows, rank): (usize, usize, usize),
    seed: u64,
) {
    let seed = seed + dtype.row_bytes(1) as u64;
    let (bytes, w) = weight_bytes(&rand(n * k, seed, 1.0), dtype);
    let gw =
        GpuWeight::upload(ctx, "w", dtype, n, k, &bytes, (chunk_rows * dtype.row_bytes(k)) as u64).expect("weight");
    check_linear_with(ctx, (m, n, k), (&gw, &w), (x_off, rank), seed);
}

/// [`check_linear`] for the weight `gw` holding the values `w`.
fn check_linear_with(
    ctx: &GpuContext,
    (m, n, k): (usize, usize, usize),
    (gw, w): (&GpuWeight, &[f32]),
    (x_off, rank): (usize, usize),
    seed: u64,
) {
    let dtype = gw.dtype;
    let x = rand(x_off + m * k, seed + 1, 1.0);
    // t's columns start after 2 unused ones, or 4 for ranks that are a multiple of 4 (so the
    // expand takes its 16-byte path: each token's t row aligned).
    let t0 = if rank % 4 == 0 { 4 } else { 2 };
    let stride = rank + t0;
    let mut t = rand(m * stride, seed + 3, 1.0);
    // A scale table after t in the same buffer: none, one row for every token, or one per token.
    let table = match seed / 7 % 3 {
        0 => None,
        shared => Some(ScaleTableAt {
            offset: t.len().next_multiple_of(4),
            stride: if shared == 1 { 0 } else { stride.next_multiple_of(4) },
        }),
    };
    let factors = exact_factors(m * stride.next_multiple_of(4), seed + 6);
    if let Some(at) = table {
        t.resize(at.offset, 0.0);
        t.extend_from_slice(&factors);
    }
    let factor = |i: usize, c: usize| table.map_or(1.0, |at| factors[i * at.stride + c]);
    let b = rand(n * rank.max(1), seed + 4, 1.0);
    let y0 = rand(m * (n + 1), seed + 2, 1.0);
    let (xb, yb, tb, bb) = (upload(ctx, &x), upload(ctx, &y0), upload(ctx, &t), upload(ctx, &b));
    let bg = ctx.weights_bind_group(&bb, "b");
    let lora = LoraExpand { table, ..LoraExpand::single(&tb, (t0, stride), (rank, 0), -0.5, &bg) };
    let accumulate = rank % 2 == 1;
    let io = LinearIo { x: &xb, x_offset: x_off, m, y: &yb, y_offset: 1, y_stride: n + 1, accumulate };
    run(ctx, |rec| linear(rec, gw, &io, (rank > 0).then_some(&lora)));
    let prod = cpu::linear(&x[x_off..], w, m, n, k);
    let mut want = y0.clone();
    for i in 0..m {
        for j in 0..n {
            let d: f32 = (0..rank).map(|r| t[i * stride + t0 + r] * factor(i, t0 + r) * b[j * rank + r]).sum();
            let v = prod[i * n + j] - 0.5 * d;
            let slot = &mut want[1 + i * (n + 1) + j];
            *slot = if accumulate { *slot + v } else { v };
        }
    }
    let what = format!(
        "linear m{m} n{n} k{k} {dtype:?} x_offset {x_off} rank {rank} acc={accumulate} chunks={} table {table:?}",
        gw.chunks.len()
    );
    assert_close(&what, &read(ctx, &yb, m * (n + 1)), &want, KERNEL_ATOL, KERNEL_RTOL);
}

/// Random affine weights `[rows, cols]` in `a` and the values they stand
/// for, `scale · q + bias` with the 16-bit scale and bias widened (one f32 fma), codes packed low
/// bits first as `mx.quantize` documents. Scales of both signs, as MLX's quantizer writes them.
fn affine_weights(a: Affine, rows: usize, cols: usize, seed: u64) -> (AffineData, Vec<f32>) {
    let per = 32 / a.bits as usize;
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let words: Vec<u32> = (0..rows * cols / per)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 16) as u32
        })
        .collect();
    let groups = rows * cols / a.group as usize;
    let half = |v: f32| match a.scales {
        HalfType::BF16 => half::bf16::from_f32(v).to_bits(),
        HalfType::F16 => half::f16::from_f32(v).to_bits(),
    };
    let scales: Vec<u16> = rand(groups, seed + 1, 0.1).into_iter().map(half).collect();
    let biases: Vec<u16> = rand(groups, seed + 2, 0.5).into_iter().map(half).collect();
    let mask = (1u32 << a.bits) - 1;
    let values = (0..rows * cols)
        .map(|e| {
            let q = (words[e / per] >> ((e % per) as u32 * a.bits)) & mask;
            let g = e / a.group as usize;
            a.scales.to_f32(scales[g]).mul_add(q as f32, a.scales.to_f32(biases[g]))
        })
        .collect();
    (AffineData { format: a, words, scales, biases }, values)
}

#[test]
fn a_split_shrink_outside_what_the_matvec_takes_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let (n, k) = (4, 8);
    let (bytes, _) = weight_bytes(&rand(n * k, 31, 1.0), Dtype::F32);
    let gw = GpuWeight::upload(&ctx, "w", Dtype::F32, n, k, &bytes, u64::MAX).expect("w");
    let (xb, yb, tb, bb) =
        (upload(&ctx, &[0.5; 64]), upload(&ctx, &[0.0; 8]), upload(&ctx, &[0.0; 8]), upload(&ctx, &[0.0; 32]));
    let bg = ctx.weights_bind_group(&bb, "b");
    // (tokens, rank, parts, first element): 9 tokens (the tiled matmul), a rank above the
    // matvec's, unaligned parts, no parts, parts past the end of x (64 floats).
    for (m, rank, count, at) in [(9, 4, 2, 8), (1, 260, 2, 8), (1, 4, 2, 9), (1, 4, 0, 8), (1, 4, 20, 8)] {
        let parts = Some(SplitShrink { count, at });
        let lora = LoraExpand { parts, ..LoraExpand::single(&tb, (0, rank), (4, 0), 1.0, &bg) };
        let io = LinearIo { x: &xb, x_offset: 0, m, y: &yb, y_offset: 0, y_stride: n, accumulate: false };
        let mut cache = bind_cache(&ctx, 4096);
        let mut rec = Recorder::new(&ctx, &mut cache);
        let err = linear(&mut rec, &gw, &io, Some(&lora)).expect_err("refused");
        assert!(
            matches!(&err, GpuError::Validation { message, .. } if message.contains("split shrink")),
            "m {m} rank {rank} parts {count} at {at}: {err}"
        );
    }
}

/// SwiGLU over several tokens runs only where the batched matvec does (x 16-byte aligned, K a
/// multiple of 8, 16/32-bit weights; at most 8 tokens), and its LoRA takes the gate and up
/// segments of n rows each: anything else is refused while recording.
#[test]
fn a_multi_token_swiglu_outside_the_batched_matvec_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let (n, k) = (4, 8);
    let (bytes, _) = weight_bytes(&rand(2 * n * k, 37, 1.0), Dtype::F32);
    let gw = GpuWeight::upload(&ctx, "w", Dtype::F32, 2 * n, k, &bytes, u64::MAX).expect("w");
    let (xb, yb, tb, bb) =
        (upload(&ctx, &[0.5; 128]), upload(&ctx, &[0.0; 64]), upload(&ctx, &[0.0; 64]), upload(&ctx, &[0.0; 64]));
    let bg = ctx.weights_bind_group(&bb, "b");
    let seg = |rows| LoraSegment { rows, rank: 2, t_offset: 0, b_offset: 0, scale: 1.0 };
    // (tokens, x offset, segments, what the message names)
    let cases = [
        (2, 1, None, "SwiGLU needs one token or the batched matvec"),
        (9, 0, None, "SwiGLU needs one token or the batched matvec"),
        (2, 0, Some(vec![seg(2 * n)]), "two LoRA segments"),
        (3, 0, Some(vec![seg(n), seg(n + 1)]), "two LoRA segments"),
    ];
    for (m, x_offset, segments, named) in cases {
        let lora =
            segments.map(|segments| LoraExpand { segments, ..LoraExpand::single(&tb, (0, 4), (2, 0), 1.0, &bg) });
        let io = LinearIo { x: &xb, x_offset, m, y: &yb, y_offset: 0, y_stride: n, accumulate: false };
        let mut cache = bind_cache(&ctx, 4096);
        let mut rec = Recorder::new(&ctx, &mut cache);
        let fuse = Fuse { glu: true, ..Fuse::NONE };
        let err = linear_rows(&mut rec, WeightRows::all(&gw), &io, lora.as_ref(), fuse).expect_err("refused");
        assert!(
            matches!(&err, GpuError::Validation { message, .. } if message.contains(named)),
            "m {m} x offset {x_offset}: {err}"
        );
    }
}

/// A parts buffer too small for the splits of a long cache is refused while recording (the
/// kernel would write past it), and one that holds them is taken.
#[test]
fn a_parts_buffer_too_small_for_the_splits_is_a_typed_error() {
    let Some(ctx) = ctx() else { return };
    let (hq, hd) = (2u32, 8u32);
    let params = AttnParams { t: 1, pos0: 1000, hq, hkv: 1, hd, s_max: 1024, ..Default::default() };
    let (splits, _) = attention_splits(params.pos0);
    assert!(splits > 1, "the case needs several splits");
    let need = (hq * splits * (hd + 2)) as usize;
    let qkn = GpuVector::upload(&ctx, "qk", &[0.0; 16]).expect("qk");
    let any = upload(&ctx, &[0.0; 64]);
    // Four floats short (uploads round sizes up to 16 bytes), then exactly enough.
    for (floats, ok) in [(need - 4, false), (need, true)] {
        let part = upload(&ctx, &vec![0.0; floats]);
        let io = AttnOneIo { qkv: &any, k_cache: &any, v_cache: &any, rope: &any, out: &any, part: &part };
        let mut cache = bind_cache(&ctx, 4096);
        let mut rec = Recorder::new(&ctx, &mut cache);
        let got = attention_one(&mut rec, &qkn, &params, &io, None);
        match got {
            Err(GpuError::Validation { message, .. }) => assert!(!ok && message.contains("parts buffer"), "{message}"),
            Err(e) => panic!("{floats} floats: {e}"),
            Ok(()) => assert!(ok, "{floats} floats accepted, {need} needed"),
        }
    }
}

#[test]
fn affine_linear_layers_match_reference() {
    let Some(ctx) = ctx() else { return };
    affine_sweep(&ctx);
}

/// Affine weights of every format through the matvec, the batched matvec and the matmul.
fn affine_sweep(ctx: &GpuContext) {
    let formats = [
        (4, 32, HalfType::BF16),
        (4, 64, HalfType::F16),
        (4, 128, HalfType::BF16),
        (8, 32, HalfType::F16),
        (8, 64, HalfType::BF16),
        (8, 128, HalfType::BF16),
    ];
    // (m, n, k): one token (matvec, rows below and above one workgroup), a short prompt and a
    // long one (tiled matmul); (x offset, rows per chunk, LoRA rank): the 16-byte paths, an
    // unaligned x (element-wise), a weight split across bindings, a fused expand; the last
    // shape takes 128 x 128 tiles on any device (aligned, with a fused expand only).
    // (20, 37, 1024) is one tile over a reduction long enough to split on any device.
    let shapes = [(1, 37, 128), (1, 300, 256), (3, 37, 128), (20, 70, 384), (20, 37, 1024), (1100, 1800, 128)];
    for (fi, &(bits, group, scales)) in formats.iter().enumerate() {
        let a = Affine { bits, group, scales };
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            let configs = if m > 128 { &[(4, n, 4)][..] } else { &[(4, n, 0), (1, n, 3), (4, 16, 4)] };
            for &(x_off, chunk_rows, rank) in configs {
                let seed = 900 + fi as u64 * 37 + si as u64 * 5 + rank as u64;
                let (data, w) = affine_weights(a, n, k, seed);
                let chunk = (chunk_rows * a.row_bytes(k)) as u64;
                let gw = GpuWeight::upload_affine(ctx, "q", n, k, &data, chunk).expect("weight");
                assert_eq!(gw.chunks.len(), n.div_ceil(chunk_rows.min(n)), "chunks");
                check_linear_with(ctx, (m, n, k), (&gw, &w), (x_off, rank), seed);
            }
        }
    }
}

/// The embedding gather of a few ids (repeated, first and last rows) from `gw`, a table split
/// across bindings holding `table`, is exactly those rows.
fn check_embed(ctx: &GpuContext, gw: &GpuWeight, table: &[f32], what: &str) {
    let h = gw.cols;
    assert!(gw.chunks.len() > 1, "{what}: a split table");
    let ids: Vec<u32> = vec![0, 36, 5, 5, 17, 10];
    let idb = ctx.upload("ids", bytemuck::cast_slice(&ids)).expect("ids");
    let hb = upload(ctx, &vec![0.0; ids.len() * h]);
    run(ctx, |rec| embed(rec, gw, &idb, ids.len(), &hb));
    let want: Vec<f32> = ids.iter().flat_map(|&i| table[i as usize * h..(i as usize + 1) * h].to_vec()).collect();
    assert_eq!(read(ctx, &hb, ids.len() * h), want, "{what}");
}

#[test]
fn affine_embedding_gathers_the_dequantized_rows() {
    let Some(ctx) = ctx() else { return };
    for (bits, group, scales) in [(4, 64, HalfType::BF16), (8, 32, HalfType::F16)] {
        let a = Affine { bits, group, scales };
        let (v, h) = (37, 128);
        let (data, table) = affine_weights(a, v, h, 77 + bits as u64);
        for rows in [5, 10, 19] {
            let gw =
                GpuWeight::upload_affine(&ctx, "embed", v, h, &data, (rows * a.row_bytes(h)) as u64).expect("table");
            check_embed(&ctx, &gw, &table, &format!("embed {a:?} in chunks of {rows}: the decoder's fma, exactly"));
        }
    }
}

#[test]
fn affine_uploads_check_their_lengths() {
    let Some(ctx) = ctx() else { return };
    let a = Affine { bits: 4, group: 64, scales: HalfType::BF16 };
    let (data, _) = affine_weights(a, 4, 128, 1);
    let mut short = data.clone();
    short.words.pop();
    let e = GpuWeight::upload_affine(&ctx, "q", 4, 128, &short, u64::MAX).err().expect("short codes");
    assert!(
        matches!(&e, GpuError::WeightSize { what, expected: 64, found: 63, .. } if what.starts_with("codes")),
        "{e}"
    );
    let mut short = data;
    short.biases.pop();
    let e = GpuWeight::upload_affine(&ctx, "q", 4, 128, &short, u64::MAX).err().expect("short biases");
    assert!(matches!(&e, GpuError::WeightSize { what: "biases", expected: 8, found: 7, .. }), "{e}");
    // Rows times row bytes past usize: an error, not an overflow.
    let e = GpuWeight::upload(&ctx, "w", Dtype::BF16, usize::MAX / 2, 1024, &[0; 2048], u64::MAX).err().expect("rows");
    assert!(matches!(&e, GpuError::WeightShape { rows, cols: 1024, .. } if *rows == usize::MAX / 2), "{e}");
    let e = GpuWeight::upload(&ctx, "w", Dtype::F32, 1, usize::MAX / 2, &[0; 16], u64::MAX).err().expect("cols");
    assert!(matches!(&e, GpuError::WeightShape { rows: 1, .. }), "{e}");
    let (data, _) = affine_weights(a, 4, 128, 1);
    for (bits, group) in [(3, 64), (4, 0), (8, 48)] {
        let bad = AffineData { format: Affine { bits, group, ..a }, ..data.clone() };
        let e = GpuWeight::upload_affine(&ctx, "q", 4, 128, &bad, u64::MAX).err().expect("format");
        assert!(matches!(&e, GpuError::AffineFormat { bits: b, group: g, .. } if (*b, *g) == (bits, group)), "{e}");
    }
    let e = GpuWeight::upload_affine(&ctx, "q", usize::MAX / 2, 128, &data, u64::MAX).err().expect("rows");
    assert!(matches!(&e, GpuError::WeightShape { .. }), "{e}");
    // Widths and groups the kernels do not decode: no quantization (it divided by zero).
    let bytes = vec![0u8; 2 * 128];
    for (bits, group) in [(0, 64), (3, 64), (4, 0), (8, 48), (4, 256)] {
        assert!(quantize_bytes(&bytes, Dtype::BF16, 128, bits, group).is_none(), "{bits} bits, group {group}");
    }
    assert!(quantize_bytes(&bytes, Dtype::BF16, 96, 4, 64).is_none(), "96 columns in groups of 64");
    assert!(quantize_bytes(&bytes, Dtype::BF16, 128, 4, 64).is_some());
}

#[test]
fn batched_matvec_sweep_matches_reference() {
    let Some(ctx) = ctx() else { return };
    // 2 to 8 tokens (every TOK variant, and counts between them); n below, at and above the rows
    // per workgroup of every LANES variant; k multiples of 8 (others run the tiled matmul, as does
    // an x offset that is not 16-byte aligned: x offset 1 checks that fallback).
    let g = ctx.min_workgroups();
    let shapes = [
        (2, 1, 8),
        (3, 15, 16),
        (4, 17, 24),
        (5, 33, 1024),
        (7, 8 * g - 3, 40),
        (8, 16 * g + 1, 64),
        (6, 32 * g - 5, 1032),
        (2, 64 * g + 1, 8),
    ];
    let lanes: std::collections::BTreeSet<u32> = shapes.iter().map(|&(_, n, _)| matvec_lanes(n, g)).collect();
    assert_eq!(lanes.into_iter().collect::<Vec<_>>(), MATVEC_LANES.to_vec(), "LANES variants covered");
    let toks: std::collections::BTreeSet<u32> = shapes.iter().map(|&(m, _, _)| batch_tokens(m)).collect();
    assert_eq!(toks.into_iter().collect::<Vec<_>>(), MATVEC_BATCH_TOKENS.to_vec(), "TOK variants covered");
    for (si, &(m, n, k)) in shapes.iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            for (x_off, chunk_rows, rank) in [(4, n, 0), (4, n, 3), (4, 5, 4), (0, n, 16), (1, n, 2)] {
                check_linear(&ctx, (m, n, k), dtype, (x_off, chunk_rows, rank), 1700 + si as u64 * 17);
            }
        }
    }
}

/// A shrink output t of `m` rows of `stride` columns, with (when `table`) a scale table of one
/// row per token after it in the same buffer: t's values, where the table is, and the factor of
/// (token, column) (1 without the table).
fn t_rows(m: usize, stride: usize, table: bool, seed: u64) -> (Vec<f32>, ScaleTableAt, impl Fn(usize, usize) -> f32) {
    let mut t = rand(m * stride, seed, 1.0);
    let at = ScaleTableAt { offset: t.len().next_multiple_of(4), stride: stride.next_multiple_of(4) };
    let factors = exact_factors(m * at.stride, seed + 1);
    if table {
        t.resize(at.offset, 0.0);
        t.extend_from_slice(&factors);
    }
    (t, at, move |i: usize, c: usize| if table { factors[i * at.stride + c] } else { 1.0 })
}

/// The batched matvec over rows of several projections (a batched step's concatenated q|k|v or
/// GDN inputs in one dispatch): up to 4 LoRA segments with their own ranks (one of them 0), t
/// columns, B blocks and scales, as tiny as one row so that an invocation's 8 rows straddle up to
/// four of them, from an odd row of the weight split across bindings (each chunk's rows numbered
/// on from the view's), with and without a per-token scale table, with and without the block's
/// RMSNorm1p fused (then also without LoRA, as a batched step's shrink runs); every TOK, LANES and
/// dtype. The tiled matmul still takes one segment (a typed error).
#[test]
fn batched_matvec_takes_several_lora_segments() {
    let Some(ctx) = ctx() else { return };
    let g = ctx.min_workgroups();
    // (tokens, rows n, k, segment rows (the last takes the rest)); k 1032 and 520 give every lane
    // several steps along K (the fused norm's sums of squares and weight carried across them).
    let shapes: [(usize, usize, usize, &[usize]); 5] = [
        (2, 12, 8, &[1, 2, 5]),
        (3, 8 * g + 3, 1032, &[3, 4 * g, 2]),
        (5, 16 * g + 1, 24, &[16 * g - 7, 1, 1]),
        (8, 32 * g - 5, 520, &[9 * g, 2 * g + 1, 16]),
        (4, 64 * g + 1, 8, &[48 * g, 16]),
    ];
    let lanes: std::collections::BTreeSet<u32> = shapes.iter().map(|&(_, n, _, _)| matvec_lanes(n, g)).collect();
    assert_eq!(lanes.into_iter().collect::<Vec<_>>(), MATVEC_LANES.to_vec(), "LANES variants covered");
    let toks: std::collections::BTreeSet<u32> = shapes.iter().map(|&(m, _, _, _)| batch_tokens(m)).collect();
    assert_eq!(toks.into_iter().collect::<Vec<_>>(), MATVEC_BATCH_TOKENS.to_vec(), "TOK variants covered");
    for (si, &(m, n, k, rows)) in shapes.iter().enumerate() {
        for (di, dtype) in [Dtype::F32, Dtype::BF16, Dtype::F16].into_iter().enumerate() {
            let seed = 2600 + si as u64 * 29 + di as u64 * 5;
            let table = (si + di) % 2 == 1;
            let norm = (si + di) % 3 != 1;
            let view0 = 3;
            let total = view0 + n + 2;
            let (bytes, w) = weight_bytes(&rand(total * k, seed, 1.0), dtype);
            // Chunks of 7 rows where the weight has few rows (boundaries inside segments), else one.
            let chunk = (if total < 64 { 7 } else { total } * dtype.row_bytes(k)) as u64;
            let gw = GpuWeight::upload(&ctx, "w", dtype, total, k, &bytes, chunk).expect("weight");
            // Segments: (rank, rows), the second one without an adapter.
            let mut seg_rows: Vec<usize> = rows.to_vec();
            seg_rows.push(n - rows.iter().sum::<usize>());
            let ranks = [3, 0, 16, 5];
            let segs: Vec<(usize, usize)> = seg_rows.iter().enumerate().map(|(j, &r)| (ranks[j], r)).collect();
            let scales = [0.5, 9.0, -0.25, 1.5];
            // t: [m, stride], segment j's columns after two unused ones and those of the segments before.
            let t_offs: Vec<usize> =
                segs.iter().scan(2, |acc, &(r, _)| Some(std::mem::replace(acc, *acc + r))).collect();
            let stride = 2 + segs.iter().map(|s| s.0).sum::<usize>() + 1;
            let (t, at, factor) = t_rows(m, stride, table, seed + 1);
            let (b, b_offs) = segment_b(&segs, seed + 3);
            let x = rand(4 + m * k, seed + 4, 1.0);
            let norm_w = rand(k, seed + 5, 0.5);
            // Without the norm, t as a split shrink: each token's columns as three parts after x
            // in x's buffer (token i's after token i - 1's), summing to its row of t, instead of
            // in t's buffer (which keeps the table).
            let mut xs = x.clone();
            let parts = (!norm).then(|| {
                let (at, pad) = ((4 + m * k).next_multiple_of(4), stride.next_multiple_of(4));
                xs.resize(at + 3 * m * pad, 0.0);
                for i in 0..m {
                    let (p0, p1) = (rand(stride, seed + 6 + i as u64, 1.0), rand(stride, seed + 16 + i as u64, 1.0));
                    let first = at + 3 * i * pad;
                    for c in 0..stride {
                        xs[first + c] = p0[c];
                        xs[first + pad + c] = p1[c];
                        xs[first + 2 * pad + c] = t[i * stride + c] - p0[c] - p1[c];
                    }
                }
                SplitShrink { count: 3, at }
            });
            // t's own rows zeroed where the parts stand in for them (the table stays).
            let mut t_buf = t.clone();
            if parts.is_some() {
                t_buf[..m * stride].fill(0.0);
            }
            let (xb, yb, tb, bb) =
                (upload(&ctx, &xs), upload(&ctx, &vec![7.0; m * n + 1]), upload(&ctx, &t_buf), upload(&ctx, &b));
            let (bg, nb) = (ctx.weights_bind_group(&bb, "b"), upload(&ctx, &norm_w));
            let fuse =
                Fuse { norm: norm.then_some(FusedNorm { weight: &nb, eps: 1e-6, prenormed: None }), ..Fuse::NONE };
            let xin = if norm { cpu::rms_norm(&x[4..], &norm_w, k, 1e-6) } else { x[4..].to_vec() };
            let base = cpu::linear(&xin, &w[view0 * k..(view0 + n) * k], m, n, k);
            let segments: Vec<LoraSegment> = segs
                .iter()
                .enumerate()
                .map(|(j, &(rank, rows))| LoraSegment {
                    rows,
                    rank,
                    t_offset: t_offs[j],
                    b_offset: b_offs[j],
                    scale: scales[j],
                })
                .collect();
            let lora = LoraExpand {
                segments,
                table: table.then_some(at),
                parts,
                ..LoraExpand::single(&tb, (0, stride), (0, 0), 1.0, &bg)
            };
            let io = LinearIo { x: &xb, x_offset: 4, m, y: &yb, y_offset: 1, y_stride: n, accumulate: false };
            let view = || WeightRows { w: &gw, rows: view0..view0 + n };
            let what = format!(
                "batched matvec m{m} n{n} k{k} {dtype:?} segments {segs:?} chunks {} table {table} norm {norm} split {}",
                gw.chunks.len(),
                parts.is_some()
            );
            if norm {
                run(&ctx, |rec| linear_rows(rec, view(), &io, None, fuse));
                let want: Vec<f32> = std::iter::once(7.0).chain(base.iter().copied()).collect();
                let what = format!("{what}, no LoRA");
                assert_close(&what, &read(&ctx, &yb, m * n + 1), &want, KERNEL_ATOL, KERNEL_RTOL);
            }
            run(&ctx, |rec| linear_rows(rec, view(), &io, Some(&lora), fuse));
            let mut want = vec![7.0];
            want.extend(base);
            for i in 0..m {
                let mut start = 0;
                for (j, &(rank, seg_n)) in segs.iter().enumerate() {
                    for r in 0..seg_n {
                        let d: f32 = (0..rank)
                            .map(|c| {
                                let col = t_offs[j] + c;
                                t[i * stride + col] * factor(i, col) * b[b_offs[j] + r * rank + c]
                            })
                            .sum();
                        want[1 + i * n + start + r] += scales[j] * d;
                    }
                    start += seg_n;
                }
            }
            assert_close(&what, &read(&ctx, &yb, m * n + 1), &want, KERNEL_ATOL, KERNEL_RTOL);
            if si == 0 && di == 0 {
                let io = LinearIo { m: 9, ..io };
                let mut cache = bind_cache(&ctx, 1 << 16);
                let mut rec = Recorder::new(&ctx, &mut cache);
                let err =
                    linear_rows(&mut rec, view(), &io, Some(&lora), Fuse::NONE).expect_err("9 tokens, 4 segments");
                assert!(err.to_string().contains("one LoRA segment"), "{err}");
                let err = linear_rows(&mut rec, view(), &io, None, fuse).expect_err("9 tokens, a fused norm");
                assert!(err.to_string().contains("a fused norm needs one token or the batched matvec"), "{err}");
            }
            if let Some(p) = parts {
                // A split shrink the batched matvec does not take: with a fused norm, or more
                // tokens times rank than it stages; parts past x (9 tokens: the matvec's test).
                let mut cache = bind_cache(&ctx, 1 << 16);
                let mut rec = Recorder::new(&ctx, &mut cache);
                let normed = Fuse { norm: Some(FusedNorm { weight: &nb, eps: 1e-6, prenormed: None }), ..Fuse::NONE };
                let wide = LoraExpand { t_stride: BATCH_SPLIT_SHRINK_FLOATS / m + 1, ..lora.clone() };
                let past = LoraExpand { parts: Some(SplitShrink { count: 4, ..p }), ..lora.clone() };
                for (case, l, io, fuse) in [
                    ("a fused norm", &lora, &io, normed),
                    ("rank past TSUM", &wide, &io, Fuse::NONE),
                    ("parts past x", &past, &io, Fuse::NONE),
                ] {
                    let err = linear_rows(&mut rec, view(), io, Some(l), fuse).expect_err(case);
                    assert!(err.to_string().contains("split shrink"), "{what}: {case}: {err}");
                }
            }
        }
    }
}

/// A batched split shrink at the most the batched matvec stages: 8 tokens of rank
/// `BATCH_SPLIT_SHRINK_FLOATS / 8` (the WGSL array `TSUM` is that size), each token's t in five
/// parts (a mixer's heads) and a scale table of one row per token; one column more is refused.
#[test]
fn a_batched_split_shrink_stages_up_to_its_limit() {
    let Some(ctx) = ctx() else { return };
    let src = include_str!("../wgsl/matvec_batch.wgsl");
    let tsum = format!("const TSUM: u32 = {BATCH_SPLIT_SHRINK_FLOATS}u;");
    assert!(src.contains(&tsum), "matvec_batch.wgsl stages {BATCH_SPLIT_SHRINK_FLOATS} floats");
    let (m, n, k, heads) = (8, 10, 16, 5);
    let rank = BATCH_SPLIT_SHRINK_FLOATS / m;
    let (bytes, w) = weight_bytes(&rand(n * k, 71, 1.0), Dtype::BF16);
    let gw = GpuWeight::upload(&ctx, "w", Dtype::BF16, n, k, &bytes, u64::MAX).expect("w");
    let (t, at, factor) = t_rows(m, rank, true, 72);
    let (b, _) = segment_b(&[(rank, n)], 73);
    let x = rand(m * k, 74, 1.0);
    let pad = rank.next_multiple_of(4);
    let mut xs = x.clone();
    let parts_at = xs.len();
    xs.resize(parts_at + m * heads * pad, 0.0);
    for i in 0..m {
        for c in 0..rank {
            // Parts summing to t: a fifth of t each, the last one the remainder.
            let first = parts_at + i * heads * pad + c;
            let fifth = t[i * rank + c] / heads as f32;
            for h in 0..heads - 1 {
                xs[first + h * pad] = fifth;
            }
            xs[first + (heads - 1) * pad] = t[i * rank + c] - fifth * (heads - 1) as f32;
        }
    }
    let mut t_buf = t.clone();
    t_buf[..m * rank].fill(0.0);
    let (xb, yb, tb, bb) = (upload(&ctx, &xs), upload(&ctx, &vec![0.0; m * n]), upload(&ctx, &t_buf), upload(&ctx, &b));
    let bg = ctx.weights_bind_group(&bb, "b");
    let scale = 0.75;
    let lora = LoraExpand {
        segments: vec![LoraSegment { rows: n, rank, t_offset: 0, b_offset: 0, scale }],
        table: Some(at),
        parts: Some(SplitShrink { count: heads, at: parts_at }),
        ..LoraExpand::single(&tb, (0, rank), (0, 0), 1.0, &bg)
    };
    let io = LinearIo { x: &xb, x_offset: 0, m, y: &yb, y_offset: 0, y_stride: n, accumulate: false };
    run(&ctx, |rec| linear(rec, &gw, &io, Some(&lora)));
    let mut want = cpu::linear(&x, &w, m, n, k);
    for i in 0..m {
        for r in 0..n {
            let d: f32 = (0..rank).map(|c| t[i * rank + c] * factor(i, c) * b[r * rank + c]).sum();
            want[i * n + r] += scale * d;
        }
    }
    assert_close("split shrink at the staging limit", &read(&ctx, &yb, m * n), &want, KERNEL_ATOL, KERNEL_RTOL);
    let wide = LoraExpand { t_stride: rank + 1, ..lora.clone() };
    let mut cache = bind_cache(&ctx, 4096);
    let mut rec = Recorder::new(&ctx, &mut cache);
    let err = linear(&mut rec, &gw, &io, Some(&wide)).expect_err("one column past the staging");
    assert!(err.to_string().contains("split shrink"), "{err}");
}

/// SwiGLU in the batched matvec (2 to 8 tokens over a `[gate; up]` weight of 2n rows): every
/// `TOK` and `LANES` variant, every dtype, n below and above a workgroup's outputs, without LoRA and
/// with the gate and up segments' own ranks, t columns, B rows and scales (one of them rank 0),
/// with and without a per-token scale table, with and without the block's RMSNorm1p fused.
#[test]
fn batched_swiglu_sweep_matches_reference() {
    let Some(ctx) = ctx() else { return };
    let g = ctx.min_workgroups();
    // (tokens, outputs n, k): k 1032 gives every lane several steps along K.
    let shapes =
        [(2, 1, 8), (3, 13, 1032), (5, 4 * g - 3, 24), (8, 8 * g + 1, 40), (6, 16 * g - 5, 64), (4, 32 * g + 3, 8)];
    let lanes: std::collections::BTreeSet<u32> = shapes.iter().map(|&(_, n, _)| matvec_lanes(2 * n, g)).collect();
    assert_eq!(lanes.into_iter().collect::<Vec<_>>(), MATVEC_LANES.to_vec(), "LANES variants covered");
    let toks: std::collections::BTreeSet<u32> = shapes.iter().map(|&(m, _, _)| batch_tokens(m)).collect();
    assert_eq!(toks.into_iter().collect::<Vec<_>>(), MATVEC_BATCH_TOKENS.to_vec(), "TOK variants covered");
    for (si, &(m, n, k)) in shapes.iter().enumerate() {
        // Each dtype on two shapes (every pipeline variant compiles on the adapter: keep it short).
        for dtype in [[Dtype::F32, Dtype::BF16, Dtype::F16][si % 3]] {
            // (gate rank, up rank, scale table)
            for (ci, &(rg, ru, table)) in [(0, 0, false), (3, 5, false), (4, 0, true), (0, 8, true)].iter().enumerate()
            {
                let seed = 2100 + si as u64 * 31 + ci as u64 * 7 + dtype.row_bytes(1) as u64;
                let (bytes, w) = weight_bytes(&rand(2 * n * k, seed, 1.0), dtype);
                let gw = GpuWeight::upload(&ctx, "w", dtype, 2 * n, k, &bytes, u64::MAX).expect("weight");
                let x = rand(4 + m * k, seed + 1, 1.0);
                // The fused norm on two cases of each shape: with and without LoRA on half of them.
                let norm = (si / 2 + ci) % 2 == 0;
                let norm_w = rand(k, seed + 5, 0.5);
                // t: [m, stride] with the gate's columns from 1 and the up's after them.
                let stride = 1 + rg + ru + 2;
                let (t, at, factor) = t_rows(m, stride, table, seed + 2);
                // B: the gate's [n, rg] after 2 unused elements, the up's [n, ru] after it.
                let b = rand(2 + n * (rg + ru), seed + 4, 1.0);
                let (xb, yb, tb, bb) =
                    (upload(&ctx, &x), upload(&ctx, &vec![7.0; m * n + 3]), upload(&ctx, &t), upload(&ctx, &b));
                let (bg, nb) = (ctx.weights_bind_group(&bb, "b"), upload(&ctx, &norm_w));
                let segments = vec![
                    LoraSegment { rows: n, rank: rg, t_offset: 1, b_offset: 2, scale: 0.5 },
                    LoraSegment { rows: n, rank: ru, t_offset: 1 + rg, b_offset: 2 + n * rg, scale: -1.5 },
                ];
                let lora = LoraExpand {
                    segments: segments.clone(),
                    table: table.then_some(at),
                    ..LoraExpand::single(&tb, (0, stride), (0, 0), 1.0, &bg)
                };
                let io = LinearIo { x: &xb, x_offset: 4, m, y: &yb, y_offset: 3, y_stride: n, accumulate: false };
                let fused_norm = norm.then_some(FusedNorm { weight: &nb, eps: 1e-6, prenormed: None });
                let fuse = Fuse { glu: true, norm: fused_norm, ..Fuse::NONE };
                let adapted = rg + ru > 0;
                run(&ctx, |rec| linear_rows(rec, WeightRows::all(&gw), &io, adapted.then_some(&lora), fuse));
                let xin = if norm { cpu::rms_norm(&x[4..], &norm_w, k, 1e-6) } else { x[4..].to_vec() };
                let mut vals = cpu::linear(&xin, &w, m, 2 * n, k);
                for i in 0..m {
                    for r in 0..2 * n {
                        let s = &segments[r / n];
                        let d: f32 = (0..s.rank)
                            .map(|c| {
                                let col = s.t_offset + c;
                                t[i * stride + col] * factor(i, col) * b[s.b_offset + (r % n) * s.rank + c]
                            })
                            .sum();
                        vals[i * 2 * n + r] += s.scale * d;
                    }
                }
                let mut want = vec![7.0; 3];
                for i in 0..m {
                    want.extend((0..n).map(|o| cpu::silu(vals[i * 2 * n + o]) * vals[i * 2 * n + n + o]));
                }
                let what = format!("batched SwiGLU m{m} n{n} k{k} {dtype:?} ranks {rg}/{ru} table {table} norm {norm}");
                assert_close(&what, &read(&ctx, &yb, m * n + 3), &want, KERNEL_ATOL, KERNEL_RTOL);
            }
        }
    }
}

#[test]
fn gpu_argmax_matches_the_cpu_rule() {
    let Some(ctx) = ctx() else { return };
    let nan = f32::NAN;
    let mut cases: Vec<Vec<f32>> = vec![
        vec![0.5],
        vec![nan],
        vec![nan, nan, nan],
        vec![nan, 1.0, nan],
        vec![1.0, nan, 2.0],
        vec![f32::NEG_INFINITY; 5],
        vec![0.0, -0.0, 0.0],
        vec![3.0, 3.0, -1.0, 3.0],
        vec![1.0, f32::INFINITY, 2.0],
        vec![1.0, 2.0, f32::NEG_INFINITY],
        vec![f32::MAX, -f32::MAX, 0.0],
    ];
    for (i, n) in [255usize, 4096, 4097, 10_000, 248_320].into_iter().enumerate() {
        let mut v = rand(n, 900 + i as u64, 4.0);
        // Ties across blocks, a NaN before them and one at the end.
        let hi = 7.5;
        for &j in &[n / 3, n / 2, n - 1] {
            v[j] = hi;
        }
        v[n / 5] = nan;
        v[n - 1] = nan;
        cases.push(v);
        let mut all_nan = vec![nan; n];
        all_nan[n / 2] = -1e30;
        cases.push(all_nan);
        cases.push(vec![nan; n]);
    }
    for (ci, logits) in cases.iter().enumerate() {
        let n = logits.len();
        let lb = upload(&ctx, logits);
        let parts = ctx.storage_buffer("parts", argmax_scratch_bytes(n), true).expect("parts");
        let ids = upload(&ctx, &[0.0; 4]);
        run(&ctx, |rec| argmax(rec, &lb, &parts, &ids, n));
        let got = read(&ctx, &ids, 2);
        assert_eq!(got[0].to_bits(), qwen35_wgpu::runtime::argmax(logits), "case {ci} (n {n})");
        // ids[1]: whether any logit is NaN or infinite (generation refuses such a row).
        let non_finite = logits.iter().any(|l| !l.is_finite());
        assert_eq!(got[1].to_bits(), non_finite as u32, "case {ci} (n {n}): non-finite flag");
    }
    // Several rows in the same two dispatches (a batched step's sessions): the cases of each
    // length as the rows of one buffer, each row choosing on its own.
    for n in [3usize, 4097, 248_320] {
        let rows: Vec<&Vec<f32>> = cases.iter().filter(|c| c.len() == n).collect();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        let lb = upload(&ctx, &flat);
        let parts = ctx.storage_buffer("parts", rows.len() as u64 * argmax_scratch_bytes(n), true).expect("parts");
        let ids = upload(&ctx, &vec![0.0; 2 * rows.len()]);
        run(&ctx, |rec| argmax_rows(rec, &lb, &parts, &ids, (n, rows.len())));
        let got = read(&ctx, &ids, 2 * rows.len());
        assert!(rows.len() >= 3, "rows of length {n}");
        for (r, logits) in rows.iter().enumerate() {
            assert_eq!(got[2 * r].to_bits(), qwen35_wgpu::runtime::argmax(logits), "row {r} of {n}");
            let non_finite = logits.iter().any(|l| !l.is_finite());
            assert_eq!(got[2 * r + 1].to_bits(), non_finite as u32, "row {r} of {n}: non-finite flag");
        }
    }
}

#[test]
fn gpu_top_k_matches_a_sort_in_the_samplers_order() {
    let Some(ctx) = ctx() else { return };
    let nan = f32::NAN;
    for (ci, n) in [7usize, 256, 4097, 70_000, 248_320].into_iter().enumerate() {
        let mut v = rand(n, 950 + ci as u64, 4.0);
        // Ties (across blocks too), both zeros, infinities and NaNs of either sign.
        for &j in &[n / 3, n / 2, n - 1] {
            v[j] = 3.5;
        }
        v[0] = -0.0;
        v[n / 4] = 0.0;
        v[n / 5] = nan;
        v[n / 6] = -nan;
        v[n / 7] = f32::INFINITY;
        v[n - 2] = f32::NEG_INFINITY;
        // History: a few ids, among them the largest logit and one of the ties.
        let mut hist: Vec<u32> = vec![(n / 7) as u32, (n / 2) as u32, 1, (n - 3) as u32];
        hist.sort_unstable();
        hist.dedup();
        let most = topk_max(n).min(n - hist.len());
        for k in [1usize, 9, most].into_iter().filter(|&k| k <= most) {
            for masked in [false, true] {
                let h: &[u32] = if masked { &hist } else { &[] };
                let lb = upload(&ctx, &v);
                let parts = ctx.storage_buffer("parts", topk_scratch_bytes(n), true).expect("parts");
                let out = upload(&ctx, &vec![0.0; 2 * k]);
                let hb = ctx.upload("hist", bytemuck::cast_slice(&hist)).expect("hist");
                let hv = upload(&ctx, &vec![0.0; hist.len()]);
                let io = TopkIo { logits: &lb, parts: &parts, out: &out, hist_ids: &hb, hist_out: &hv };
                let inv_t = [1.0, 1.0 / 0.7, 2.5][k % 3];
                run(&ctx, |rec| topk(rec, &io, n, k, h.len(), inv_t));
                let words: Vec<u32> = read(&ctx, &out, 2 * k).iter().map(|w| w.to_bits()).collect();
                let got: Vec<(u32, u32)> = words.chunks(2).map(|p| (p[1], topk_value(p[0]).to_bits())).collect();
                let mut want: Vec<(u32, f32)> =
                    v.iter().enumerate().map(|(i, &l)| (i as u32, l)).filter(|(i, _)| !h.contains(i)).collect();
                want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let want: Vec<(u32, u32)> = want[..k].iter().map(|&(i, l)| (i, l.to_bits())).collect();
                assert_eq!(got, want, "top-{k} of {n} logits, history masked: {masked}");
                if masked {
                    let values: Vec<u32> = read(&ctx, &hv, h.len()).iter().map(|x| x.to_bits()).collect();
                    let orig: Vec<u32> = h.iter().map(|&i| v[i as usize].to_bits()).collect();
                    assert_eq!(values, orig, "history logits of {n}");
                }
                // Each block's softmax mass over its finite logits outside the history (f64 here).
                let blocks = topk_blocks(n);
                let at = topk_mass_offset(n, k) as usize / 4;
                let got = read(&ctx, &parts, at + 2 * blocks);
                for b in 0..blocks {
                    let block = (b * 4096..((b + 1) * 4096).min(n)).filter(|i| !h.contains(&(*i as u32)));
                    let finite: Vec<f64> = block.map(|i| v[i] as f64).filter(|l| l.is_finite()).collect();
                    let m = finite.iter().copied().fold(f64::MIN, f64::max);
                    let sum: f64 = finite.iter().map(|l| ((l - m) * inv_t as f64).exp()).sum();
                    let (gm, gs) = (got[at + 2 * b] as f64, got[at + 2 * b + 1] as f64);
                    assert_eq!(gm, m, "block {b} of {n} logits: largest");
                    assert!((gs - sum).abs() <= TOPK_MASS_REL * sum, "block {b} of {n} logits: mass {gs} vs {sum}");
                }
            }
        }
    }
}

#[test]
fn input_gradient_sweep_matches_reference_split_or_whole() {
    let Some(ctx) = ctx() else { return };
    let g = ctx.min_workgroups();
    // (m, n, k, chunk rows, rows used): one 64 x 64 tile over a long reduction (split on any
    // device), a rank-16 "B" over 3584 outputs, the rows of a middle range across three chunks,
    // grids at and past lavapipe's minimum (split only on GPUs), a reduction too short to split.
    let shapes = [
        (3, 1000, 64, 1000, 0..1000),
        (7, 3584, 16, 3584, 0..3584),
        (5, 2000, 40, 700, 100..1900),
        (70, 600, 130, 600, 0..600),
        (130, 900, 200, 450, 0..900),
        (2, 120, 8, 120, 0..120),
    ];
    let mut split = Vec::new();
    for (si, (m, n, k, chunk_rows, rows)) in shapes.into_iter().enumerate() {
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let seed = 900 + si as u64 * 31 + dtype.row_bytes(1) as u64;
            let (bytes, w) = weight_bytes(&rand(n * k, seed, 1.0), dtype);
            let gw = GpuWeight::upload(&ctx, "w", dtype, n, k, &bytes, (chunk_rows * dtype.row_bytes(k)) as u64)
                .expect("weight");
            let chunks = DxWeight::chunks(&gw);
            // dy: rows of stride rows.len() + 3 from element 2; dx: rows of stride k + 5 from 7.
            let (dy_stride, dy_offset, dx_stride, dx_offset) = (rows.len() + 3, 2, k + 5, 7);
            let dy = rand(dy_offset + m * dy_stride, seed + 1, 0.1);
            let dx0 = rand(dx_offset + m * dx_stride, seed + 2, 1.0);
            let scale = 0.75;
            let floats = matmul_dx_scratch(&chunks, rows.clone(), m, g);
            split.push(floats > 0);
            for (accumulate, with_scratch) in [(false, true), (true, true), (true, false)] {
                let (dy_buf, dx_buf) = (upload(&ctx, &dy), upload(&ctx, &dx0));
                let scratch = upload(&ctx, &vec![f32::NAN; floats.max(1)]);
                let slices = with_scratch.then_some((&scratch, floats));
                let io = DxIo {
                    dy: &dy_buf,
                    dy_offset,
                    dy_stride,
                    m,
                    dx: &dx_buf,
                    dx_offset,
                    dx_stride,
                    scale,
                    accumulate,
                    slices,
                };
                run(&ctx, |rec| matmul_dx(rec, &chunks, rows.clone(), &io));
                let got = read(&ctx, &dx_buf, dx0.len());
                let mut want = dx0.clone();
                for r in 0..m {
                    for c in 0..k {
                        let sum: f64 = rows
                            .clone()
                            .map(|j| dy[dy_offset + r * dy_stride + j - rows.start] as f64 * w[j * k + c] as f64)
                            .sum();
                        let o = dx_offset + r * dx_stride + c;
                        want[o] = (scale as f64 * sum + if accumulate { dx0[o] as f64 } else { 0.0 }) as f32;
                    }
                }
                let what = format!(
                    "dx {m}x{k} over {rows:?} of {n} ({dtype:?}, acc {accumulate}, scratch {floats} {with_scratch})"
                );
                assert_close(&what, &got, &want, KERNEL_ATOL, KERNEL_RTOL);
            }
        }
    }
    assert!(split.contains(&true) && split.contains(&false), "split and whole reductions both covered: {split:?}");
}

#[test]
fn rms_norms_match_reference() {
    let Some(ctx) = ctx() else { return };
    for (rows, n) in [(1, 1), (3, 38), (5, 64), (2, 130), (70, 256)] {
        let x = rand(rows * n, 3, 2.0);
        let w = rand(n, 4, 0.5);
        let z = rand(rows * n, 5, 3.0);
        let wv = GpuVector::upload(&ctx, "w", &w).expect("w");
        let (xb, yb) = (upload(&ctx, &x), upload(&ctx, &vec![0.0; rows * n]));
        let io = NormIo { x: &xb, y: &yb, x_offset: 0, y_offset: 0, rows, n, eps: 1e-6 };
        run(&ctx, |rec| rms_norm(rec, &wv, &io));
        let want = cpu::rms_norm(&x, &w, n, 1e-6);
        assert_close(&format!("rms_norm {rows}x{n}"), &read(&ctx, &yb, rows * n), &want, KERNEL_ATOL, KERNEL_RTOL);

        let (zb, vb) = (upload(&ctx, &z), upload(&ctx, &x));
        let io = NormIo { x: &zb, y: &vb, x_offset: 0, y_offset: 0, rows, n, eps: 1e-6 };
        run(&ctx, |rec| rms_norm_gated(rec, &wv, &io));
        let want = cpu::rms_norm_gated(&x, &z, &w, n, 1e-6);
        let what = format!("rms_norm_gated {rows}x{n}");
        assert_close(&what, &read(&ctx, &vb, rows * n), &want, KERNEL_ATOL, KERNEL_RTOL);
    }
}

#[test]
fn rms_norm_with_shrink_matches_reference() {
    let Some(ctx) = ctx() else { return };
    // Ranks below, at and above the kernel's 8 rows of A per pass, not multiples of 8 or 4; rows
    // of one and several workgroups; widths below and above one vec4 per invocation.
    for (rows, n, rank) in [(1, 4, 1), (1, 64, 8), (2, 132, 13), (3, 260, 3), (1, 1024, 64), (2, 512, 17)] {
        let x = rand(rows * n, 11, 2.0);
        let w = rand(n, 12, 0.5);
        let a = rand(rank * n, 13, 1.0 / (n as f32).sqrt());
        let wv = GpuVector::upload(&ctx, "w", &w).expect("w");
        let (xb, yb) = (upload(&ctx, &x), upload(&ctx, &vec![0.0; rows * n]));
        let (ab, tb) = (upload(&ctx, &a), upload(&ctx, &vec![7.0; rows * rank + 1]));
        let abg = ctx.weights_bind_group(&ab, "a");
        let io = NormIo { x: &xb, y: &yb, x_offset: 0, y_offset: 0, rows, n, eps: 1e-6 };
        run(&ctx, |rec| rms_norm_shrink(rec, &wv, &io, NormShrink { a: &abg, rank, t: &tb }));
        let y = cpu::rms_norm(&x, &w, n, 1e-6);
        let what = format!("rms_norm_shrink {rows}x{n} rank {rank}");
        assert_close(&what, &read(&ctx, &yb, rows * n), &y, KERNEL_ATOL, KERNEL_RTOL);
        let want: Vec<f32> = (0..rows * rank)
            .map(|e| {
                let (m, r) = (e / rank, e % rank);
                (0..n).map(|i| f64::from(a[r * n + i]) * f64::from(y[m * n + i])).sum::<f64>() as f32
            })
            .collect();
        let got = read(&ctx, &tb, rows * rank + 1);
        assert_close(&format!("{what}: t"), &got[..rows * rank], &want, KERNEL_ATOL, KERNEL_RTOL);
        assert_eq!(got[rows * rank], 7.0, "{what}: wrote past t");
    }
    // A row length that is not a multiple of 4 is refused, not computed wrongly.
    let (xb, ab) = (upload(&ctx, &[1.0; 6]), upload(&ctx, &[1.0; 6]));
    let (wv, abg) = (GpuVector::upload(&ctx, "w", &[0.0; 6]).expect("w"), ctx.weights_bind_group(&ab, "a"));
    let io = NormIo { x: &xb, y: &xb, x_offset: 0, y_offset: 0, rows: 1, n: 6, eps: 1e-6 };
    let mut cache = IoBindCache::new(upload(&ctx, &[0.0; 64]));
    let mut rec = Recorder::new(&ctx, &mut cache);
    let err = rms_norm_shrink(&mut rec, &wv, &io, NormShrink { a: &abg, rank: 1, t: &xb });
    assert!(matches!(err, Err(GpuError::Validation { .. })), "{err:?}");
}

#[test]
fn gated_delta_net_matches_reference_across_steps() {
    let Some(ctx) = ctx() else { return };
    let dims = [
        cpu::GdnDims { hk: 1, hv: 1, dk: 4, dv: 3 },
        cpu::GdnDims { hk: 2, hv: 4, dk: 16, dv: 16 },
        cpu::GdnDims { hk: 3, hv: 3, dk: 10, dv: 14 },
        cpu::GdnDims { hk: 2, hv: 4, dk: 32, dv: 70 },
        // Several row slices per column (gdn_rule.wgsl holds 32 rows an invocation): two slices
        // of 32 columns, five slices of 12 columns with four idle invocations, and Qwen 3.5's
        // own head dims.
        cpu::GdnDims { hk: 1, hv: 2, dk: 40, dv: 70 },
        cpu::GdnDims { hk: 1, hv: 1, dk: 130, dv: 20 },
        cpu::GdnDims { hk: 1, hv: 2, dk: 128, dv: 128 },
    ];
    // Steps of 5, 1, 70 and 130 tokens: 70 crosses the kernel's 64-token blocks of gates, 130
    // comes back to the first half of their double buffer. Steps of 5, 70 and 130 also keep
    // their states at rows inside them (a split before the last row, two splits with a one-row
    // part, a split at a block of gates), which must not change what the step computes.
    for (di, d) in dims.iter().enumerate() {
        for k in [2usize, 4] {
            let c = 2 * d.hk * d.dk + d.hv * d.dv;
            let conv_w = rand(c * k, 10 + di as u64, 0.5);
            let mut gate = rand(d.hv, 11, 1.0);
            gate.extend(rand(d.hv, 12, 1.0));
            let cw = GpuVector::upload(&ctx, "conv", &conv_w).expect("conv");
            let gp = GpuVector::upload(&ctx, "gate", &gate).expect("gate");
            // Ping-pong pairs as the session holds them: each step reads one and writes the other.
            let conv_state = [upload(&ctx, &vec![0.0; c * (k - 1)]), upload(&ctx, &vec![9.0; c * (k - 1)])];
            let state = [upload(&ctx, &vec![0.0; d.hv * d.dk * d.dv]), upload(&ctx, &vec![9.0; d.hv * d.dk * d.dv])];
            let mut cpu_conv = vec![0.0; c * (k - 1)];
            let mut cpu_state = vec![0.0; d.hv * d.dk * d.dv];
            for (step, t) in [5usize, 1, 70, 130].into_iter().enumerate() {
                let seed = 100 + step as u64 * 7 + di as u64;
                let mixed = rand(t * c, seed, 2.0);
                let b = rand(t * d.hv, seed + 1, 3.0);
                let a = rand(t * d.hv, seed + 2, 3.0);
                let (mb, bb, ab) = (upload(&ctx, &mixed), upload(&ctx, &b), upload(&ctx, &a));
                let (yb, core) = (upload(&ctx, &vec![0.0; t * c]), upload(&ctx, &vec![0.0; t * d.hv * d.dv]));
                let params = gdn_test_params(t, c, k, d, 0.0);
                let (from, to) = (step % 2, 1 - step % 2);
                let cuts: &[usize] = match t {
                    5 => &[4],
                    70 => &[1, 2, 33],
                    130 => &[64],
                    _ => &[],
                };
                let kept: Vec<_> = cuts
                    .iter()
                    .map(|_| (upload(&ctx, &vec![9.0; c * (k - 1)]), upload(&ctx, &vec![9.0; d.hv * d.dk * d.dv])))
                    .collect();
                let splits: Vec<GdnSplit> =
                    cuts.iter().zip(&kept).map(|(&row, (conv, state))| GdnSplit { row, conv, state }).collect();
                let want_kept: Vec<(Vec<f32>, Vec<f32>)> = cuts
                    .iter()
                    .map(|&row| {
                        let (mut conv, mut state) = (cpu_conv.clone(), cpu_state.clone());
                        let y = cpu::conv_silu(&mixed[..row * c], &mut conv, &conv_w, row, c, k);
                        let (b, a) = (&b[..row * d.hv], &a[..row * d.hv]);
                        cpu::delta_rule(&y, b, a, &gate, &mut state, row, *d);
                        (conv, state)
                    })
                    .collect();
                let io = GdnIo {
                    mixed: &mb,
                    conv_y: &yb,
                    conv_in: &conv_state[from],
                    conv_out: &conv_state[to],
                    b: &bb,
                    a: &ab,
                    core: &core,
                    state_in: &state[from],
                    state_out: &state[to],
                    splits: &splits,
                };
                run(&ctx, |rec| gated_delta(rec, &cw, &gp, &params, &io));
                let y = cpu::conv_silu(&mixed, &mut cpu_conv, &conv_w, t, c, k);
                let want = cpu::delta_rule(&y, &b, &a, &gate, &mut cpu_state, t, *d);
                let what = format!("gdn {d:?} K{k} step {step}");
                assert_close(&format!("{what} conv"), &read(&ctx, &yb, t * c), &y, KERNEL_ATOL, KERNEL_RTOL);
                assert_close(&what, &read(&ctx, &core, t * d.hv * d.dv), &want, KERNEL_ATOL, KERNEL_RTOL);
                let st = read(&ctx, &state[to], cpu_state.len());
                assert_close(&format!("{what} state"), &st, &cpu_state, KERNEL_ATOL, KERNEL_RTOL);
                for ((row, (conv, state)), (want_conv, want_state)) in cuts.iter().zip(&kept).zip(&want_kept) {
                    let at = format!("{what} kept at row {row}");
                    assert_close(&format!("{at} conv"), &read(&ctx, conv, want_conv.len()), want_conv, EXACT, EXACT);
                    let st = read(&ctx, state, want_state.len());
                    assert_close(&format!("{at} state"), &st, want_state, KERNEL_ATOL, KERNEL_RTOL);
                }
            }
        }
    }
}

#[test]
fn delta_rule_refuses_head_dims_past_its_registers() {
    let Some(ctx) = ctx() else { return };
    let buf = upload(&ctx, &[0.0; 64]);
    let gp = GpuVector::upload(&ctx, "gate", &[0.0; 4]).expect("gate");
    let io = GdnIo {
        mixed: &buf,
        conv_y: &buf,
        conv_in: &buf,
        conv_out: &buf,
        b: &buf,
        a: &buf,
        core: &buf,
        state_in: &buf,
        state_out: &buf,
        splits: &[],
    };
    let mut cache = IoBindCache::new(upload(&ctx, &[0.0; 64]));
    for (dk, hk, hv) in [(DELTA_RULE_MAX_DK + 1, 1, 1), (0, 1, 1), (4, 2, 3)] {
        let params = GdnParams { t: 1, c: 8, k: 2, hk, hv, dk, dv: 4, ..Default::default() };
        let mut rec = Recorder::new(&ctx, &mut cache);
        let err = gated_delta(&mut rec, &gp, &gp, &params, &io);
        assert!(matches!(err, Err(GpuError::Validation { .. })), "dk {dk} hk {hk} hv {hv}: {err:?}");
    }
    // Splits at an edge of the step, past it or out of order.
    let params = GdnParams { t: 4, c: 8, k: 2, hk: 1, hv: 1, dk: 4, dv: 4, ..Default::default() };
    for rows in [&[0][..], &[4], &[2, 2], &[3, 1]] {
        let splits: Vec<GdnSplit> = rows.iter().map(|&row| GdnSplit { row, conv: &buf, state: &buf }).collect();
        let io = GdnIo { splits: &splits, ..io };
        let mut rec = Recorder::new(&ctx, &mut cache);
        let err = gated_delta(&mut rec, &gp, &gp, &params, &io);
        assert!(matches!(err, Err(GpuError::Validation { .. })), "splits at {rows:?}: {err:?}");
    }
}

/// The fused GDN step's buffers on step `step` of ping-pong pairs `conv` and `state`: it reads
/// parity `step % 2` and writes the other.
fn step_io<'a>(
    mixed: &'a wgpu::Buffer,
    conv: &'a [wgpu::Buffer; 2],
    state: &'a [wgpu::Buffer; 2],
    core: &'a wgpu::Buffer,
    step: usize,
) -> GdnStepIo<'a> {
    let (from, to) = (step % 2, 1 - step % 2);
    GdnStepIo { mixed, conv_in: &conv[from], conv_out: &conv[to], state_in: &state[from], state_out: &state[to], core }
}

/// The GDN kernels' parameters for `t` tokens of `c` conv channels, conv width `k`, heads `d`
/// and norm epsilon `eps`.
fn gdn_test_params(t: usize, c: usize, k: usize, d: &cpu::GdnDims, eps: f32) -> GdnParams {
    GdnParams {
        t: t as u32,
        c: c as u32,
        k: k as u32,
        hk: d.hk as u32,
        hv: d.hv as u32,
        dk: d.dk as u32,
        dv: d.dv as u32,
        eps,
        ..Default::default()
    }
}

#[test]
fn fused_gdn_token_step_matches_reference_across_steps() {
    let Some(ctx) = ctx() else { return };
    // GQA groups 1, 2 and 3, head dims below, at and above the workgroup of 128.
    let dims = [
        cpu::GdnDims { hk: 2, hv: 4, dk: 16, dv: 16 },
        cpu::GdnDims { hk: 1, hv: 3, dk: 10, dv: 14 },
        cpu::GdnDims { hk: 2, hv: 2, dk: 130, dv: 200 },
    ];
    for (di, d) in dims.iter().enumerate() {
        for k in [2usize, 4] {
            let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
            let c = 2 * kd + vd;
            let conv_w = rand(c * k, 40 + di as u64, 0.5);
            let mut gate = rand(d.hv, 41, 1.0);
            gate.extend(rand(d.hv, 42, 1.0));
            let norm_w = rand(d.dv, 43, 1.0);
            let prm: Vec<f32> = conv_w.iter().chain(&gate).chain(&norm_w).copied().collect();
            let pv = GpuVector::upload(&ctx, "prm", &prm).expect("prm");
            let conv = [upload(&ctx, &vec![0.0; c * (k - 1)]), upload(&ctx, &vec![9.0; c * (k - 1)])];
            let state = [upload(&ctx, &vec![0.0; d.hv * d.dk * d.dv]), upload(&ctx, &vec![9.0; d.hv * d.dk * d.dv])];
            let mut cpu_conv = vec![0.0; c * (k - 1)];
            let mut cpu_state = vec![0.0; d.hv * d.dk * d.dv];
            for step in 0..4 {
                let seed = 300 + step as u64 * 5 + di as u64;
                let mixed = rand(c, seed, 2.0);
                let zba = rand(vd + 2 * d.hv, seed + 1, 3.0);
                // The token's row and its output row after others on some steps (a batch's
                // session row: mixed_at, core_at).
                let (lead_in, lead_out) = [(0, 0), (13, 7), (0, 0), (c + vd + 2 * d.hv, vd)][step];
                let cat: Vec<f32> = [vec![5.0; lead_in], mixed.clone(), zba.clone()].concat();
                // out_proj's shrink split by head on some steps (aligned value head dims).
                let rank = [0, 5, 8, 0][step] * usize::from(d.dv % 4 == 0);
                let a = rand(rank * vd, seed + 2, 1.0);
                let ab = upload(&ctx, if rank == 0 { &[0.0; 4] } else { &a });
                let abg = ctx.weights_bind_group(&ab, "a");
                let out_len = vd + d.hv * rank.next_multiple_of(4);
                let (mb, core) = (upload(&ctx, &cat), upload(&ctx, &vec![7.0; lead_out + out_len]));
                let params = GdnParams {
                    mixed_at: lead_in as u32,
                    core_at: lead_out as u32,
                    ..gdn_test_params(1, c, k, d, 1e-6)
                };
                let (io, to) = (step_io(&mb, &conv, &state, &core, step), 1 - step % 2);
                let shrink = (rank > 0).then_some(HeadShrink { a: &abg, rank });
                run(&ctx, |rec| gdn_step(rec, &pv, &params, &io, shrink));
                let y = cpu::conv_silu(&mixed, &mut cpu_conv, &conv_w, 1, c, k);
                let (b, ga) = (&zba[vd..vd + d.hv], &zba[vd + d.hv..]);
                let o = cpu::delta_rule(&y, b, ga, &gate, &mut cpu_state, 1, *d);
                let want = cpu::rms_norm_gated(&o, &zba[..vd], &norm_w, d.dv, 1e-6);
                let what = format!("gdn step {d:?} K{k} step {step} shrink rank {rank} rows at {lead_in}/{lead_out}");
                let all = read(&ctx, &core, lead_out + out_len);
                assert!(all[..lead_out].iter().all(|&v| v == 7.0), "{what}: wrote before its output row");
                let got = &all[lead_out..];
                assert_close(&what, &got[..vd], &want, KERNEL_ATOL, KERNEL_RTOL);
                if rank > 0 {
                    check_head_parts(&what, &got[vd..], &a, &want, rank, d.hv);
                }
                let st = read(&ctx, &state[to], cpu_state.len());
                assert_close(&format!("{what} state"), &st, &cpu_state, KERNEL_ATOL, KERNEL_RTOL);
                let cs = read(&ctx, &conv[to], cpu_conv.len());
                assert_close(&format!("{what} conv history"), &cs, &cpu_conv, EXACT, EXACT);
            }
        }
    }
}

/// A batch's GDN rows in one dispatch (`gdn_step_rows`): row r reads its row of `mixed`, writes
/// its row of `core` and steps slot `slots[r]` of pooled states; every row equals its own step
/// against the CPU reference over two steps (ping-pong), a slot no row names is left as it was,
/// and more rows than the slot table holds is a typed error.
#[test]
fn pooled_gdn_rows_step_each_slot_as_its_own_step() {
    let Some(ctx) = ctx() else { return };
    let dims = [cpu::GdnDims { hk: 2, hv: 4, dk: 16, dv: 16 }, cpu::GdnDims { hk: 1, hv: 3, dk: 10, dv: 14 }];
    // 18 rows over 20 slots in a scattered order: the slot table's bytes, words and vec4s.
    let (k, pool_slots) = (4usize, 20usize);
    let slots: Vec<usize> = (0..18).map(|r| (r * 7 + 3) % pool_slots).collect();
    let idle: Vec<usize> = (0..pool_slots).filter(|s| !slots.contains(s)).collect();
    for (di, d) in dims.iter().enumerate() {
        let (kd, vd) = (d.hk * d.dk, d.hv * d.dv);
        let c = 2 * kd + vd;
        let width = c + vd + 2 * d.hv;
        let (conv_len, state_len) = (c * (k - 1), d.hv * d.dk * d.dv);
        let conv_w = rand(c * k, 60 + di as u64, 0.5);
        let mut gate = rand(d.hv, 61, 1.0);
        gate.extend(rand(d.hv, 62, 1.0));
        let norm_w = rand(d.dv, 63, 1.0);
        let prm: Vec<f32> = conv_w.iter().chain(&gate).chain(&norm_w).copied().collect();
        let pv = GpuVector::upload(&ctx, "prm", &prm).expect("prm");
        let mut cpu_conv: Vec<Vec<f32>> = (0..pool_slots).map(|s| rand(conv_len, 70 + s as u64, 1.0)).collect();
        let mut cpu_state: Vec<Vec<f32>> = (0..pool_slots).map(|s| rand(state_len, 80 + s as u64, 0.5)).collect();
        let conv = [upload(&ctx, &cpu_conv.concat()), upload(&ctx, &vec![9.0; pool_slots * conv_len])];
        let state = [upload(&ctx, &cpu_state.concat()), upload(&ctx, &vec![9.0; pool_slots * state_len])];
        for step in 0..2 {
            let rows: Vec<Vec<f32>> = (0..slots.len()).map(|r| rand(width, 90 + 10 * step + r as u64, 2.0)).collect();
            // out_proj's shrink split by head on the second step (aligned value head dims): each
            // row's parts after all the rows' outputs.
            let rank = [0, 5][step as usize] * usize::from(d.dv % 4 == 0);
            let a = rand(rank * vd, 95 + step, 1.0);
            let ab = upload(&ctx, if rank == 0 { &[0.0; 4] } else { &a });
            let abg = ctx.weights_bind_group(&ab, "a");
            let parts_len = slots.len() * d.hv * rank.next_multiple_of(4);
            let (mb, core) = (upload(&ctx, &rows.concat()), upload(&ctx, &vec![7.0; slots.len() * vd + parts_len]));
            let params = gdn_test_params(1, c, k, d, 1e-6).with_slots(&slots).expect("slots");
            let (io, to) = (step_io(&mb, &conv, &state, &core, step as usize), 1 - step as usize % 2);
            let shrink = (rank > 0).then_some(HeadShrink { a: &abg, rank });
            run(&ctx, |rec| gdn_step_rows(rec, &pv, &params, &io, (slots.len(), shrink)));
            let got_core = read(&ctx, &core, slots.len() * vd + parts_len);
            let got_state = read(&ctx, &state[to], pool_slots * state_len);
            let got_conv = read(&ctx, &conv[to], pool_slots * conv_len);
            for (r, &slot) in slots.iter().enumerate() {
                let mixed = &rows[r][..c];
                let zba = &rows[r][c..];
                let y = cpu::conv_silu(mixed, &mut cpu_conv[slot], &conv_w, 1, c, k);
                let (b, ga) = (&zba[vd..vd + d.hv], &zba[vd + d.hv..]);
                let o = cpu::delta_rule(&y, b, ga, &gate, &mut cpu_state[slot], 1, *d);
                let want = cpu::rms_norm_gated(&o, &zba[..vd], &norm_w, d.dv, 1e-6);
                let what = format!("pooled gdn {d:?} step {step} row {r} slot {slot}");
                assert_close(&what, &got_core[r * vd..(r + 1) * vd], &want, KERNEL_ATOL, KERNEL_RTOL);
                if rank > 0 {
                    let parts = &got_core[slots.len() * vd + r * d.hv * rank.next_multiple_of(4)..];
                    check_head_parts(&format!("{what} shrink"), parts, &a, &want, rank, d.hv);
                }
                let st = &got_state[slot * state_len..(slot + 1) * state_len];
                assert_close(&format!("{what} state"), st, &cpu_state[slot], KERNEL_ATOL, KERNEL_RTOL);
                let cs = &got_conv[slot * conv_len..(slot + 1) * conv_len];
                assert_close(&format!("{what} conv history"), cs, &cpu_conv[slot], EXACT, EXACT);
            }
            // The idle slots are no row's: the step did not write them.
            for &idle in &idle {
                let st = &got_state[idle * state_len..(idle + 1) * state_len];
                let want = if step == 0 { vec![9.0; state_len] } else { cpu_state[idle].clone() };
                assert_eq!(st, want.as_slice(), "{d:?} step {step}: slot {idle} untouched");
            }
        }
    }
    let buf = upload(&ctx, &[0.0; 64]);
    let pv = GpuVector::upload(&ctx, "prm", &[0.0; 64]).expect("prm");
    let io = GdnStepIo { mixed: &buf, conv_in: &buf, conv_out: &buf, state_in: &buf, state_out: &buf, core: &buf };
    let mut cache = IoBindCache::new(upload(&ctx, &[0.0; 64]));
    let mut rec = Recorder::new(&ctx, &mut cache);
    let params = GdnParams { t: 1, c: 8, k: 2, hk: 1, hv: 1, dk: 4, dv: 4, ..Default::default() };
    let err = gdn_step_rows(&mut rec, &pv, &params, &io, (GDN_MAX_ROWS + 1, None));
    assert!(matches!(err, Err(GpuError::Validation { .. })), "{err:?}");
    // Three rows of 4 outputs and one head each take 12 of the 64 floats; their rank-20 shrink
    // parts (60 more) do not fit.
    let abg = ctx.weights_bind_group(&buf, "a");
    let err = gdn_step_rows(&mut rec, &pv, &params, &io, (3, Some(HeadShrink { a: &abg, rank: 20 })));
    assert!(matches!(err, Err(GpuError::Validation { .. })), "{err:?}");
    // A split shrink reads A four columns at a time: a value head dim of 6 is refused.
    let odd = GdnParams { dv: 6, ..params };
    let err = gdn_step_rows(&mut rec, &pv, &odd, &io, (1, Some(HeadShrink { a: &abg, rank: 1 })));
    assert!(matches!(&err, Err(GpuError::Validation { message, .. }) if message.contains("head dim 6")), "{err:?}");
    assert!(params.with_slots(&[0; GDN_MAX_ROWS + 1]).is_none(), "65 rows do not fit the slot table");
    assert!(params.with_slots(&[256]).is_none(), "a slot is one byte");
}

/// The RoPE table of an attention layer of these dims (`rot` rotary dims of `hd`) for `s_max`
/// positions, on the host and uploaded.
fn rope_for(
    ctx: &GpuContext,
    (hq, hkv, hd, rot): (usize, usize, usize, usize),
    s_max: usize,
) -> (Vec<f32>, wgpu::Buffer) {
    let cfg = qwen35_wgpu::TextConfig::from_json(&format!(
        r#"{{"model_type":"qwen3_5_text","vocab_size":8,"hidden_size":8,"intermediate_size":8,
        "num_hidden_layers":1,"num_attention_heads":{hq},"num_key_value_heads":{hkv},"head_dim":{hd},
        "linear_conv_kernel_dim":4,"linear_key_head_dim":4,"linear_value_head_dim":4,
        "linear_num_key_heads":1,"linear_num_value_heads":1,
        "rope_parameters":{{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":{}}}}}"#,
        rot as f64 / hd as f64
    ))
    .expect("config");
    let table = qwen35_wgpu::runtime::rope_table(&cfg, s_max).expect("table");
    let rope = upload(ctx, if table.is_empty() { &[0.0, 0.0] } else { &table });
    (table, rope)
}

/// Attention parameters for heads (hq, hkv, hd, rot) over a cache of `s_max` positions (eps
/// 1e-6, the hd^-0.5 score scale), the rest zero.
fn attn_shape((hq, hkv, hd, rot): (usize, usize, usize, usize), s_max: usize) -> AttnParams {
    AttnParams {
        hq: hq as u32,
        hkv: hkv as u32,
        hd: hd as u32,
        rot_half: (rot / 2) as u32,
        s_max: s_max as u32,
        eps: 1e-6,
        scale: (hd as f32).powf(-0.5),
        ..Default::default()
    }
}

#[test]
fn attention_matches_reference_across_steps() {
    let Some(ctx) = ctx() else { return };
    // (hq, hkv, hd, rot): GQA groups 1, 2 and 4; head dims below, at and above the workgroup.
    for &(hq, hkv, hd, rot) in &[(1, 1, 8, 2), (3, 1, 24, 6), (4, 2, 64, 16), (8, 2, 256, 64), (2, 2, 130, 0)] {
        let s_max = 80;
        let (table, rope) = rope_for(&ctx, (hq, hkv, hd, rot), s_max);
        let q_norm = rand(hd, 1, 0.3);
        let k_norm = rand(hd, 2, 0.3);
        let (qn, kn) =
            (GpuVector::upload(&ctx, "qn", &q_norm).expect("qn"), GpuVector::upload(&ctx, "kn", &k_norm).expect("kn"));
        let kc = upload(&ctx, &vec![0.0; hkv * s_max * hd]);
        let vc = upload(&ctx, &vec![0.0; hkv * s_max * hd]);
        let mut cpu_k = vec![Vec::new(); hkv];
        let mut cpu_v = vec![Vec::new(); hkv];
        let mut pos0 = 0;
        for (step, t) in [5usize, 1, 70].into_iter().enumerate() {
            let seed = 40 + step as u64;
            let qg = rand(t * hq * 2 * hd, seed, 2.0);
            let k = rand(t * hkv * hd, seed + 1, 2.0);
            let v = rand(t * hkv * hd, seed + 2, 2.0);
            // A single token reads q|gate, k and v from one buffer (the concatenated projection).
            let cat: Vec<f32> = qg.iter().chain(&k).chain(&v).copied().collect();
            let (qgb, kb, vb) = if t == 1 {
                (upload(&ctx, &cat), upload(&ctx, &cat), upload(&ctx, &cat))
            } else {
                (upload(&ctx, &qg), upload(&ctx, &k), upload(&ctx, &v))
            };
            let (k_offset, v_offset) = if t == 1 { (qg.len(), qg.len() + k.len()) } else { (0, 0) };
            let (qb, out) = (upload(&ctx, &vec![0.0; t * hq * hd]), upload(&ctx, &vec![0.0; t * hq * hd]));
            let params = AttnParams {
                t: t as u32,
                pos0: pos0 as u32,
                k_offset: k_offset as u32,
                v_offset: v_offset as u32,
                ..attn_shape((hq, hkv, hd, rot), s_max)
            };
            let io =
                AttnIo { qg: &qgb, kraw: &kb, vraw: &vb, q: &qb, k_cache: &kc, v_cache: &vc, rope: &rope, out: &out };
            run(&ctx, |rec| attention(rec, &qn, &kn, &params, &io));
            let dims = cpu::AttnDims { hq, hkv, hd, rot, pos0, eps: 1e-6 };
            let want = cpu::attention(&qg, &k, &v, &q_norm, &k_norm, &table, &mut cpu_k, &mut cpu_v, t, dims);
            let what = format!("attention hq{hq} hkv{hkv} hd{hd} rot{rot} step {step}");
            assert_close(&what, &read(&ctx, &out, t * hq * hd), &want, KERNEL_ATOL, KERNEL_RTOL);
            pos0 += t;
        }
    }
}

/// The split shrink a decode kernel wrote for an output row `out`, its parts from `parts[0]`:
/// `heads` parts of the rank rounded up to 4 (padding zero), summing to `A · out` (A `[rank,
/// heads·dh]`).
fn check_head_parts(what: &str, parts: &[f32], a: &[f32], out: &[f32], rank: usize, heads: usize) {
    let (k, pad) = (out.len(), rank.next_multiple_of(4));
    let dh = k / heads;
    let mut sum = vec![0.0; rank];
    for h in 0..heads {
        let part = &parts[h * pad..(h + 1) * pad];
        assert!(part[rank..].iter().all(|&v| v == 0.0), "{what}: padding of part {h}");
        // Each part on its own: the head's columns of A times the head's output.
        let want: Vec<f32> =
            (0..rank).map(|r| (0..dh).map(|d| a[r * k + h * dh + d] * out[h * dh + d]).sum()).collect();
        assert_close(&format!("{what} part {h}"), &part[..rank], &want, KERNEL_ATOL, KERNEL_RTOL);
        sum.iter_mut().zip(&part[..rank]).for_each(|(s, v)| *s += v);
    }
    let want: Vec<f32> = (0..rank).map(|r| (0..k).map(|c| a[r * k + c] * out[c]).sum()).collect();
    assert_close(&format!("{what} parts summed"), &sum, &want, KERNEL_ATOL, KERNEL_RTOL);
}

#[test]
fn single_token_attention_matches_reference_across_positions() {
    let Some(ctx) = ctx() else { return };
    // (hq, hkv, hd, rot) as in the multi-token sweep; tokens at positions 0 and 1 (an empty and
    // a one-key cache), after a multi-token step at 63, 64 and 65 (the block edge of 64 keys: one
    // split, then two). One long cache: tokens at 2202 .. 2204, past ATTN_MAX_SPLITS splits of
    // one block, so splits of two blocks, the last one partial.
    let configs = [(1, 1, 8, 2, 61), (3, 1, 24, 6, 61), (4, 2, 64, 16, 61), (8, 2, 256, 64, 61), (2, 2, 130, 0, 61)];
    let mut splits_seen = std::collections::BTreeSet::new();
    for &(hq, hkv, hd, rot, prefill) in configs.iter().chain(&[(2, 1, 8, 2, 2200)]) {
        let s_max = prefill + 19;
        let (table, rope) = rope_for(&ctx, (hq, hkv, hd, rot), s_max);
        let (q_norm, k_norm) = (rand(hd, 3, 0.3), rand(hd, 4, 0.3));
        let (qn, kn) =
            (GpuVector::upload(&ctx, "qn", &q_norm).expect("qn"), GpuVector::upload(&ctx, "kn", &k_norm).expect("kn"));
        let qk: Vec<f32> = q_norm.iter().chain(&k_norm).copied().collect();
        let qkn = GpuVector::upload(&ctx, "qk", &qk).expect("qk");
        let kc = upload(&ctx, &vec![0.0; hkv * s_max * hd]);
        let vc = upload(&ctx, &vec![0.0; hkv * s_max * hd]);
        let (mut cpu_k, mut cpu_v) = (vec![Vec::new(); hkv], vec![Vec::new(); hkv]);
        let attn = hq * hd;
        let mut pos0 = 0;
        let part = upload(&ctx, &vec![0.0; hq * ATTN_MAX_SPLITS as usize * (hd + 2)]);
        for (step, t) in [1usize, 1, prefill, 1, 1, 1].into_iter().enumerate() {
            let seed = 60 + step as u64;
            let qg = rand(t * hq * 2 * hd, seed, 2.0);
            let k = rand(t * hkv * hd, seed + 1, 2.0);
            let v = rand(t * hkv * hd, seed + 2, 2.0);
            // The shrink of o_proj's input split by head on some steps (aligned head dims),
            // ranks 3 and 8.
            let rank = [0, 3, 0, 8, 3, 8][step] * usize::from(hd % 4 == 0);
            let a = rand(rank * attn, seed + 3, 1.0);
            let ab = upload(&ctx, if rank == 0 { &[0.0; 4] } else { &a });
            let abg = ctx.weights_bind_group(&ab, "a");
            let mut params = AttnParams { t: t as u32, pos0: pos0 as u32, ..attn_shape((hq, hkv, hd, rot), s_max) };
            // A single token's rows after others on some steps (a batch's session row: q_offset,
            // out_offset; the multi-token kernels take none).
            let (lead_in, lead_out) = if t == 1 { [(0, 0), (11, 5), (qg.len() * 3, attn)][step % 3] } else { (0, 0) };
            let out_len = t * attn + hq * rank.next_multiple_of(4);
            let out = upload(&ctx, &vec![7.0; lead_out + out_len]);
            if t == 1 {
                let cat: Vec<f32> = [vec![5.0; lead_in], qg.clone(), k.clone(), v.clone()].concat();
                (params.q_offset, params.out_offset) = (lead_in as u32, lead_out as u32);
                (params.k_offset, params.v_offset) =
                    ((lead_in + qg.len()) as u32, (lead_in + qg.len() + k.len()) as u32);
                let cb = upload(&ctx, &cat);
                let io = AttnOneIo { qkv: &cb, k_cache: &kc, v_cache: &vc, rope: &rope, out: &out, part: &part };
                let shrink = (rank > 0).then_some(HeadShrink { a: &abg, rank });
                splits_seen.insert(attention_splits(pos0 as u32));
                run(&ctx, |rec| attention_one(rec, &qkn, &params, &io, shrink));
            } else {
                let (qgb, kb, vb, qb) =
                    (upload(&ctx, &qg), upload(&ctx, &k), upload(&ctx, &v), upload(&ctx, &vec![0.0; t * attn]));
                let io = AttnIo {
                    qg: &qgb,
                    kraw: &kb,
                    vraw: &vb,
                    q: &qb,
                    k_cache: &kc,
                    v_cache: &vc,
                    rope: &rope,
                    out: &out,
                };
                run(&ctx, |rec| attention(rec, &qn, &kn, &params, &io));
            }
            let dims = cpu::AttnDims { hq, hkv, hd, rot, pos0, eps: 1e-6 };
            let want = cpu::attention(&qg, &k, &v, &q_norm, &k_norm, &table, &mut cpu_k, &mut cpu_v, t, dims);
            let what = format!(
                "attention hq{hq} hkv{hkv} hd{hd} rot{rot} {t} token(s) at {pos0}, rows at {lead_in}/{lead_out}"
            );
            let all = read(&ctx, &out, lead_out + out_len);
            assert!(all[..lead_out].iter().all(|&v| v == 7.0), "{what}: wrote before its output row");
            let got = &all[lead_out..];
            assert_close(&what, &got[..t * attn], &want, KERNEL_ATOL, KERNEL_RTOL);
            if rank > 0 {
                check_head_parts(&what, &got[attn..], &a, &want, rank, hq);
            }
            pos0 += t;
        }
        // The single-token steps wrote their keys and values into the cache.
        let (ks, vs) = (read(&ctx, &kc, hkv * s_max * hd), read(&ctx, &vc, hkv * s_max * hd));
        for h in 0..hkv {
            let row = |c: &[f32]| c[h * s_max * hd..(h * s_max + pos0) * hd].to_vec();
            assert_close(&format!("hd{hd} key cache {h}"), &row(&ks), &cpu_k[h], KERNEL_ATOL, KERNEL_RTOL);
            assert_close(&format!("hd{hd} value cache {h}"), &row(&vs), &cpu_v[h], EXACT, EXACT);
        }
    }
    // One split (an empty, a one-key and a one-block cache), two splits of one block, and the
    // most splits of two blocks were run.
    let (max, block) = (ATTN_MAX_SPLITS, 64);
    for want in [(1, block), (2, block), (2202u32.div_ceil(2 * block), 2 * block)] {
        assert!(splits_seen.contains(&want), "split {want:?} not exercised: {splits_seen:?}");
    }
    assert!(2202u32.div_ceil(2 * block) <= max && 2202 > max * block, "the long cache needs blocks of two");
}

/// A batched step's single-token attention (`attention_one_rows`): 35 rows (two dispatch pairs
/// of at most ATTN_MAX_ROWS), each one session's token after rows of others (strided q|gate|k|v
/// and output rows after leading elements), at its own position in its own slot of pooled
/// caches (slots out of row order, some unused), from an empty cache to one of three splits:
/// each row's output and the key and value it writes against the CPU reference run on that
/// row alone; other rows' slots and positions stay as they were. Rows past the caches (positions or
/// slots) or slots past 255 are typed errors.
#[test]
fn batched_single_token_attention_matches_reference_per_row() {
    let Some(ctx) = ctx() else { return };
    for &(hq, hkv, hd, rot) in &[(4, 2, 64, 16), (2, 1, 8, 2)] {
        let (rows, slots, s_max) = (35, 40, 140);
        let (table, rope) = rope_for(&ctx, (hq, hkv, hd, rot), s_max);
        let (q_norm, k_norm) = (rand(hd, 5, 0.3), rand(hd, 6, 0.3));
        let qk: Vec<f32> = q_norm.iter().chain(&k_norm).copied().collect();
        let qkn = GpuVector::upload(&ctx, "qk", &qk).expect("qk");
        let (attn, q_out, kv) = (hq * hd, 2 * hq * hd, hkv * hd);
        let (width, out_stride, lead_in, lead_out) = (q_out + 2 * kv, attn + 3, 11, 5);
        // Row r: slot (7r + 3) mod 40 and a position from an empty cache to three splits of 64.
        let slot_of = |r: usize| (7 * r + 3) % slots;
        let pos_of = |r: usize| [0, 1, 63, 64, 65, 130, 2, 100][r % 8] + r / 8;
        let (mut kc, mut vc) = (vec![0.5; slots * hkv * s_max * hd], vec![0.25; slots * hkv * s_max * hd]);
        let mut qkv = vec![9.0; lead_in + rows * width];
        let mut want = Vec::new();
        let mut want_cache = Vec::new();
        for r in 0..rows {
            let (pos, seed) = (pos_of(r), 100 + 10 * r as u64);
            let dims = |pos0| cpu::AttnDims { hq, hkv, hd, rot, pos0, eps: 1e-6 };
            // The row's history: a prefill of `pos` tokens on the CPU, its cache copied into the slot.
            let (mut ck, mut cv) = (vec![Vec::new(); hkv], vec![Vec::new(); hkv]);
            let history = |n: usize, salt: u64| rand(pos * n, seed + salt, 2.0);
            if pos > 0 {
                let (hk, hv) = (history(kv, 1), history(kv, 2));
                cpu::attention(&history(q_out, 0), &hk, &hv, &q_norm, &k_norm, &table, &mut ck, &mut cv, pos, dims(0));
            }
            let (qg, k, v) = (rand(q_out, seed + 3, 2.0), rand(kv, seed + 4, 2.0), rand(kv, seed + 5, 2.0));
            let at = lead_in + r * width;
            qkv[at..at + width].copy_from_slice(&[qg.clone(), k.clone(), v.clone()].concat());
            for h in 0..hkv {
                let base = (slot_of(r) * hkv + h) * s_max * hd;
                kc[base..base + pos * hd].copy_from_slice(&ck[h]);
                vc[base..base + pos * hd].copy_from_slice(&cv[h]);
            }
            want.push(cpu::attention(&qg, &k, &v, &q_norm, &k_norm, &table, &mut ck, &mut cv, 1, dims(pos)));
            want_cache.push((ck, cv));
        }
        let (kcb, vcb, qkvb) = (upload(&ctx, &kc), upload(&ctx, &vc), upload(&ctx, &qkv));
        let part = upload(&ctx, &vec![0.0; ATTN_MAX_ROWS * hq * ATTN_MAX_SPLITS as usize * (hd + 2)]);
        let params = AttnParams {
            t: 1,
            q_offset: lead_in as u32,
            k_offset: (lead_in + q_out) as u32,
            v_offset: (lead_in + q_out + kv) as u32,
            out_offset: lead_out as u32,
            row_stride: width as u32,
            out_stride: out_stride as u32,
            ..attn_shape((hq, hkv, hd, rot), s_max)
        };
        let placed: Vec<(usize, usize)> = (0..rows).map(|r| (slot_of(r), pos_of(r))).collect();
        // Without and with o_proj's shrink split by head (rank 5): each row's parts after all the
        // rows' outputs, from the element after the last rounded up to 4. The second run writes
        // the same keys and values as the first.
        let rows_end = lead_out + rows * out_stride;
        let (a, rank) = (rand(5 * attn, 7, 1.0), 5usize);
        let (ab, pad) = (upload(&ctx, &a), rank.next_multiple_of(4));
        let abg = ctx.weights_bind_group(&ab, "a");
        let parts_at = rows_end.next_multiple_of(4);
        let out = upload(&ctx, &vec![7.0; parts_at + rows * hq * pad]);
        let io = AttnOneIo { qkv: &qkvb, k_cache: &kcb, v_cache: &vcb, rope: &rope, out: &out, part: &part };
        for shrink in [None, Some(HeadShrink { a: &abg, rank })] {
            run(&ctx, |rec| attention_one_rows(rec, &qkn, &params, &io, (&placed, shrink)));
            let got = read(&ctx, &out, parts_at + rows * hq * pad);
            assert!(got[..lead_out].iter().all(|&v| v == 7.0), "hd{hd}: wrote before the first row");
            for r in 0..rows {
                let what = format!("hq{hq} hd{hd} row {r} with shrink {}", shrink.is_some());
                let row = &got[lead_out + r * out_stride..lead_out + (r + 1) * out_stride];
                assert_close(&what, &row[..attn], &want[r], KERNEL_ATOL, KERNEL_RTOL);
                assert!(row[attn..].iter().all(|&v| v == 7.0), "{what}: wrote past its output row");
                let parts = &got[parts_at + r * hq * pad..];
                match shrink {
                    Some(_) => check_head_parts(&format!("{what} shrink"), parts, &a, &want[r], rank, hq),
                    None => assert!(parts[..hq * pad].iter().all(|&v| v == 7.0), "{what}: wrote shrink parts"),
                }
            }
        }
        let (got_k, got_v) = (read(&ctx, &kcb, kc.len()), read(&ctx, &vcb, vc.len()));
        for (r, (ck, cv)) in want_cache.iter().enumerate() {
            let what = format!("hq{hq} hkv{hkv} hd{hd} row {r} at slot {}, position {}", slot_of(r), pos_of(r));
            let pos = pos_of(r);
            for h in 0..hkv {
                let base = (slot_of(r) * hkv + h) * s_max * hd;
                let span = base..base + (pos + 1) * hd;
                assert_close(&format!("{what} keys {h}"), &got_k[span.clone()], &ck[h], KERNEL_ATOL, KERNEL_RTOL);
                assert_close(&format!("{what} values {h}"), &got_v[span], &cv[h], EXACT, EXACT);
                let rest = base + (pos + 1) * hd..base + s_max * hd;
                assert!(got_k[rest.clone()].iter().all(|&v| v == 0.5), "{what}: keys past its position");
                assert!(got_v[rest].iter().all(|&v| v == 0.25), "{what}: values past its position");
            }
        }
        let unused: Vec<usize> = (0..slots).filter(|s| (0..rows).all(|r| slot_of(r) != *s)).collect();
        assert!(!unused.is_empty(), "some slots are unused");
        for s in unused {
            let span = s * hkv * s_max * hd..(s + 1) * hkv * s_max * hd;
            assert!(got_k[span.clone()].iter().all(|&v| v == 0.5), "hd{hd}: slot {s} keys written");
            assert!(got_v[span].iter().all(|&v| v == 0.25), "hd{hd}: slot {s} values written");
        }
        for bad in [vec![(0, s_max)], vec![(256, 0)], vec![(slots, 0)]] {
            let mut cache = bind_cache(&ctx, 256 * 1024);
            let mut rec = Recorder::new(&ctx, &mut cache);
            let err = attention_one_rows(&mut rec, &qkn, &params, &io, (&bad, None)).expect_err("refused");
            assert!(matches!(err, GpuError::Validation { .. }), "{bad:?}: {err}");
        }
        // A shrink whose parts run past the output.
        let mut cache = bind_cache(&ctx, 256 * 1024);
        let mut rec = Recorder::new(&ctx, &mut cache);
        let wide = Some(HeadShrink { a: &abg, rank: rank + 4 });
        let err = attention_one_rows(&mut rec, &qkn, &params, &io, (&placed, wide)).expect_err("refused");
        assert!(matches!(err, GpuError::Validation { .. }), "shrink past the output: {err}");
        // A split shrink reads A four columns at a time: a head dim of 6 is refused.
        let odd = AttnParams { hd: 6, ..params };
        let shrink = Some(HeadShrink { a: &abg, rank: 1 });
        let err = attention_one_rows(&mut rec, &qkn, &odd, &io, (&placed[..1], shrink)).expect_err("refused");
        assert!(err.to_string().contains("head dim 6"), "{err}");
    }
}

#[test]
fn embed_and_swiglu_match_reference() {
    let Some(ctx) = ctx() else { return };
    for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        let (v, h) = (37, 19);
        let (bytes, table) = weight_bytes(&rand(v * h, 9, 1.0), dtype);
        // Chunks of 5 rows (8 chunks: a dispatch each), 10, 13 and 19 (4, 3 and 2 chunks: one
        // embed_split dispatch).
        for rows in [5, 10, 13, 19] {
            let gw = GpuWeight::upload(&ctx, "embed", dtype, v, h, &bytes, (rows * dtype.row_bytes(h)) as u64)
                .expect("table");
            check_embed(&ctx, &gw, &table, &format!("embed {dtype:?} in chunks of {rows} must be exact"));
        }
    }
    for n in [1, 63, 64, 1000] {
        let g = rand(n, 21, 4.0);
        let u = rand(n, 22, 2.0);
        let (gb, ub) = (upload(&ctx, &g), upload(&ctx, &u));
        run(&ctx, |rec| swiglu(rec, &gb, &ub, n));
        let want: Vec<f32> = g.iter().zip(&u).map(|(g, u)| cpu::silu(*g) * u).collect();
        assert_close(&format!("swiglu {n}"), &read(&ctx, &gb, n), &want, KERNEL_ATOL, KERNEL_RTOL);
    }
}

#[test]
fn the_uniform_arena_grows_to_what_a_recording_needs() {
    let Some(ctx) = ctx() else { return };
    // One 256-byte slot to start with, 600 dispatches recorded: the arena grows at submit.
    let arena = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("tiny arena"),
        size: 256,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut cache = IoBindCache::new(arena);
    let (n, k) = (3, 8);
    let (bytes, w) = weight_bytes(&rand(n * k, 77, 1.0), Dtype::F32);
    let gw = GpuWeight::upload(&ctx, "w", Dtype::F32, n, k, &bytes, u64::MAX).expect("weight");
    let x = rand(k, 78, 1.0);
    let (xb, yb) = (upload(&ctx, &x), upload(&ctx, &[0.0; 3]));
    let io = LinearIo { x: &xb, x_offset: 0, m: 1, y: &yb, y_offset: 0, y_stride: n, accumulate: true };
    let mut rec = Recorder::new(&ctx, &mut cache);
    for _ in 0..600 {
        linear(&mut rec, &gw, &io, None).expect("record");
    }
    rec.submit().expect("submit");
    assert!(cache.params().size() >= 600 * 256, "arena grew to {}", cache.params().size());
    let want: Vec<f32> = cpu::linear(&x, &w, 1, n, k).iter().map(|v| v * 600.0).collect();
    assert_close("600 accumulated matvecs", &read(&ctx, &yb, n), &want, ACCUMULATED_ATOL, ACCUMULATED_RTOL);
}

/// AdamW after a gradient with an infinite or NaN element updates nothing (its squares' sum,
/// which the clip reads, is not finite); the same step with that element finite updates every
/// weight and both moments.
#[test]
fn adamw_takes_no_step_on_a_non_finite_gradient() {
    use qwen35_wgpu::kernels::learn::{adamw, sum_squares, AdamParams, AdamTensor};
    let Some(ctx) = gpu() else { return };
    let n = 300;
    let (w0, m0, v0) = (rand(n, 1, 1.0), rand(n, 2, 0.1), rand(n, 3, 0.1).iter().map(|x| x.abs()).collect::<Vec<_>>());
    for bad in [f32::NAN, f32::INFINITY, 1.0] {
        let mut g = rand(n, 4, 1.0);
        g[123] = bad;
        let (grad, param, m, v, anchor) =
            (upload(&ctx, &g), upload(&ctx, &w0), upload(&ctx, &m0), upload(&ctx, &v0), upload(&ctx, &w0));
        let norms = upload(&ctx, &[0.0]);
        let params = AdamParams {
            n: n as u32,
            slot: 0,
            slots: 1,
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            bc1: 0.1,
            bc2: 0.01,
            max_norm: 1.0,
            ..Default::default()
        };
        let t = AdamTensor { grad: &grad, param: &param, m: &m, v: &v, anchor: &anchor };
        run(&ctx, |rec| {
            sum_squares(rec, &grad, &norms, n, 0)?;
            adamw(rec, &t, &norms, &params)
        });
        let (w, m1, m2) = (read(&ctx, &param, n), read(&ctx, &m, n), read(&ctx, &v, n));
        if bad.is_finite() {
            assert!(w.iter().zip(&w0).all(|(a, b)| a != b), "a finite gradient moves every weight");
            assert!(m1 != m0 && m2 != v0, "and both moments");
        } else {
            assert_eq!((w, m1, m2), (w0.clone(), m0.clone(), v0.clone()), "a {bad} gradient element changes nothing");
        }
    }
}
