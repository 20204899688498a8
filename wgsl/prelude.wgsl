// Shared helpers, prepended to every shader by the loader (`Shader::source`).

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// x * sigmoid(x), written as x / (1 + e^-x).
fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

// log(1 + e^u), linear above 20 (as torch's softplus threshold).
fn softplus(u: f32) -> f32 {
    if (u > 20.0) {
        return u;
    }
    return log(1.0 + exp(u));
}
