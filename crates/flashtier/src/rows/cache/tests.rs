use super::*;

fn row(id: u64) -> Vec<u8> {
    (0..264u64)
        .map(|i| (id.wrapping_mul(31) ^ i) as u8)
        .collect()
}

/// `get_many` agrees with `get` and with the inserted bytes for the
/// compiled-in Engram shapes, a way count without one (3), and
/// geometries with odd byte counts or no scale at all.
#[test]
fn get_many_matches_get_for_every_shape() {
    let shapes = [
        (RowGeometry::ENGRAM, 1),
        (RowGeometry::ENGRAM, 3),
        (RowGeometry::ENGRAM, 4),
        (RowGeometry::ENGRAM, 16),
        (
            RowGeometry {
                weight_bytes: 100,
                scale_bytes: 0,
            },
            4,
        ),
        (
            RowGeometry {
                weight_bytes: 37,
                scale_bytes: 5,
            },
            2,
        ),
    ];
    for (g, ways) in shapes {
        let (w, s) = (g.w(), g.s());
        let c = RowCache::new(1 << 16, ways, g)
            .expect("valid")
            .expect("fits");
        let bytes = |id: u64| -> Vec<u8> {
            (0..g.stride() as u64)
                .map(|i| (id.wrapping_mul(77) ^ i) as u8)
                .collect()
        };
        for id in (0..400u64).step_by(2) {
            c.insert(id, &bytes(id));
        }
        let ids: Vec<u64> = (0..150u64).map(|i| (i * 37) % 400).collect();
        let (mut wo, mut so) = (vec![0xAAu8; ids.len() * w], vec![0xAAu8; ids.len() * s]);
        let mut missed = Vec::new();
        let hits = c.get_many(&ids, &mut wo, &mut so, &mut missed);
        assert_eq!(hits as usize + missed.len(), ids.len(), "{g:?} x {ways}");
        for (i, &id) in ids.iter().enumerate() {
            let (mut w1, mut s1) = (vec![0u8; w], vec![0u8; s]);
            let hit = c.get(id, &mut w1, &mut s1);
            assert_eq!(hit, !missed.contains(&i), "{g:?} x {ways}: id {id}");
            if hit {
                let want = bytes(id);
                assert_eq!(
                    &wo[i * w..(i + 1) * w],
                    &want[..w],
                    "{g:?} x {ways}: id {id}"
                );
                assert_eq!(
                    &so[i * s..(i + 1) * s],
                    &want[w..],
                    "{g:?} x {ways}: id {id}"
                );
                assert_eq!((w1.as_slice(), s1.as_slice()), want.split_at(w));
            }
        }
        assert!(hits > 0, "{g:?} x {ways}: nothing cached");
    }
}

#[test]
fn budget_and_ways_bounds() {
    let g = RowGeometry::ENGRAM;
    assert!(RowCache::new(1 << 20, 0, g).is_err());
    assert!(RowCache::new(1 << 20, 17, g).is_err());
    assert!(RowCache::new(10, 4, g).expect("valid").is_none());
    for ways in [1, 4, 16] {
        let c = RowCache::new(1 << 20, ways, g)
            .expect("valid")
            .expect("fits");
        assert!(c.bytes() <= 1 << 20);
        assert_eq!(c.slots(), c.sets() * ways);
    }
}

#[test]
fn hit_returns_exact_row_and_miss_returns_false() {
    let c = RowCache::new(1 << 16, 4, RowGeometry::ENGRAM)
        .expect("valid")
        .expect("fits");
    let mut w = vec![0u8; 256];
    let mut s = vec![0u8; 8];
    assert!(!c.get(5, &mut w, &mut s));
    c.insert(5, &row(5));
    assert!(c.get(5, &mut w, &mut s));
    assert_eq!(w, row(5)[..256]);
    assert_eq!(s, row(5)[256..]);
}

#[test]
fn get_many_matches_get_row_by_row() {
    let c = RowCache::new(1 << 20, 4, RowGeometry::ENGRAM)
        .expect("valid")
        .expect("fits");
    // Every third id cached, over more than three probe groups.
    let ids: Vec<u64> = (0..3 * PROBE_GROUP as u64 + 5).map(|i| i * 7 + 1).collect();
    for &id in ids.iter().step_by(3) {
        c.insert(id, &row(id));
    }
    let (mut w, mut s) = (vec![0xAAu8; ids.len() * 256], vec![0xAAu8; ids.len() * 8]);
    let mut missed = Vec::new();
    let hits = c.get_many(&ids, &mut w, &mut s, &mut missed);
    let want_missed: Vec<usize> = (0..ids.len()).filter(|i| i % 3 != 0).collect();
    assert_eq!(missed, want_missed);
    assert_eq!(hits as usize, ids.len() - want_missed.len());
    for (i, &id) in ids.iter().enumerate().step_by(3) {
        assert_eq!(w[i * 256..(i + 1) * 256], row(id)[..256], "weights of {id}");
        assert_eq!(s[i * 8..(i + 1) * 8], row(id)[256..], "scales of {id}");
    }
    for &i in &missed {
        assert!(
            w[i * 256..(i + 1) * 256].iter().all(|&b| b == 0xAA),
            "a miss is left untouched"
        );
    }
}

#[test]
fn odd_geometry_round_trips() {
    let g = RowGeometry {
        weight_bytes: 13,
        scale_bytes: 3,
    };
    let c = RowCache::new(1 << 12, 2, g).expect("valid").expect("fits");
    let r: Vec<u8> = (1..=16).collect();
    c.insert(9, &r);
    let (mut w, mut s) = (vec![0u8; 13], vec![0u8; 3]);
    assert!(c.get(9, &mut w, &mut s));
    assert_eq!(w, r[..13]);
    assert_eq!(s, r[13..]);
}

#[test]
fn a_set_never_holds_more_than_its_ways_and_keeps_referenced_rows() {
    let c = RowCache::new(1 << 14, 4, RowGeometry::ENGRAM)
        .expect("valid")
        .expect("fits");
    let (mut w, mut s) = (vec![0u8; 256], vec![0u8; 8]);
    c.insert(0, &row(0));
    assert!(c.get(0, &mut w, &mut s)); // referenced
    let same_set: Vec<u64> = (1..100_000u64)
        .filter(|&i| c.set_of(i) == c.set_of(0))
        .take(12)
        .collect();
    for &id in &same_set {
        c.insert(id, &row(id));
        assert!(
            c.get(0, &mut w, &mut s),
            "the referenced row survives one sweep"
        );
    }
    let resident = same_set.iter().filter(|&&i| c.contains(i)).count() + usize::from(c.contains(0));
    assert!(resident <= 4);
    for id in same_set.iter().filter(|&&i| c.contains(i)) {
        assert!(c.get(*id, &mut w, &mut s));
        assert_eq!(w, row(*id)[..256]);
    }
}

/// The vectorised seqlock copy under churn: writers keep evicting and
/// refilling one set's ways with other rows while readers copy from it;
/// every row a reader accepts must be exactly the row of its id.
#[test]
fn readers_racing_evictions_in_one_set_never_see_a_torn_row() {
    let c = RowCache::new(1 << 14, 2, RowGeometry::ENGRAM)
        .expect("valid")
        .expect("fits");
    let ids: Vec<u64> = (0..1_000_000u64)
        .filter(|&i| c.set_of(i) == c.set_of(0))
        .take(6)
        .collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..2usize {
            let (c, ids, stop) = (&c, &ids, &stop);
            s.spawn(move || {
                for round in 0..20_000usize {
                    let id = ids[(round * 5 + t) % ids.len()];
                    c.insert(id, &row(id));
                }
                stop.store(true, Ordering::Relaxed);
            });
        }
        for t in 0..3usize {
            let (c, ids, stop) = (&c, &ids, &stop);
            s.spawn(move || {
                let (mut w, mut sc) = (vec![0u8; 256], vec![0u8; 8]);
                let mut k = t;
                while !stop.load(Ordering::Relaxed) {
                    let id = ids[k % ids.len()];
                    k += 1;
                    if c.get(id, &mut w, &mut sc) {
                        let want = row(id);
                        assert_eq!(w, want[..256], "torn weights of row {id}");
                        assert_eq!(sc, want[256..], "torn scales of row {id}");
                    }
                }
            });
        }
    });
}
