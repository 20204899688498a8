// matvec.wgsl's kernels with the row groups' partial sums reduced by subgroup shuffles instead
// of workgroup memory: no barrier, nothing staged (the loader appends this file to matvec.wgsl;
// the engine compiles it only on a device with wgpu's SUBGROUP feature).
//
// No subgroup size is assumed: a row group is `l = min(LANES, subgroup size)` consecutive lanes
// of one subgroup (by subgroup id and subgroup invocation id), striding along K by l. Subgroups
// must be full (subgroup_size_probe checks that, and their order, once per device). The
// workgroup's rows (8 * 64 / LANES, as the host dispatched them) belong to its first 64 / LANES
// row groups; when the subgroup is narrower than LANES there are more row groups than that and
// the others stay idle, slower but exact. After the product, log2(l) shuffle-xor steps leave
// each lane of a row group holding its 8 rows' sums; lane q stores output q of the group (and
// q + l, ... when l < 8).
//
// SPLIT (the host sets it where LANES is wider than the subgroup it measured): a row group is
// LANES consecutive invocations, as in the portable kernel, so every lane works; each block of
// l lanes (one subgroup, or all of the row group when the subgroup turns out at least LANES wide)
// sums its 8 rows by shuffles, its first lane leaves them in workgroup memory, and after one
// barrier every lane of the row group adds its LANES / l blocks' sums in block order.

override SPLIT: bool = false;

var<workgroup> blocks: array<vec4<f32>, 128>; // SPLIT: each block's sums of rows 0-3, 4-7
var<workgroup> block_ssq: array<f32, 64>;     // SPLIT, NORM: each block's sum of x^2

fn slot_sg(wg: vec3<u32>, nwg: vec3<u32>, li: u32, sg_id: u32, sg_lane: u32, sg_size: u32) -> Slot {
    let row0 = (wg.y * nwg.x + wg.x) * outputs() * (WG / LANES);
    if (SPLIT) {
        return Slot(row0, li / LANES, li % LANES, LANES);
    }
    let l = min(LANES, sg_size);
    return Slot(row0, sg_id * (sg_size / l) + sg_lane / l, sg_lane % l, l);
}

// Whether the slot's row group computes rows of this workgroup.
fn computes(s: Slot) -> bool {
    return s.group < WG / LANES;
}

// v summed over the aligned block of `l` lanes this lane is in (l a power of two up to the
// subgroup size), in every lane of the block.
fn block_sum4(v: vec4<f32>, l: u32) -> vec4<f32> {
    var sum = v;
    for (var m = 1u; m < l; m <<= 1u) {
        sum += subgroupShuffleXor(sum, m);
    }
    return sum;
}

fn block_sum(v: f32, l: u32) -> f32 {
    var sum = v;
    for (var m = 1u; m < l; m <<= 1u) {
        sum += subgroupShuffleXor(sum, m);
    }
    return sum;
}

// The row group's 8 row sums in every lane of it (rows 0-3, 4-7), and for NORM the norm scale.
struct Sums {
    lo: vec4<f32>,
    hi: vec4<f32>,
    scale: f32,
}

fn reduce_sg(s: Slot, li: u32, sg_size: u32) -> Sums {
    var part = Partials(vec4<f32>(0.0), vec4<f32>(0.0), 0.0);
    if (computes(s)) {
        part = base_partials(s);
    }
    let l = min(s.stride, sg_size);
    var sums = Sums(block_sum4(part.lo, l), block_sum4(part.hi, l), 1.0);
    var ssq = 0.0;
    if (NORM) {
        ssq = block_sum(part.ssq, l);
    }
    if (SPLIT) {
        let b = li / l;
        if (li % l == 0u) {
            blocks[2u * b] = sums.lo;
            blocks[2u * b + 1u] = sums.hi;
            block_ssq[b] = ssq;
        }
        workgroupBarrier();
        let first = s.group * (LANES / l);
        sums.lo = vec4<f32>(0.0);
        sums.hi = vec4<f32>(0.0);
        ssq = 0.0;
        for (var j = first; j < first + LANES / l; j++) {
            sums.lo += blocks[2u * j];
            sums.hi += blocks[2u * j + 1u];
            ssq += block_ssq[j];
        }
    }
    if (NORM) {
        sums.scale = inverseSqrt(ssq / f32(p.k) + p.eps);
    }
    return sums;
}

// Output q of the row group (with GLU the gate sum in x, the up sum in y), norm-scaled.
fn output_sg(sums: Sums, q: u32) -> vec2<f32> {
    var all = array<f32, 8>(sums.lo.x, sums.lo.y, sums.lo.z, sums.lo.w, sums.hi.x, sums.hi.y, sums.hi.z, sums.hi.w);
    var v = vec2<f32>(all[q], 0.0);
    if (GLU) {
        v.y = all[q + TM / 2u];
    }
    return v * sums.scale;
}

@compute @workgroup_size(64)
fn matvec_sg(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let s = slot_sg(wg, nwg, li, sg_id, sg_lane, sg_size);
    let sums = reduce_sg(s, li, sg_size);
    for (var q = s.lane; q < outputs(); q += s.stride) {
        let o = s.group * outputs() + q;
        if (computes(s) && s.row0 + o < p.n) {
            store(s, o, output_sg(sums, q));
        }
    }
    if (writes_out()) {
        write_out(s.row0, wg.y * nwg.x + wg.x, li);
    }
}

@compute @workgroup_size(64)
fn matvec_sg_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let s = slot_sg(wg, nwg, li, sg_id, sg_lane, sg_size);
    if (t_staged()) {
        // The staged t in workgroup memory before any lane's expand reads it.
        stage_t(li);
        workgroupBarrier();
    }
    let sums = reduce_sg(s, li, sg_size);
    for (var q = s.lane; q < outputs(); q += s.stride) {
        let o = s.group * outputs() + q;
        if (computes(s) && s.row0 + o < p.n) {
            var v = output_sg(sums, q);
            let f = expand_scale(sums.scale);
            v.x += f * lora_row(s.row0 + o);
            if (GLU) {
                v.y += f * lora_row(p.n + s.row0 + o);
            }
            store(s, o, v);
        }
    }
    if (writes_out()) {
        write_out(s.row0, wg.y * nwg.x + wg.x, li);
    }
}

// The subgroup size a 64-invocation workgroup of this module runs with, into y[0] (the host
// picks LANES by it once per device; Metal and some Vulkan drivers report only a range), and a 1
// into y[1] when a subgroup is not full or the subgroups do not number the invocations in order
// (the kernels above need full subgroups, and naga's HLSL derives subgroup_id from that order):
// the host then keeps the portable kernels.
@compute @workgroup_size(64)
fn subgroup_size_probe(
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    let members = subgroupAdd(1u);
    if (li == 0u) {
        y[0] = f32(sg_size);
    }
    if (members != min(sg_size, WG) || sg_id * sg_size + sg_lane != li) {
        y[1] = 1.0;
    }
}
