// y[n] (+)= sum_k w[n, k] * x[k]  [+ s * sum_j t[j] * B[n, j]]   (one token: decode)
//
// nn.Linear for a single row of x, with the LoRA expand optionally fused in (the shrink t = x A^T
// is a separate dispatch shared by the projections of an input group).
//
// Layout: a workgroup of 64 invocations is 64 / LANES row groups of LANES invocations. Each
// invocation owns TM = 8 consecutive rows; the LANES invocations of a row group stride along K
// together, each loading one vec4<u32> of weights per row and step (8 bf16/f16 or 4 f32 weights,
// 16 contiguous bytes, neighbouring invocations reading neighbouring 16 bytes), so the x chunk it
// loads is kept in registers and reused for its 8 rows. Rows per workgroup = 8 * 64 / LANES
// (LANES 16: 32 rows, LANES 32: 16 rows), chosen per shape by the host. Rows past the end are
// clamped to the last row (computed, never stored), so the loop has no bound tests. The partial
// sums of a row are reduced through workgroup memory after one barrier.
//
// Rows are 16-byte aligned when K is a multiple of the weights per vec4 (8 for 16-bit, 4 for f32);
// other K (and an x offset that is not a multiple of 4) take an element-wise path with the same
// layout.
//
// x: f32 [K] from element x_offset. w: this weight chunk [N, K] in its checkpoint dtype, packed in
// u32 words. y: f32, this chunk's row 0 lands at y_offset. t, B as in matmul.wgsl.

override W_DTYPE: u32 = 0u;      // 0 = f32, 1 = bf16, 2 = f16
override ACCUMULATE: bool = false;
override LANES: u32 = 32u;       // invocations along K per row group: 16 or 32

const WG: u32 = 64u;
const TM: u32 = 8u;

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
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> t: array<f32>;
@group(1) @binding(0) var<storage, read> w: array<vec4<u32>>;
@group(2) @binding(0) var<storage, read> lora_b: array<f32>;

var<workgroup> red: array<f32, 512>; // [rows of the workgroup][LANES] = TM * WG floats

struct Slot {
    row0: u32, // first row of the workgroup
    group: u32, // row group of this invocation
    lane: u32, // position along K within the row group
}

fn slot(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> Slot {
    let rows = TM * (WG / LANES);
    return Slot((wg.y * nwg.x + wg.x) * rows, li / LANES, li % LANES);
}

// Row r of this invocation, clamped into the chunk.
fn row_of(s: Slot, r: u32) -> u32 {
    return min(s.row0 + s.group * TM + r, p.n - 1u);
}

fn x_at(e: u32) -> f32 {
    return x[e >> 2u][e & 3u];
}

// Flat element e of the chunk (element-wise path).
fn weight_at(e: u32) -> f32 {
    if (W_DTYPE == 0u) {
        return bitcast<f32>(w[e >> 2u][e & 3u]);
    }
    let word = w[e >> 3u][(e >> 1u) & 3u];
    if (W_DTYPE == 1u) {
        return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (e & 1u) == 1u));
    }
    return unpack2x16float(word)[e & 1u];
}

// Eight 16-bit weights of one vec4<u32>: even elements (low halves) and odd ones (high halves).
fn even_odd(v: vec4<u32>) -> array<vec4<f32>, 2> {
    if (W_DTYPE == 1u) {
        return array<vec4<f32>, 2>(bitcast<vec4<f32>>(v << vec4<u32>(16u)), bitcast<vec4<f32>>(v & vec4<u32>(0xffff0000u)));
    }
    let a = unpack2x16float(v.x);
    let b = unpack2x16float(v.y);
    let c = unpack2x16float(v.z);
    let d = unpack2x16float(v.w);
    return array<vec4<f32>, 2>(vec4<f32>(a.x, b.x, c.x, d.x), vec4<f32>(a.y, b.y, c.y, d.y));
}

fn base_partials(s: Slot) -> array<f32, 8> {
    var acc: array<f32, 8>;
    var rows: array<u32, 8>;
    for (var r = 0u; r < TM; r++) {
        rows[r] = row_of(s, r);
    }
    let per_vec = select(4u, 8u, W_DTYPE != 0u);
    if ((p.k % per_vec) == 0u && (p.x_offset & 3u) == 0u) {
        let row_vecs = p.k / per_vec;
        let x4 = p.x_offset >> 2u;
        for (var j = s.lane; j < row_vecs; j += LANES) {
            if (W_DTYPE == 0u) {
                let xv = x[x4 + j];
                for (var r = 0u; r < TM; r++) {
                    acc[r] += dot(bitcast<vec4<f32>>(w[rows[r] * row_vecs + j]), xv);
                }
            } else {
                let xa = x[x4 + 2u * j];
                let xb = x[x4 + 2u * j + 1u];
                let xe = vec4<f32>(xa.x, xa.z, xb.x, xb.z);
                let xo = vec4<f32>(xa.y, xa.w, xb.y, xb.w);
                for (var r = 0u; r < TM; r++) {
                    let wv = even_odd(w[rows[r] * row_vecs + j]);
                    acc[r] += dot(wv[0], xe) + dot(wv[1], xo);
                }
            }
        }
        return acc;
    }
    for (var e = s.lane; e < p.k; e += LANES) {
        let xv = x_at(p.x_offset + e);
        for (var r = 0u; r < TM; r++) {
            acc[r] = fma(weight_at(rows[r] * p.k + e), xv, acc[r]);
        }
    }
    return acc;
}

// Adds this invocation's share of s * t . B[row] to its partials.
fn add_lora(s: Slot, acc: ptr<function, array<f32, 8>>) {
    for (var j = s.lane; j < p.lora_rank; j += LANES) {
        let tv = t[p.lora_t_offset + j] * p.lora_scale;
        for (var r = 0u; r < TM; r++) {
            let row = p.lora_row_offset + row_of(s, r);
            (*acc)[r] = fma(lora_b[row * p.lora_rank + j], tv, (*acc)[r]);
        }
    }
}

fn reduce_store(s: Slot, acc: array<f32, 8>, li: u32) {
    for (var r = 0u; r < TM; r++) {
        red[(s.group * TM + r) * LANES + s.lane] = acc[r];
    }
    workgroupBarrier();
    let rows = TM * (WG / LANES);
    if (li < rows && s.row0 + li < p.n) {
        var sum = 0.0;
        for (var l = 0u; l < LANES; l++) {
            sum += red[li * LANES + l];
        }
        let idx = p.y_offset + s.row0 + li;
        if (ACCUMULATE) {
            y[idx] = y[idx] + sum;
        } else {
            y[idx] = sum;
        }
    }
}

@compute @workgroup_size(64)
fn matvec(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    reduce_store(s, base_partials(s), li);
}

@compute @workgroup_size(64)
fn matvec_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let s = slot(wg, nwg, li);
    var acc = base_partials(s);
    add_lora(s, &acc);
    reduce_store(s, acc, li);
}
