// Row-wise RMS norms, one workgroup per row, f32 throughout.
//
// rms_norm:       y = x * rsqrt(mean(x^2) + eps) * (1 + w)      (Qwen3_5RMSNorm, zero-centred w)
// rms_norm_gated: v = v * rsqrt(mean(v^2) + eps) * w * silu(z)  (Qwen3_5RMSNormGated, plain w), in place

struct Params {
    n: u32,          // row length
    rows: u32,
    x_offset: u32,
    x_stride: u32,
    y_offset: u32,
    y_stride: u32,
    eps: f32,
    _pad: u32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;      // rms_norm: input; gated: z
@group(0) @binding(2) var<storage, read_write> y: array<f32>; // rms_norm: output; gated: v (in place)
@group(1) @binding(0) var<storage, read> w: array<f32>;

var<workgroup> red: array<f32, 64>;

fn row_index(wg: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wg.y * nwg.x + wg.x;
}

fn inv_rms(sumsq: f32, li: u32) -> f32 {
    red[li] = sumsq;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    return inverseSqrt(red[0] / f32(p.n) + p.eps);
}

@compute @workgroup_size(64)
fn rms_norm(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = row_index(wg, nwg);
    let live = row < p.rows;
    let xb = p.x_offset + row * p.x_stride;
    var ss = 0.0;
    if (live) {
        for (var i = li; i < p.n; i += WG) {
            let v = x[xb + i];
            ss = fma(v, v, ss);
        }
    }
    let scale = inv_rms(ss, li);
    if (live) {
        let yb = p.y_offset + row * p.y_stride;
        for (var i = li; i < p.n; i += WG) {
            y[yb + i] = x[xb + i] * scale * (1.0 + w[i]);
        }
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
