//! The draw itself: the kept candidates (top-k, top-p, min-p over the
//! weights, ties broken by the lower id) and the walk that picks one of
//! them from a uniform draw.

/// A uniform draw in [0, 1) from 53 random bits.
pub(super) fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The token at `u` of the whole mass, in index order.
pub(super) fn walk_all(w: &[f64], u: f64) -> u32 {
    let target = u * w.iter().sum::<f64>();
    let mut acc = 0.0;
    for (i, &x) in w.iter().enumerate() {
        acc += x;
        if target < acc {
            return i as u32;
        }
    }
    w.iter().rposition(|&x| x > 0.0).unwrap_or(0) as u32
}

/// The token at `u` of the mass of `order` (weights `w`, in that order).
pub(super) fn walk(w: &[f64], order: &[u32], u: f64) -> u32 {
    let total: f64 = order.iter().map(|&i| w[i as usize]).sum();
    let target = u * total;
    let mut acc = 0.0;
    for &i in order {
        acc += w[i as usize];
        if target < acc {
            return i;
        }
    }
    // Rounding left the target at the very end: the last token with mass.
    order
        .iter()
        .rev()
        .copied()
        .find(|&i| w[i as usize] > 0.0)
        .unwrap_or(order.first().copied().unwrap_or(0))
}

/// Probability descending, then index ascending.
pub(super) fn by_weight(w: &[f64]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    move |a, b| w[*b as usize].total_cmp(&w[*a as usize]).then(a.cmp(b))
}

/// The tokens top-k, top-p and min-p keep, in walk order. Sorts only the
/// candidates it needs: the top `k`, or (top-p alone) a prefix grown 8x
/// at a time from 64 until it holds p of the mass. Top-p's mass is the
/// top-k's when top-k is set, else the whole vocabulary's (summed in index
/// order).
pub(super) fn keep(w: &[f64], top_k: usize, top_p: f32, min_p: f32) -> Vec<u32> {
    let n = w.len();
    let cmp = by_weight(w);
    let total: f64 = w.iter().sum();
    let mut ids: Vec<u32> = (0..n as u32).collect();
    let mut want = match top_k {
        0 if top_p < 1.0 => n.min(64),
        0 => n,
        k => k.min(n),
    };
    let mut kept = loop {
        if want < n {
            ids.select_nth_unstable_by(want - 1, &cmp);
        }
        let mut head = ids[..want].to_vec();
        head.sort_unstable_by(&cmp);
        if top_k != 0 || want == n {
            break head;
        }
        let mass: f64 = head.iter().map(|&i| w[i as usize]).sum();
        if mass >= f64::from(top_p) * total {
            break head;
        }
        want = (want * 8).min(n);
    };
    if top_p < 1.0 {
        let mass = if top_k == 0 {
            total
        } else {
            kept.iter().map(|&i| w[i as usize]).sum()
        };
        let limit = f64::from(top_p) * mass;
        let mut acc = 0.0;
        let mut cut = kept.len();
        for (j, &i) in kept.iter().enumerate() {
            acc += w[i as usize];
            if acc >= limit {
                cut = j + 1;
                break;
            }
        }
        kept.truncate(cut.max(1));
    }
    if min_p > 0.0 {
        let top = kept.first().map_or(0.0, |&i| w[i as usize]);
        let floor = f64::from(min_p) * top;
        kept.retain(|&i| w[i as usize] >= floor);
    }
    kept
}
