// Workgroup tree reductions (the loader appends this file for the shaders that use them): every
// invocation of the workgroup passes its value and gets the reduction of all WG values (the
// shader's `const WG`, a power of two), summed or maxed pairwise from halves of WG down to 1.
// `red` is free again when they return (a barrier after the result is read).

var<workgroup> red: array<f32, WG>;

fn reduce_sum(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_max(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
