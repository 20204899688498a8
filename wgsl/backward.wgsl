// Backward of the row-wise layers of the MLP block, f32 throughout.
//
// rms_norm_bwd (one workgroup per row): for y = x * r * (1 + w), r = rsqrt(mean(x^2) + eps),
//   dx (+)= r * (1 + w) * dy - x * r^3 / n * sum_j x_j (1 + w_j) dy_j
// swiglu_bwd (elementwise): for a = silu(g) * u, with s = sigmoid(g),
//   dg = da * u * s * (1 + g * (1 - s)),  du = da * silu(g); dg overwrites da.

struct Params {
    n: u32,          // rms_norm_bwd: row length; swiglu_bwd: element count
    rows: u32,
    x_offset: u32,   // first element of x (rows of length n, contiguous)
    dy_offset: u32,
    dx_offset: u32,
    accumulate: u32,
    eps: f32,
    _pad: u32,
}

const WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src0: array<f32>;        // x | g
@group(0) @binding(2) var<storage, read> src1: array<f32>;        // dy | u
@group(0) @binding(3) var<storage, read_write> dst0: array<f32>;  // dx | da -> dg
@group(0) @binding(4) var<storage, read_write> dst1: array<f32>;  // (unused) | du
@group(1) @binding(0) var<storage, read> w: array<f32>;           // rms_norm_bwd only

@compute @workgroup_size(64)
fn rms_norm_bwd(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row = wg.y * nwg.x + wg.x;
    let live = row < p.rows;
    let xb = p.x_offset + row * p.n;
    let yb = p.dy_offset + row * p.n;
    var ss = 0.0;
    var dot = 0.0;
    if (live) {
        for (var i = li; i < p.n; i += WG) {
            let v = src0[xb + i];
            ss = fma(v, v, ss);
            dot = fma(v * (1.0 + w[i]), src1[yb + i], dot);
        }
    }
    ss = reduce_sum(ss, li);
    dot = reduce_sum(dot, li);
    if (!live) {
        return;
    }
    let r = inverseSqrt(ss / f32(p.n) + p.eps);
    let c = r * r * r * dot / f32(p.n);
    let ob = p.dx_offset + row * p.n;
    for (var i = li; i < p.n; i += WG) {
        var v = r * (1.0 + w[i]) * src1[yb + i] - src0[xb + i] * c;
        if (p.accumulate != 0u) {
            v += dst0[ob + i];
        }
        dst0[ob + i] = v;
    }
}

@compute @workgroup_size(64)
fn swiglu_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.n) {
        return;
    }
    let g = src0[i];
    let u = src1[i];
    let da = dst0[i];
    let s = sigmoid(g);
    dst0[i] = da * u * s * (1.0 + g * (1.0 - s));
    dst1[i] = da * g * s;
}
