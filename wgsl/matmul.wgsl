// y[m, n] (+)= sum_k x[m, k] * w[n, k]  [+ s * sum_j t[m, j] * B[n, j]]
//
// nn.Linear (y = x W^T) over several rows of x (prefill; one row runs matvec.wgsl), optionally with the LoRA expand fused in: t = x A^T is computed by a
// separate shrink dispatch (shared by the projections that read the same input), and the rank-r
// product s * t B^T is folded into the same accumulators as extra K steps, so an active adapter
// costs no extra pass over y. The `*_lora` entry points are the only ones that touch t and B: with
// no adapter the plain entry points run, bit-identical to a model without LoRA.
//
// x: f32 activations [M, K] (row stride x_stride, starting x_offset).
// w: one row-chunk of a weight in its checkpoint dtype, packed in u32 words, [N, K] row-major.
// y: f32 [M, *] (row stride y_stride, starting y_offset; a chunk's first row lands at column
//    y_offset % y_stride, so a weight split across bindings writes into one output).
// t: f32 [M, lora_t_stride], this projection's rank columns start at lora_t_offset.
// B: f32 [rows of the whole projection, lora_rank]; this chunk's rows start at lora_row_offset.
// Accumulation is f32. ACCUMULATE adds into y (the residual add of o_proj/out_proj/down_proj).

override W_DTYPE: u32 = 0u;      // 0 = f32, 1 = bf16, 2 = f16
override ACCUMULATE: bool = false;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    lora_rank: u32,
    lora_t_offset: u32,
    lora_t_stride: u32,
    lora_row_offset: u32,
    lora_scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> t: array<f32>;
@group(1) @binding(0) var<storage, read> w: array<u32>;
@group(2) @binding(0) var<storage, read> lora_b: array<f32>;

fn weight(idx: u32) -> f32 {
    if (W_DTYPE == 1u) {
        let word = w[idx >> 1u];
        return bitcast<f32>(((word >> ((idx & 1u) * 16u)) & 0xffffu) << 16u);
    }
    if (W_DTYPE == 2u) {
        return unpack2x16float(w[idx >> 1u])[idx & 1u];
    }
    return bitcast<f32>(w[idx]);
}

fn store(idx: u32, v: f32) {
    if (ACCUMULATE) {
        y[idx] = y[idx] + v;
    } else {
        y[idx] = v;
    }
}

// ---- batched (prefill): 64x64 output tile per workgroup, 4x4 per invocation, K steps of 16 ----

const TILE: u32 = 64u;
const BK: u32 = 16u;

var<workgroup> xs: array<f32, 1024>; // [BK][TILE], k-major
var<workgroup> ws: array<f32, 1024>; // [BK][TILE], k-major

// acc += xs^T ws over one staged K step.
fn fma_tile(acc: ptr<function, array<f32, 16>>, lid: vec3<u32>) {
    for (var kk = 0u; kk < BK; kk++) {
        let a = vec4<f32>(
            xs[kk * TILE + lid.y * 4u], xs[kk * TILE + lid.y * 4u + 1u],
            xs[kk * TILE + lid.y * 4u + 2u], xs[kk * TILE + lid.y * 4u + 3u]);
        let b = vec4<f32>(
            ws[kk * TILE + lid.x * 4u], ws[kk * TILE + lid.x * 4u + 1u],
            ws[kk * TILE + lid.x * 4u + 2u], ws[kk * TILE + lid.x * 4u + 3u]);
        for (var i = 0u; i < 4u; i++) {
            (*acc)[i * 4u] = fma(a[i], b.x, (*acc)[i * 4u]);
            (*acc)[i * 4u + 1u] = fma(a[i], b.y, (*acc)[i * 4u + 1u]);
            (*acc)[i * 4u + 2u] = fma(a[i], b.z, (*acc)[i * 4u + 2u]);
            (*acc)[i * 4u + 3u] = fma(a[i], b.w, (*acc)[i * 4u + 3u]);
        }
    }
}

fn base_tile(acc: ptr<function, array<f32, 16>>, wg: vec3<u32>, lid: vec3<u32>, li: u32) {
    let row0 = wg.y * TILE;
    let col0 = wg.x * TILE;
    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        for (var e = 0u; e < 4u; e++) {
            let idx = li + e * 256u;
            let r = idx / BK;
            let kk = idx % BK;
            let kg = k0 + kk;
            var xv = 0.0;
            if (row0 + r < p.m && kg < p.k) {
                xv = x[p.x_offset + (row0 + r) * p.x_stride + kg];
            }
            xs[kk * TILE + r] = xv;
            var wv = 0.0;
            if (col0 + r < p.n && kg < p.k) {
                wv = weight((col0 + r) * p.k + kg);
            }
            ws[kk * TILE + r] = wv;
        }
        workgroupBarrier();
        fma_tile(acc, lid);
        workgroupBarrier();
    }
}

// The LoRA expand as extra K steps: x' = s * t[:, offset..offset + r], w' = B.
fn lora_tile(acc: ptr<function, array<f32, 16>>, wg: vec3<u32>, lid: vec3<u32>, li: u32) {
    let row0 = wg.y * TILE;
    let col0 = wg.x * TILE;
    for (var k0 = 0u; k0 < p.lora_rank; k0 += BK) {
        for (var e = 0u; e < 4u; e++) {
            let idx = li + e * 256u;
            let r = idx / BK;
            let kk = idx % BK;
            let j = k0 + kk;
            var tv = 0.0;
            if (row0 + r < p.m && j < p.lora_rank) {
                tv = t[(row0 + r) * p.lora_t_stride + p.lora_t_offset + j] * p.lora_scale;
            }
            xs[kk * TILE + r] = tv;
            var bv = 0.0;
            if (col0 + r < p.n && j < p.lora_rank) {
                bv = lora_b[(p.lora_row_offset + col0 + r) * p.lora_rank + j];
            }
            ws[kk * TILE + r] = bv;
        }
        workgroupBarrier();
        fma_tile(acc, lid);
        workgroupBarrier();
    }
}

fn store_tile(acc: ptr<function, array<f32, 16>>, wg: vec3<u32>, lid: vec3<u32>) {
    for (var i = 0u; i < 4u; i++) {
        let r = wg.y * TILE + lid.y * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let c = wg.x * TILE + lid.x * 4u + j;
            if (r < p.m && c < p.n) {
                store(p.y_offset + r * p.y_stride + c, (*acc)[i * 4u + j]);
            }
        }
    }
}

@compute @workgroup_size(16, 16)
fn matmul(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    var acc: array<f32, 16>;
    base_tile(&acc, wg, lid, li);
    store_tile(&acc, wg, lid);
}

@compute @workgroup_size(16, 16)
fn matmul_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    var acc: array<f32, 16>;
    base_tile(&acc, wg, lid, li);
    lora_tile(&acc, wg, lid, li);
    store_tile(&acc, wg, lid);
}
