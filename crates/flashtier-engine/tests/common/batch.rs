//! A batched decode against each of its sequences decoded alone: the
//! schedule joins sequences at different steps, splits one prompt into
//! chunks that share steps with the others' decode tokens, and reads the
//! logits of every row that has them.

use flashtier_engine::Model;
use flashtier_engine::device::{Device, KvState};
use flashtier_engine::model::{RowOut, SeqStep, Want};

/// One sequence of a schedule: its prompt, the step it joins at, the
/// prompt chunk size it is fed in, and how many tokens it decodes.
#[derive(Clone, Debug)]
pub struct Planned {
    pub prompt: Vec<u32>,
    pub joins_at: usize,
    pub chunk: usize,
    pub new_tokens: usize,
}

/// Per sequence: the logits of its prompt's last row, then of every
/// decode step's row, and the greedy tokens taken from them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    pub logits: Vec<Vec<f32>>,
    pub tokens: Vec<u32>,
}

fn greedy(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// `plan`'s sequences decoded one after the other, each alone in its steps.
pub fn alone<D: Device>(m: &mut Model<D>, plan: &[Planned]) -> Vec<Trace> {
    plan.iter()
        .map(|p| {
            let mut kv = m.new_kv(m.context_limit()).unwrap();
            let mut t = Trace::default();
            let mut last = Vec::new();
            for c in p.prompt.chunks(p.chunk) {
                let mut e = [SeqStep {
                    kv: &mut kv,
                    tokens: c,
                    want: Want::Logits,
                }];
                last = logits_of(m.step_batch(&mut e).unwrap().remove(0));
            }
            for _ in 0..p.new_tokens {
                let tok = greedy(&last);
                t.logits.push(last);
                t.tokens.push(tok);
                let mut e = [SeqStep {
                    kv: &mut kv,
                    tokens: &[tok],
                    want: Want::Logits,
                }];
                last = logits_of(m.step_batch(&mut e).unwrap().remove(0));
            }
            t
        })
        .collect()
}

/// `plan`'s sequences decoded together: each step holds every joined
/// sequence's next prompt chunk or decode token.
pub fn batched<D: Device>(m: &mut Model<D>, plan: &[Planned]) -> Vec<Trace> {
    let mut kvs: Vec<D::Kv> = plan
        .iter()
        .map(|_| m.new_kv(m.context_limit()).unwrap())
        .collect();
    let mut traces = vec![Trace::default(); plan.len()];
    let mut fed = vec![0usize; plan.len()];
    let mut next: Vec<Option<u32>> = vec![None; plan.len()];
    for step in 0.. {
        let mut toks: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, p) in plan.iter().enumerate() {
            if step < p.joins_at || traces[i].tokens.len() > p.new_tokens {
                continue;
            }
            if fed[i] < p.prompt.len() {
                let end = (fed[i] + p.chunk).min(p.prompt.len());
                toks.push((i, p.prompt[fed[i]..end].to_vec()));
                fed[i] = end;
            } else if let Some(t) = next[i] {
                toks.push((i, vec![t]));
            }
        }
        if toks.is_empty() {
            if plan.iter().all(|p| step >= p.joins_at) {
                break;
            }
            continue;
        }
        let mut taken: Vec<Option<&mut D::Kv>> = kvs.iter_mut().map(Some).collect();
        let mut entries: Vec<SeqStep<'_, D>> = toks
            .iter()
            .map(|(i, t)| {
                let done_prompt = fed[*i] == plan[*i].prompt.len();
                SeqStep {
                    kv: taken[*i].take().unwrap(),
                    tokens: t,
                    want: if done_prompt {
                        Want::Logits
                    } else {
                        Want::Nothing
                    },
                }
            })
            .collect();
        let outs = match m.step_batch(&mut entries) {
            Ok(o) => o,
            Err(e) => panic!("step {step} {:?}: {e:?}", toks),
        };
        drop(entries);
        for ((i, _), out) in toks.iter().zip(outs) {
            if let RowOut::Logits(row) = out {
                let t = &mut traces[*i];
                if t.tokens.len() < plan[*i].new_tokens {
                    let tok = greedy(&row);
                    t.logits.push(row);
                    t.tokens.push(tok);
                    next[*i] = Some(tok);
                } else {
                    // The step after the last token: nothing more to take.
                    t.tokens.push(u32::MAX);
                }
            }
        }
    }
    for (t, kv) in traces.iter_mut().zip(&kvs) {
        t.tokens.retain(|&x| x != u32::MAX);
        assert!(kv.len() > 0);
    }
    traces
}

fn logits_of(out: RowOut) -> Vec<f32> {
    match out {
        RowOut::Logits(v) => v,
        other => panic!("asked for logits, got {other:?}"),
    }
}

/// Four sequences over `prompt`'s tokens (rotated, cut to different
/// lengths), joining at steps 0, 0, 2 and 3; one fed in chunks of 3.
pub fn plan_of(prompt: &[u32], new_tokens: usize) -> Vec<Planned> {
    let n = prompt.len();
    let rot =
        |k: usize, len: usize| -> Vec<u32> { (0..len).map(|i| prompt[(i + k) % n]).collect() };
    vec![
        Planned {
            prompt: prompt.to_vec(),
            joins_at: 0,
            chunk: n,
            new_tokens,
        },
        Planned {
            prompt: rot(1, n.saturating_sub(2).max(1)),
            joins_at: 0,
            chunk: 3,
            new_tokens,
        },
        Planned {
            prompt: rot(3, 1),
            joins_at: 2,
            chunk: 1,
            new_tokens: new_tokens + 1,
        },
        Planned {
            prompt: rot(5, n),
            joins_at: 3,
            chunk: n,
            new_tokens: new_tokens.saturating_sub(1).max(1),
        },
    ]
}
