//! Top-k selection that keeps exactly the entries torch's CPU `topk` keeps,
//! ties included.
//!
//! The references flashtier matches are computed by `torch.topk` on the
//! CPU. It copies a slice into (value, index) pairs and orders them by
//! "larger value first, NaN above every number" with one of two unstable
//! selections from the C++ standard library (libstdc++):
//!
//! - `partial_sort` over the first k when `k * 64 <= n`, whose kept set is
//!   that of a heap selection;
//! - otherwise `nth_element` at `k - 1` (introselect: median-of-three
//!   quickselect, a heap selection when the depth budget `2 * log2(n)` runs
//!   out, an insertion sort below four elements).
//!
//! Equal values are interchangeable to both, so which of several tied
//! entries survives the keep/drop line is whatever the algorithm's swaps
//! leave in front: `topk([2.65, 0, 0, 4.86], 3)` keeps {3, 0, 2}, not
//! {3, 0, 1}. Block scores of the QSA indexer are sums of ReLUs, so exact
//! ties at 0 are common there, and keeping another block than transformers
//! changes every later position. [`kept`] replays both selections step for
//! step (the same comparisons and swaps, so the same survivors) and is the
//! one top-k of the engine's reference paths: routers and the indexer.
//!
//! `tests/torch_topk.rs` checks it against a table made by torch itself
//! (`tools/make_topk_table.py`): every n up to 320 and several longer ones,
//! every k, on tie-heavy vectors.

/// One entry as torch's queue holds it: (value, index).
type Entry = (f32, u32);

/// torch's order for `largest=True`: `a` goes before `b`.
#[inline]
fn ahead(a: &Entry, b: &Entry) -> bool {
    (a.0.is_nan() && !b.0.is_nan()) || a.0 > b.0
}

/// The indices of the `k` entries of `x` torch's CPU `topk(x, k)` keeps,
/// ascending. `k` above `x.len()` keeps everything (torch refuses it; the
/// callers clamp).
pub fn kept(x: &[f32], k: usize) -> Vec<usize> {
    let n = x.len();
    if k == 0 {
        return Vec::new();
    }
    if k >= n {
        return (0..n).collect();
    }
    let mut queue: Vec<Entry> = x.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
    if k * 64 <= n {
        // partial_sort's survivors; its final heap sort only reorders them.
        heap_select(&mut queue, k);
    } else {
        nth_element(&mut queue, k - 1);
    }
    let mut out: Vec<usize> = queue[..k].iter().map(|e| e.1 as usize).collect();
    out.sort_unstable();
    out
}

/// The `k` entries torch keeps as (index, value), largest first: NaN above
/// every number, equal values by index.
pub fn top_k(x: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut out: Vec<(usize, f32)> = kept(x, k).into_iter().map(|i| (i, x[i])).collect();
    out.sort_by(|a, b| {
        let (ea, eb) = ((a.1, a.0 as u32), (b.1, b.0 as u32));
        if ahead(&ea, &eb) {
            std::cmp::Ordering::Less
        } else if ahead(&eb, &ea) {
            std::cmp::Ordering::Greater
        } else {
            a.0.cmp(&b.0)
        }
    });
    out
}

/// `floor(log2(n))`, n >= 1.
fn log2_floor(n: usize) -> u32 {
    usize::BITS - 1 - n.leading_zeros()
}

/// `nth_element(v.begin(), v.begin() + nth, v.end())`: `v[nth]` is what a
/// sort would put there and nothing after it goes ahead of it.
fn nth_element(v: &mut [Entry], nth: usize) {
    let (mut lo, mut hi) = (0, v.len());
    if nth >= hi {
        return;
    }
    let mut depth = 2 * log2_floor(hi);
    while hi - lo > 3 {
        if depth == 0 {
            heap_select(&mut v[lo..hi], nth - lo + 1);
            v.swap(lo, nth);
            return;
        }
        depth -= 1;
        let cut = lo + partition_around_median(&mut v[lo..hi]);
        if cut <= nth {
            lo = cut;
        } else {
            hi = cut;
        }
    }
    insertion_sort(&mut v[lo..hi]);
}

/// The median of `v[1]`, `v[mid]` and `v[last]` moved to `v[0]` as the
/// pivot, then `v[1..]` partitioned around it; returns the cut (the first
/// position of the part that is not ahead of the pivot). `v.len() > 3`.
fn partition_around_median(v: &mut [Entry]) -> usize {
    let n = v.len();
    let (a, b, c) = (1, n / 2, n - 1);
    let median = if ahead(&v[a], &v[b]) {
        if ahead(&v[b], &v[c]) {
            b
        } else if ahead(&v[a], &v[c]) {
            c
        } else {
            a
        }
    } else if ahead(&v[a], &v[c]) {
        a
    } else if ahead(&v[b], &v[c]) {
        c
    } else {
        b
    };
    v.swap(0, median);
    // Hoare's scheme with the pivot at v[0]: the median of three bounds
    // both scans; the explicit bounds only keep a broken order from
    // indexing out of range (the order here is a strict weak order).
    let pivot = v[0];
    let (mut first, mut last) = (1, n);
    loop {
        while first < n - 1 && ahead(&v[first], &pivot) {
            first += 1;
        }
        last -= 1;
        while last > 1 && ahead(&pivot, &v[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        v.swap(first, last);
        first += 1;
    }
}

/// Straight insertion sort in the `ahead` order, as libstdc++ writes it:
/// an entry ahead of the first shifts the whole prefix, any other one
/// walks back while it is ahead of its left neighbour.
fn insertion_sort(v: &mut [Entry]) {
    for i in 1..v.len() {
        let val = v[i];
        if ahead(&val, &v[0]) {
            v.copy_within(0..i, 1);
            v[0] = val;
        } else {
            let mut j = i;
            while j > 1 && ahead(&val, &v[j - 1]) {
                v[j] = v[j - 1];
                j -= 1;
            }
            v[j] = val;
        }
    }
}

/// Heap selection: the first `middle` entries become the `middle` first in
/// the order (as a heap whose top is the last of them), every later entry
/// ahead of the top replacing it.
fn heap_select(v: &mut [Entry], middle: usize) {
    make_heap(&mut v[..middle]);
    for i in middle..v.len() {
        if ahead(&v[i], &v[0]) {
            // pop_heap(first, middle, i): v[i] takes the top's place in the
            // heap, the top goes to i.
            let value = v[i];
            v[i] = v[0];
            sift(v, 0, middle, value);
        }
    }
}

fn make_heap(v: &mut [Entry]) {
    let len = v.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = v[parent];
        sift(v, parent, len, value);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// libstdc++'s `__adjust_heap`: walk the hole at `hole` down to a leaf
/// along the child that goes last in the order, then push `value` back up
/// from there (not above `hole`).
fn sift(v: &mut [Entry], hole: usize, len: usize, value: Entry) {
    let top = hole;
    let mut hole = hole;
    let mut child = hole;
    while len >= 1 && child < (len - 1) / 2 {
        child = 2 * (child + 1);
        if ahead(&v[child], &v[child - 1]) {
            child -= 1;
        }
        v[hole] = v[child];
        hole = child;
    }
    if len % 2 == 0 && len >= 2 && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        v[hole] = v[child - 1];
        hole = child - 1;
    }
    while hole > top {
        let parent = (hole - 1) / 2;
        if !ahead(&v[parent], &value) {
            break;
        }
        v[hole] = v[parent];
        hole = parent;
    }
    v[hole] = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_keep_what_torch_keeps() {
        // torch.topk(torch.tensor([2.65, 0, 0, 4.86]), 3).indices == [3, 0, 2].
        assert_eq!(kept(&[2.65, 0.0, 0.0, 4.86], 3), vec![0, 2, 3]);
        assert_eq!(
            top_k(&[2.65, 0.0, 0.0, 4.86], 3),
            vec![(3, 4.86), (0, 2.65), (2, 0.0)]
        );
    }

    #[test]
    fn edges() {
        assert!(kept(&[1.0, 2.0], 0).is_empty());
        assert_eq!(kept(&[1.0, 2.0], 5), vec![0, 1]);
        assert!(kept(&[], 3).is_empty());
        // NaN ranks above every number.
        assert_eq!(kept(&[1.0, f32::NAN, 3.0], 1), vec![1]);
        assert_eq!(top_k(&[1.0, f32::NAN, 3.0], 2)[0].0, 1);
    }

    /// Whatever ties do, the kept set holds the k best values: each kept
    /// value is at least each dropped one, in torch's order.
    #[test]
    fn kept_values_dominate_dropped_ones() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for case in 0..400usize {
            let n = 1 + case % 150;
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    match s % 11 {
                        0 => 0.0,
                        1 => -0.0,
                        2 => f32::NAN,
                        _ => ((s >> 40) % 5) as f32,
                    }
                })
                .collect();
            for k in [1, 2, 3, n / 64, n / 2, n.saturating_sub(1), n] {
                let keep = kept(&x, k);
                assert_eq!(keep.len(), k.min(n), "n {n} k {k}");
                let inside: Vec<bool> = (0..n).map(|i| keep.binary_search(&i).is_ok()).collect();
                for (i, &a) in inside.iter().enumerate() {
                    for (j, &b) in inside.iter().enumerate() {
                        if a && !b {
                            let (ei, ej) = ((x[i], i as u32), (x[j], j as u32));
                            assert!(
                                !ahead(&ej, &ei),
                                "n {n} k {k}: dropped {j} ahead of kept {i}"
                            );
                        }
                    }
                }
            }
        }
    }
}
