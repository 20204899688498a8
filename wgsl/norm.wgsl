// Row-wise RMS norms, one workgroup per row (rms_norm_shrink: per row and 8 rows of A), f32 throughout.
//
// rms_norm:       y = x * rsqrt(mean(x^2) + eps) * (1 + w)      (Qwen3_5RMSNorm, zero-centred w)
// rms_norm_gated: v = v * rsqrt(mean(v^2) + eps) * w * silu(z)  (Qwen3_5RMSNormGated, plain w), in place
// rms_norm_shrink: rms_norm, and the LoRA shrink of the normalised row, t[r] = y . A[r] for
//                  r < rank (one dispatch where an unfused decode step took two: the norm and the
//                  shrink of the input group that reads it)

struct Params {
    n: u32,          // row length
    rows: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    eps: f32,
    rank: u32,       // rms_norm_shrink: rows of A (otherwise 0)
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;      // rms_norm: input; gated: z
@group(0) @binding(2) var<storage, read_write> y: array<f32>; // rms_norm: output; gated: v (in place)
@group(0) @binding(3) var<storage, read_write> t: array<f32>; // rms_norm_shrink: [rows, rank]
@group(1) @binding(0) var<storage, read> w: array<f32>;
@group(2) @binding(0) var<storage, read> lora_a: array<vec4<f32>>; // rms_norm_shrink: A f32 [rank, n]

var<workgroup> tred: array<vec4<f32>, 128>; // rms_norm_shrink: [2][WG] partial dots of 8 rows of A

fn row_index(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.y * nwg.x + wg.x;
}

fn inv_rms(sumsq: f32, li: u32) -> f32 {
    return inverseSqrt(reduce_sum(sumsq, li) / f32(p.n) + p.eps);
}

// The scale rsqrt(mean(x^2) + eps) of row `row`, and the normalised row into y when `store`
// (both only when `live`).
fn norm_row(row: u32, live: bool, store: bool, li: u32) -> f32 {
    let xb = p.x_offset + row * p.x_stride;
    var ss = 0.0;
    if (live) {
        for (var i = li; i < p.n; i += WG) {
            let v = x[xb + i];
            ss = fma(v, v, ss);
        }
    }
    let scale = inv_rms(ss, li);
    if (live && store) {
        let yb = p.y_offset + row * p.y_stride;
        for (var i = li; i < p.n; i += WG) {
            y[yb + i] = x[xb + i] * scale * (1.0 + w[i]);
        }
    }
    return scale;
}

@compute @workgroup_size(64)
fn rms_norm(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = row_index(wg, nwg);
    norm_row(row, row < p.rows, true, li);
}

// The normalised values of elements 4q..4q+3 of the row starting at x element xb (recomputed
// from x and w rather than read back from y, which other invocations wrote).
fn normed4(xb: u32, q: u32, scale: f32) -> vec4<f32> {
    let e = 4u * q;
    let xv = vec4<f32>(x[xb + e], x[xb + e + 1u], x[xb + e + 2u], x[xb + e + 3u]);
    let wv = vec4<f32>(w[e], w[e + 1u], w[e + 2u], w[e + 3u]);
    return xv * scale * (1.0 + wv);
}

// rms_norm, then the shrink of the row (n a multiple of 4, A in one binding: the host checks).
// Workgroup (g, row) computes rows 8g..8g+7 of A's product with the row (rows past the rank
// clamped to the last, never stored): every workgroup of the row finds the norm's scale, the
// first also writes y; each invocation dots its columns (vec4 q = li, li + WG, ...) of the
// normalised row with the 8 rows of A, one barrier, and invocation i < 8 sums the WG partials of
// row i.
@compute @workgroup_size(64)
fn rms_norm_shrink(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wg.y;
    let r0 = 8u * wg.x;
    let live = row < p.rows;
    let scale = norm_row(row, live, wg.x == 0u, li);
    let xb = p.x_offset + row * p.x_stride;
    let cols = p.n / 4u;
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    if (live) {
        var a: array<u32, 8>;
        for (var i = 0u; i < 8u; i++) {
            a[i] = min(r0 + i, p.rank - 1u) * cols;
        }
        for (var q = li; q < cols; q += WG) {
            let v = normed4(xb, q, scale);
            lo += vec4<f32>(dot(lora_a[a[0] + q], v), dot(lora_a[a[1] + q], v), dot(lora_a[a[2] + q], v), dot(lora_a[a[3] + q], v));
            hi += vec4<f32>(dot(lora_a[a[4] + q], v), dot(lora_a[a[5] + q], v), dot(lora_a[a[6] + q], v), dot(lora_a[a[7] + q], v));
        }
    }
    tred[li] = lo;
    tred[WG + li] = hi;
    workgroupBarrier();
    if (live && li < 8u && r0 + li < p.rank) {
        var sum = 0.0;
        for (var j = 0u; j < WG; j++) {
            sum += tred[(li / 4u) * WG + j][li % 4u];
        }
        t[row * p.rank + r0 + li] = sum;
    }
}

@compute @workgroup_size(64)
fn rms_norm_gated(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = row_index(wg, nwg);
    let live = row < p.rows;
    let yb = p.y_offset + row * p.y_stride;
    var ss = 0.0;
    if (live) {
        for (var i = li; i < p.n; i += WG) {
            let v = y[yb + i];
            ss = fma(v, v, ss);
        }
    }
    let scale = inv_rms(ss, li);
    if (live) {
        let zb = p.x_offset + row * p.x_stride;
        for (var i = li; i < p.n; i += WG) {
            let z = x[zb + i];
            y[yb + i] = y[yb + i] * scale * w[i] * silu(z);
        }
    }
}
