// dx[m, k] (+)= scale * sum_n dy[m, n] * w[n, k]: the input gradient of nn.Linear (y = x W^T), i.e. the
// product with W itself rather than W^T. 64x64 output tile (tokens x input features) per
// workgroup, 4x4 per invocation, reduction over the output features n in steps of 16; both tiles
// are staged from rows read along their contiguous axis, as vectors of 4. f32 accumulation.
//
// dy: f32 [M, *] (row stride dy_stride; this weight chunk's column n starts at dy_offset + n).
// w:  one row-chunk of the weight in its checkpoint dtype (the decoder: weights.wgsl), [N, K];
//     the rows used start at w_row (so one LoRA A of a concatenated group can be selected).
// dx: f32 [M, K] (row stride dx_stride, starting dx_offset).
//
// A short, wide reduction (few tokens and inputs, many outputs: lm_head's vocabulary) gives too
// few tiles to fill a GPU, so the grid's z splits n into slices of n_span rows: slice z writes its
// partial product to dx at z * slice_stride (a scratch buffer, never accumulating), and
// matmul_dx_sum adds the slices into the real dx in a fixed order. Unsplit: n_span = n, one slice.

override ACCUMULATE: bool = false;

struct Params {
    m: u32,
    n: u32,
    k: u32,
    dy_offset: u32,
    dy_stride: u32,
    dx_offset: u32,
    dx_stride: u32,
    w_row: u32,
    scale: f32,
    q_sb: u32,       // affine weights: the u32 index of the chunk's scales and biases
    n_span: u32,     // rows of n one slice (grid z) reduces; matmul_dx_sum: unused
    slice_stride: u32, // floats between two slices' outputs (matmul_dx) or inputs (matmul_dx_sum)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> dy: array<f32>;
@group(0) @binding(2) var<storage, read_write> dx: array<f32>;

fn weight(idx: u32) -> f32 {
    return weight_elem(idx, p.q_sb);
}

const TILE: u32 = 64u;
const TILE4: u32 = 16u; // TILE / 4
const BN: u32 = 16u;

// n-major tiles of four-element vectors, so one K step reads a vector of each per 16 FMAs.
var<workgroup> ys: array<vec4<f32>, 256>; // [BN][TILE / 4]: dy, 4 consecutive rows a vector
var<workgroup> ws: array<vec4<f32>, 256>; // [BN][TILE / 4]: w, 4 consecutive columns a vector

@compute @workgroup_size(16, 16)
fn matmul_dx(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let row0 = wg.y * TILE;
    let col0 = wg.x * TILE;
    let n_lo = wg.z * p.n_span;
    let n_hi = min(p.n, n_lo + p.n_span);
    let live = row0 + lid.y * 4u < p.m;
    var acc: array<vec4<f32>, 4>; // rows lid.y * 4 + i, columns lid.x * 4 .. + 4
    for (var n0 = n_lo; n0 < n_hi; n0 += BN) {
        for (var e = 0u; e < 4u; e++) {
            let idx = li + e * 256u;
            // dy tile: 64 rows x 16 n, read along n.
            let r = idx / BN;
            let nn = idx % BN;
            var yv = 0.0;
            if (row0 + r < p.m && n0 + nn < n_hi) {
                yv = dy[p.dy_offset + (row0 + r) * p.dy_stride + n0 + nn];
            }
            ys[nn * TILE4 + (r >> 2u)][r & 3u] = yv;
            // w tile: 16 n x 64 k, read along k.
            let wn = idx / TILE;
            let c = idx % TILE;
            var wv = 0.0;
            if (n0 + wn < n_hi && col0 + c < p.k) {
                wv = weight((p.w_row + n0 + wn) * p.k + col0 + c);
            }
            ws[wn * TILE4 + (c >> 2u)][c & 3u] = wv;
        }
        workgroupBarrier();
        // The tile's rows past m (a response shorter than the tile) are staged as zeros and never
        // computed: the condition is the same for the 16 consecutive invocations of a tile row,
        // so whole subgroups skip their FMAs. No barrier sits under it, and control flow rejoins
        // before the next (a loop leaving on `live` would make the barriers non-uniform).
        if (live) {
            for (var nn = 0u; nn < BN; nn++) {
                let a = ys[nn * TILE4 + lid.y];
                let b = ws[nn * TILE4 + lid.x];
                acc[0] = fma(vec4<f32>(a.x), b, acc[0]);
                acc[1] = fma(vec4<f32>(a.y), b, acc[1]);
                acc[2] = fma(vec4<f32>(a.z), b, acc[2]);
                acc[3] = fma(vec4<f32>(a.w), b, acc[3]);
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + lid.y * 4u + i;
        for (var j = 0u; j < 4u; j++) {
            let c = col0 + lid.x * 4u + j;
            if (r < p.m && c < p.k) {
                let o = p.dx_offset + wg.z * p.slice_stride + r * p.dx_stride + c;
                let v = acc[i][j] * p.scale;
                if (ACCUMULATE) {
                    dx[o] = dx[o] + v;
                } else {
                    dx[o] = v;
                }
            }
        }
    }
}

// dx[m, k] (+)= sum of the p.n slices of a split matmul_dx, bound as dy: slice z holds row r at
// dy_offset + z * slice_stride + r * k. One invocation per output, slices added in order. The
// forward matmul's split reduction (matmul.wgsl) sums its slices here too (dx: its y, k: its n).
@compute @workgroup_size(64)
fn matmul_dx_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.m * p.k) {
        return;
    }
    var s = 0.0;
    for (var z = 0u; z < p.n; z++) {
        s += dy[p.dy_offset + z * p.slice_stride + i];
    }
    let o = p.dx_offset + (i / p.k) * p.dx_stride + i % p.k;
    if (ACCUMULATE) {
        dx[o] = dx[o] + s;
    } else {
        dx[o] = s;
    }
}
