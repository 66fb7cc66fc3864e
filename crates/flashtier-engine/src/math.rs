//! Host arithmetic shared by the reference paths: the CPU device's kernels
//! and the families' host-side rules (routing) use the same function, so
//! the two can never round differently.

/// Softmax in place: max-subtracted, f32, summed in ascending index.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}
