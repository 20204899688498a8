// y[m, n] (+)= sum_k x[m, k] * w[n, k]  [+ s * sum_j t[m, j] * B[n, j]]
//
// nn.Linear (y = x W^T) over several rows of x (prefill; one row runs matvec.wgsl), optionally
// with the LoRA expand fused in: t = x A^T is computed by a separate shrink dispatch (shared by
// the projections that read the same input), and the rank-r product s * t B^T is folded into the
// same accumulators as extra K steps, so an active adapter costs no extra pass over y. The
// `*_lora` entry points are the only ones that touch t and B: with no adapter the plain entry
// points run, bit-identical to a model without LoRA.
//
// Parameters, bindings and the weight decoder: linear.wgsl.
//
// Tiling: a workgroup of 16 x TM / 8 invocations computes a TM x TN tile of y (TM tokens, TN
// outputs), stepping K by BK = 16; every invocation owns RM = 8 consecutive tile rows by 4 or 8
// columns. TM is 128, or 64, 32 or 16 for short prompts, chosen by the host so little of a tile
// is padding (invocations whose rows all lie past the prompt skip their FMAs, and those rows are
// never loaded). A short prompt's tile keeps the 8-row register tile in a smaller workgroup
// (128, 64 or 32 invocations) rather than fewer rows per invocation, so every tile issues as
// many FMAs per workgroup-memory load as the long prompt's. TN is 128 (8 columns per invocation)
// where the grid of such tiles still fills the device, else 64 (4 columns). With TN = 128 an
// invocation issues 4 vec4 workgroup loads per 16 vec4 FMAs (TN = 64: 3 per 8), with 16 KiB of
// workgroup memory.
// Each step's x and w tiles are staged k-major in workgroup memory: a staging chunk is 8
// consecutive k of one tile row (two vec4<f32> of x; one vec4<u32> = 8 16-bit weights, or two of
// f32, for w), widened once; invocation li takes x chunk li (the first 2 TM invocations) and w
// chunks li, li + WG, ... (all 2 TN of them), so neighbouring invocations take neighbouring rows,
// the transposed stores hit consecutive words (no bank conflicts) and the compute loop reads
// whole vec4. An invocation's columns are lid.x * 4 .. + 4 and, with TN = 128, 64 + lid.x * 4 ..
// + 4, so the 16 lanes of a row read consecutive vec4. The loads for step s + 1 are issued into
// registers before step s is computed. When K is not a multiple of 8 or x is not 16-byte
// aligned, tiles are staged element by element.
//
// Split K: where the grid of tiles is too small to fill the device (few outputs: the narrow
// residual projections, the LoRA shrinks, GDN's b and a), the host splits the reduction into
// slices of k_span inputs (a multiple of BK), one per workgroup z. Slice z reduces inputs
// z * k_span .. + k_span and stores its partial tile at y_offset + z * m * y_stride (a scratch
// buffer, never accumulating); a second dispatch adds the slices into y in order. The LoRA expand
// is added by slice 0 only. Unsplit: k_span = k, one slice.

override TM: u32 = 128u; // tile rows (tokens): 128, 64, 32 or 16
override TN: u32 = 64u;  // tile columns (outputs): 64 or 128
const RM: u32 = 8u;                                 // tile rows per invocation
override WG: u32 = 16u * TM / RM;                   // invocations per workgroup: 256 to 32
override W_CHUNKS: u32 = (2u * TN + WG - 1u) / WG; // w staging chunks per invocation: 1 to 8
const MAX_W_CHUNKS: u32 = 8u;
const BK: u32 = 16u;

var<workgroup> xs: array<vec4<f32>, 512>; // [BK][TM / 4] (room for TM = 128): 4 tile rows per vec4
var<workgroup> ws: array<vec4<f32>, 512>; // [BK][TN / 4] (room for TN = 128): 4 tile columns per vec4

fn put_x(kk: u32, r: u32, v: f32) {
    xs[kk * (TM / 4u) + (r >> 2u)][r & 3u] = v;
}

fn put_w(kk: u32, c: u32, v: f32) {
    ws[kk * (TN / 4u) + (c >> 2u)][c & 3u] = v;
}

// Whether any of the invocation's tile rows is one of the m rows: the rows of a tile past m
// (the last tile of a prompt that does not fill it) are staged as zeros and never computed; the
// condition is the same for the 16 invocations of a tile row, which are consecutive, so whole
// subgroups skip their FMAs. No barrier sits under it.
fn live_rows(row0: u32, lid: vec3<u32>) -> bool {
    return row0 + lid.y * RM < p.m;
}

// acc += xs^T ws over one staged K step: rows lid.y * RM .. + RM, columns lid.x * 4 .. + 4
// (acc[0..8]) and, with TN = 128, 64 + lid.x * 4 .. + 4 (acc[8..16]).
fn fma_tile(acc: ptr<function, array<vec4<f32>, 16>>, lid: vec3<u32>) {
    for (var kk = 0u; kk < BK; kk++) {
        let a = xs[kk * (TM / 4u) + 2u * lid.y];
        let a2 = xs[kk * (TM / 4u) + 2u * lid.y + 1u];
        let b = ws[kk * (TN / 4u) + lid.x];
        (*acc)[0] = fma(vec4<f32>(a.x), b, (*acc)[0]);
        (*acc)[1] = fma(vec4<f32>(a.y), b, (*acc)[1]);
        (*acc)[2] = fma(vec4<f32>(a.z), b, (*acc)[2]);
        (*acc)[3] = fma(vec4<f32>(a.w), b, (*acc)[3]);
        (*acc)[4] = fma(vec4<f32>(a2.x), b, (*acc)[4]);
        (*acc)[5] = fma(vec4<f32>(a2.y), b, (*acc)[5]);
        (*acc)[6] = fma(vec4<f32>(a2.z), b, (*acc)[6]);
        (*acc)[7] = fma(vec4<f32>(a2.w), b, (*acc)[7]);
        if (TN == 128u) {
            let b2 = ws[kk * (TN / 4u) + 16u + lid.x];
            (*acc)[8] = fma(vec4<f32>(a.x), b2, (*acc)[8]);
            (*acc)[9] = fma(vec4<f32>(a.y), b2, (*acc)[9]);
            (*acc)[10] = fma(vec4<f32>(a.z), b2, (*acc)[10]);
            (*acc)[11] = fma(vec4<f32>(a.w), b2, (*acc)[11]);
            (*acc)[12] = fma(vec4<f32>(a2.x), b2, (*acc)[12]);
            (*acc)[13] = fma(vec4<f32>(a2.y), b2, (*acc)[13]);
            (*acc)[14] = fma(vec4<f32>(a2.z), b2, (*acc)[14]);
            (*acc)[15] = fma(vec4<f32>(a2.w), b2, (*acc)[15]);
        }
    }
}

// Eight consecutive weights of a row from one vec4<u32> (16-bit), two (f32), or for affine
// weights their code word(s) in v.x (and v.y for 8-bit) and their group's word in v.z, widened.
fn eight(v: vec4<u32>, v2: vec4<u32>) -> array<f32, 8> {
    if (W_DTYPE == 3u) {
        let g = scale_bias(v.z);
        let c = codes(v.x);
        var upper = c[1];
        if (Q_BITS == 8u) {
            upper = codes(v.y)[0];
        }
        let a = fma(vec4<f32>(g.x), c[0], vec4<f32>(g.y));
        let b = fma(vec4<f32>(g.x), upper, vec4<f32>(g.y));
        return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
    }
    if (W_DTYPE == 0u) {
        let a = bitcast<vec4<f32>>(v);
        let b = bitcast<vec4<f32>>(v2);
        return array<f32, 8>(a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w);
    }
    if (W_DTYPE == 1u) {
        let lo = bitcast<vec4<f32>>(v << vec4<u32>(16u));
        let hi = bitcast<vec4<f32>>(v & vec4<u32>(0xffff0000u));
        return array<f32, 8>(lo.x, hi.x, lo.y, hi.y, lo.z, hi.z, lo.w, hi.w);
    }
    let a = unpack2x16float(v.x);
    let b = unpack2x16float(v.y);
    let c = unpack2x16float(v.z);
    let d = unpack2x16float(v.w);
    return array<f32, 8>(a.x, a.y, b.x, b.y, c.x, c.y, d.x, d.y);
}

// What one invocation stages per K step on the vector path: one x chunk and W_CHUNKS w chunks
// (wb: the second half of an f32 chunk).
struct Staged {
    xa: vec4<f32>,
    xb: vec4<f32>,
    wa: array<vec4<u32>, MAX_W_CHUNKS>,
    wb: array<vec4<u32>, MAX_W_CHUNKS>,
}

// Issue the loads of K step k0: x chunk li (< 2 TM) is row li % TM, k chunk li / TM (of 8);
// w chunk c = li + j * WG (< 2 TN) is row c % TN, k chunk c / TN.
fn load_step(k0: u32, k_hi: u32, row0: u32, col0: u32, li: u32) -> Staged {
    var s: Staged;
    let kx = k0 + (li / TM) * 8u;
    if (li < 2u * TM && kx < k_hi && row0 + li % TM < p.m) {
        let xe = (p.x_offset + (row0 + li % TM) * p.x_stride + kx) >> 2u;
        s.xa = x[xe];
        s.xb = x[xe + 1u];
    }
    for (var j = 0u; j < W_CHUNKS; j++) {
        let c = li + j * WG;
        let kw = k0 + (c / TN) * 8u;
        if (c >= 2u * TN || kw >= k_hi) {
            continue;
        }
        let wr = p.w_row0 + min(col0 + c % TN, p.n - 1u);
        if (W_DTYPE == 3u) {
            // Affine: the 8 codes in one word (4-bit) or two (8-bit), and their group's word.
            let e = wr * p.k + kw;
            let wi = e * Q_BITS / 32u;
            s.wa[j] = vec4<u32>(w_word(wi), 0u, w_word(p.q_sb + e / Q_GROUP), 0u);
            if (Q_BITS == 8u) {
                s.wa[j].y = w_word(wi + 1u);
            }
        } else if (W_DTYPE == 0u) {
            let we = (wr * p.k + kw) >> 2u;
            s.wa[j] = w[we];
            s.wb[j] = w[we + 1u];
        } else {
            s.wa[j] = w[(wr * p.k + kw) >> 3u];
        }
    }
    return s;
}

fn store_step(s: Staged, li: u32) {
    if (li < 2u * TM) {
        let xk = (li / TM) * 8u;
        let xv = array<f32, 8>(s.xa.x, s.xa.y, s.xa.z, s.xa.w, s.xb.x, s.xb.y, s.xb.z, s.xb.w);
        for (var i = 0u; i < 8u; i++) {
            put_x(xk + i, li % TM, xv[i]);
        }
    }
    for (var j = 0u; j < W_CHUNKS; j++) {
        let c = li + j * WG;
        if (c >= 2u * TN) {
            continue;
        }
        let wk = (c / TN) * 8u;
        let wv = eight(s.wa[j], s.wb[j]);
        for (var i = 0u; i < 8u; i++) {
            put_w(wk + i, c % TN, wv[i]);
        }
    }
}

// Element-wise staging of K step k0 (any K, any x offset), inputs below k_hi.
fn stage_elements(k0: u32, k_hi: u32, row0: u32, col0: u32, li: u32) {
    for (var idx = li; idx < BK * TM; idx += WG) {
        let r = idx % TM;
        let kk = idx / TM;
        let kg = k0 + kk;
        var xv = 0.0;
        if (kg < k_hi && row0 + r < p.m) {
            xv = x_elem(p.x_offset + (row0 + r) * p.x_stride + kg);
        }
        put_x(kk, r, xv);
    }
    for (var idx = li; idx < BK * TN; idx += WG) {
        let c = idx % TN;
        let kk = idx / TN;
        let kg = k0 + kk;
        var wv = 0.0;
        if (kg < k_hi) {
            wv = weight_at((p.w_row0 + min(col0 + c, p.n - 1u)) * p.k + kg);
        }
        put_w(kk, c, wv);
    }
}

// The tile's product over slice wg.z of the reduction.
fn base_tile(acc: ptr<function, array<vec4<f32>, 16>>, wg: vec3<u32>, lid: vec3<u32>, li: u32) {
    let row0 = wg.y * TM;
    let col0 = wg.x * TN;
    let k_lo = wg.z * p.k_span;
    let k_hi = min(p.k, k_lo + p.k_span);
    if ((p.k & 7u) == 0u && (p.x_offset & 3u) == 0u) {
        var next = load_step(k_lo, k_hi, row0, col0, li);
        for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
            workgroupBarrier();
            store_step(next, li);
            workgroupBarrier();
            next = load_step(k0 + BK, k_hi, row0, col0, li);
            if (live_rows(row0, lid)) {
                fma_tile(acc, lid);
            }
        }
        return;
    }
    for (var k0 = k_lo; k0 < k_hi; k0 += BK) {
        workgroupBarrier();
        stage_elements(k0, k_hi, row0, col0, li);
        workgroupBarrier();
        if (live_rows(row0, lid)) {
            fma_tile(acc, lid);
        }
    }
}

// The LoRA expand (segment 0) as extra K steps: x' = s * t[:, offset..offset + r], w' = B; in
// slice 0 of a split reduction only (wg.z is uniform, so are the barriers under it).
fn lora_tile(acc: ptr<function, array<vec4<f32>, 16>>, wg: vec3<u32>, lid: vec3<u32>, li: u32) {
    let row0 = wg.y * TM;
    let col0 = wg.x * TN;
    let rank = select(p.seg_rank.x, 0u, wg.z > 0u);
    for (var k0 = 0u; k0 < rank; k0 += BK) {
        workgroupBarrier();
        for (var idx = li; idx < BK * TM; idx += WG) {
            let r = idx % TM;
            let j = k0 + idx / TM;
            var tv = 0.0;
            if (j < rank && row0 + r < p.m) {
                let m = row0 + r;
                tv = t_elem(m * p.lora_t_stride + p.seg_t.x + j) * p.seg_scale.x;
                if (p.lora_sc != NO_TABLE) {
                    tv *= t_elem(p.lora_sc + m * p.lora_sc_stride + p.seg_t.x + j);
                }
            }
            put_x(idx / TM, r, tv);
        }
        for (var idx = li; idx < BK * TN; idx += WG) {
            let c = idx % TN;
            let j = k0 + idx / TN;
            var bv = 0.0;
            if (j < rank) {
                bv = b_elem(p.seg_b.x + (p.lora_row0 + min(col0 + c, p.n - 1u)) * rank + j);
            }
            put_w(idx / TN, c, bv);
        }
        workgroupBarrier();
        if (live_rows(row0, lid)) {
            fma_tile(acc, lid);
        }
    }
}

// Store the tile (slice wg.z's partial at its own place in the scratch of a split reduction).
fn store_tile(acc: ptr<function, array<vec4<f32>, 16>>, wg: vec3<u32>, lid: vec3<u32>) {
    let base = p.y_offset + wg.z * p.m * p.y_stride;
    for (var half = 0u; half < TN / 64u; half++) {
        for (var i = 0u; i < RM; i++) {
            let r = wg.y * TM + lid.y * RM + i;
            let v = (*acc)[half * 8u + i];
            for (var j = 0u; j < 4u; j++) {
                let c = wg.x * TN + half * 64u + lid.x * 4u + j;
                if (r < p.m && c < p.n) {
                    let idx = base + r * p.y_stride + c;
                    if (ACCUMULATE) {
                        y[idx] = y[idx] + v[j];
                    } else {
                        y[idx] = v[j];
                    }
                }
            }
        }
    }
}

@compute @workgroup_size(16, TM / RM)
fn matmul(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    var acc: array<vec4<f32>, 16>;
    base_tile(&acc, wg, lid, li);
    store_tile(&acc, wg, lid);
}

@compute @workgroup_size(16, TM / RM)
fn matmul_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    var acc: array<vec4<f32>, 16>;
    base_tile(&acc, wg, lid, li);
    lora_tile(&acc, wg, lid, li);
    store_tile(&acc, wg, lid);
}
